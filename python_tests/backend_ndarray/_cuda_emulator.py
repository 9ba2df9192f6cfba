"""Run the CUDA backend's .cu kernels on the host, for tests on machines without a GPU.

A tiny stand-in for the parts of CuPy that ``needle.backend_ndarray._cuda.runtime`` and
``ndarray_backend_cuda`` use. ``RawModule`` compiles the very source NVRTC would get with g++
(C++20), after a shim header that maps the CUDA built-ins to host code. A launch runs on the
calling host thread: its blocks one after another, each CUDA thread of a block a fiber (a
64 KiB stack of its own, kept for the next launches; a hand-written x86-64 context switch,
``swapcontext`` elsewhere), so a launch costs microseconds, not the creation of a host thread
per CUDA thread. A fiber runs until it returns or waits at a barrier: ``__syncthreads`` waits
for the block's barrier, ``__shfl_down_sync`` exchanges values through a per-warp buffer
between two waits at its warp's barrier, and a waiting fiber is runnable again once the
barrier's generation has passed. The scheduler takes the warps round robin and runs each as
far as it can go before the next, as far ahead of the others as the block's barrier lets it;
warps and lanes are visited in a few fixed pseudo-random orders. So a missing barrier lets
some thread read before another writes, whichever way the data flows, and every run of a
launch interleaves the same way. A pass that can resume no fiber while some have not returned
is a deadlock (a barrier in divergent code): the launch is abandoned and raises RuntimeError.
``__shared__`` arrays are static. So every index computation, bound guard, barrier and
reduction tree of the kernels runs for real; only speed and memory-model subtleties are not
those of a GPU. Device memory is host memory.

Example:
    >>> emu = FakeCupy()          # doctest: +SKIP
    >>> runtime._cupy = emu        # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading

import numpy as np

SHIM = r"""
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>
#include <vector>
// NEEDLE_EMU_UCONTEXT: the portable switch on x86-64 too (to check it where it is not used)
#if defined(__x86_64__) && !defined(NEEDLE_EMU_UCONTEXT)
#define EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(n)
#define __align__(n) alignas(n)
#define __shared__ static
struct emu_dim3 { unsigned x = 1, y = 1, z = 1; };
// Every CUDA thread of a launch runs on the calling host thread: the scheduler sets
// threadIdx before it resumes a fiber.
inline emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
using std::max;
using std::min;

// ---- fibers: one per CUDA thread of a block, all on one host thread --------------------------
struct emu_barrier { unsigned expected = 0, arrived = 0, generation = 0; };
struct emu_fiber {
  char* stack = nullptr;                  // EMU_STACK_BYTES, above a guard page
  const emu_barrier* waits_on = nullptr;  // null: runnable
  unsigned generation = 0;                // of waits_on when this fiber arrived
  bool done = false;
#if EMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t context;
#endif
};
constexpr std::size_t EMU_STACK_BYTES = 64 << 10;
inline std::vector<emu_fiber> emu_fibers;  // grown to the largest block; stacks are reused
inline emu_fiber* emu_running = nullptr;
inline unsigned emu_unfinished = 0;        // fibers of the block that have not returned
inline void (*emu_body)() = nullptr;       // the launch's kernel, bound to its arguments
inline char emu_error[512];
[[noreturn]] void emu_fiber_main();

#if EMU_ASM_SWITCH
// A context switch saves what the SysV ABI makes callee-saved (six registers, the stack
// pointer) and nothing else: no signal mask syscall as swapcontext makes.
extern "C" {  // not `extern "C" void`: _KERNEL_NAME would take it for a kernel
void emu_switch(void** save_sp, void* load_sp);
}
asm(R"ASM(
  .text
  .p2align 4
  .globl emu_switch
  .hidden emu_switch
  .type emu_switch, @function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch, .-emu_switch
)ASM");
inline void* emu_scheduler_sp = nullptr;
// The first switch pops six zeroed registers and "returns" into emu_fiber_main, whose stack
// is then aligned as after a call.
inline void emu_prepare(emu_fiber& f) {
  void** top = reinterpret_cast<void**>(f.stack + EMU_STACK_BYTES);
  top[-1] = nullptr;
  top[-2] = reinterpret_cast<void*>(&emu_fiber_main);
  for (int slot = 3; slot <= 8; ++slot) top[-slot] = nullptr;
  f.sp = top - 8;
}
inline void emu_resume(emu_fiber& f) { emu_switch(&emu_scheduler_sp, f.sp); }
inline void emu_yield(emu_fiber& f) { emu_switch(&f.sp, emu_scheduler_sp); }
#else
inline ucontext_t emu_scheduler_context;
inline void emu_prepare(emu_fiber& f) {
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = EMU_STACK_BYTES;
  f.context.uc_link = nullptr;
  makecontext(&f.context, emu_fiber_main, 0);
}
inline void emu_resume(emu_fiber& f) { swapcontext(&emu_scheduler_context, &f.context); }
inline void emu_yield(emu_fiber& f) { swapcontext(&f.context, &emu_scheduler_context); }
#endif

[[noreturn]] void emu_fiber_main() {
  emu_body();
  emu_running->done = true;
  --emu_unfinished;
  emu_yield(*emu_running);
  __builtin_unreachable();
}

inline bool emu_reserve(unsigned threads) {
  const std::size_t guard = (std::size_t)sysconf(_SC_PAGESIZE);
  while (emu_fibers.size() < threads) {
    void* base = mmap(nullptr, guard + EMU_STACK_BYTES, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return false;
    mprotect(base, guard, PROT_NONE);  // an overflow faults instead of writing a neighbour
    emu_fibers.emplace_back();
    emu_fibers.back().stack = static_cast<char*>(base) + guard;
  }
  return true;
}

// A barrier completes when `expected` fibers have arrived; a waiting fiber is runnable
// again once the generation it arrived in has passed.
inline emu_barrier emu_block_barrier, emu_warp_barrier[32];
inline void emu_arrive_and_wait(emu_barrier& b) {
  emu_fiber& self = *emu_running;
  self.waits_on = &b;
  self.generation = b.generation;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
  }
  emu_yield(self);
}
inline void __syncthreads() { emu_arrive_and_wait(emu_block_barrier); }
template <typename A> A __shfl_down_sync(unsigned, A v, int delta) {
  static_assert(sizeof(A) <= 8, "emulator: shuffles of at most 8 bytes");
  static unsigned char slots[1024][8];
  const unsigned t = threadIdx.x, lane = t & 31u;
  std::memcpy(slots[t], &v, sizeof(A));
  emu_arrive_and_wait(emu_warp_barrier[t >> 5]);
  A r = v;
  if (lane + delta < 32u) std::memcpy(&r, slots[t + delta], sizeof(A));
  emu_arrive_and_wait(emu_warp_barrier[t >> 5]);  // the next shuffle rewrites the slots
  return r;
}

// Fixed pseudo-random visiting orders (EMU_ORDERS permutations of the block's warps, and of
// a warp's lanes): whichever way data flows between threads, a missing barrier lets some
// reader run before its writer. They depend only on blockDim, so a launch replays the same
// interleaving.
constexpr unsigned EMU_ORDERS = 8;
inline void emu_make_orders(std::vector<unsigned>& orders, unsigned n) {
  if (orders.size() == (std::size_t)EMU_ORDERS * n) return;
  orders.resize((std::size_t)EMU_ORDERS * n);
  std::uint64_t s = 0x9E3779B97F4A7C15ull;
  for (unsigned k = 0; k < EMU_ORDERS; ++k) {
    unsigned* order = &orders[(std::size_t)k * n];
    for (unsigned i = 0; i < n; ++i) order[i] = i;
    for (unsigned i = n - 1; i > 0; --i) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      std::swap(order[i], order[s % (i + 1)]);
    }
  }
}
inline std::vector<unsigned> emu_warp_orders, emu_lane_orders;

inline void emu_report_deadlock(unsigned threads) {
  unsigned at_block = 0, at_warp = 0, returned = 0;
  for (unsigned t = 0; t < threads; ++t) {
    const emu_fiber& f = emu_fibers[t];
    if (f.done) ++returned;
    else if (f.waits_on == &emu_block_barrier) ++at_block;
    else ++at_warp;
  }
  std::snprintf(emu_error, sizeof emu_error,
                "deadlock in block (%u, %u): of %u threads, %u wait at __syncthreads, %u at a "
                "warp shuffle and %u returned, so no barrier can complete",
                blockIdx.x, blockIdx.y, threads, at_block, at_warp, returned);
  std::fprintf(stderr, "emulator: %s\n", emu_error);
}

inline bool emu_resume_if_runnable(unsigned t) {
  emu_fiber& f = emu_fibers[t];
  if (f.done || (f.waits_on != nullptr && f.waits_on->generation == f.generation)) return false;
  f.waits_on = nullptr;
  threadIdx = {t, 0, 0};
  emu_running = &f;
  emu_resume(f);
  return true;
}

// Sweeps warp w's lanes, each sweep in the next order, until none can go on: a warp gets as
// far ahead of the others as the block's barrier lets it, as a GPU's warps may, so a barrier
// that only guards against a warp running ahead is missed loudly too. Returns the resumptions.
inline unsigned emu_run_warp(unsigned w, unsigned threads, unsigned& sweep) {
  unsigned resumed = 0;
  for (;;) {
    const unsigned* lanes = &emu_lane_orders[(std::size_t)(sweep++ % EMU_ORDERS) * 32];
    unsigned now = 0;
    for (unsigned k = 0; k < 32; ++k) {
      const unsigned t = 32 * w + lanes[k];
      now += t < threads && emu_resume_if_runnable(t);
    }
    if (now == 0) return resumed;
    resumed += now;
  }
}

// Round robin over the warps: a pass that resumes no fiber while some have not returned is
// a deadlock (a barrier in divergent code).
inline bool emu_run_block(unsigned threads, unsigned first_order) {
  for (unsigned t = 0; t < threads; ++t) {
    emu_fiber& f = emu_fibers[t];
    f.done = false;
    f.waits_on = nullptr;
    emu_prepare(f);
  }
  const unsigned warps = (threads + 31) / 32;
  emu_block_barrier.arrived = 0;
  emu_block_barrier.expected = threads;
  for (unsigned w = 0; w < warps; ++w) {
    emu_warp_barrier[w].arrived = 0;
    emu_warp_barrier[w].expected = std::min(32u, threads - 32 * w);
  }
  emu_unfinished = threads;
  unsigned sweep = first_order;
  for (unsigned pass = first_order; emu_unfinished > 0; ++pass) {
    const unsigned* order = &emu_warp_orders[(std::size_t)(pass % EMU_ORDERS) * warps];
    unsigned resumed = 0;
    for (unsigned k = 0; k < warps; ++k) resumed += emu_run_warp(order[k], threads, sweep);
    if (resumed == 0) {
      emu_report_deadlock(threads);
      return false;
    }
  }
  return true;
}

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __double2float_rz(double d) {  // round to nearest, then step back toward zero
  float f = (float)d;
  if (std::fabs((double)f) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return f;
}
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline float emu_half_to_float(unsigned short b) {
  _Float16 h; std::memcpy(&h, &b, 2); return (float)h;
}
inline unsigned short emu_half_from_float(float f) {
  _Float16 h = (_Float16)f; unsigned short b; std::memcpy(&b, &h, 2); return b;
}
inline unsigned short emu_half_from_double(double d) {
  _Float16 h = (_Float16)d; unsigned short b; std::memcpy(&b, &h, 2); return b;
}
template <typename... Args> struct emu_bound_kernel {
  static inline void (*fn)(Args...) = nullptr;
  static inline void** args = nullptr;
  template <std::size_t... I> static void call(std::index_sequence<I...>) {
    fn(*static_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(args[I])...);
  }
  static void run() { call(std::index_sequence_for<Args...>{}); }
};
// The blocks run one after another (static "shared memory" is reused by the next block).
// 0: done; nonzero: the launch was abandoned, emu_error says why.
template <typename... Args>
int emu_run_grid_alone(void (*fn)(Args...), void** p, unsigned gx, unsigned gy, unsigned bx) {
  if (bx == 0 || bx > 1024) {
    std::snprintf(emu_error, sizeof emu_error, "blockDim.x = %u (1 to 1024)", bx);
    return 2;
  }
  if (!emu_reserve(bx)) {
    std::snprintf(emu_error, sizeof emu_error, "no memory for %u fiber stacks", bx);
    return 3;
  }
  emu_make_orders(emu_warp_orders, (bx + 31) / 32);
  emu_make_orders(emu_lane_orders, 32);
  emu_bound_kernel<Args...>::fn = fn;
  emu_bound_kernel<Args...>::args = p;
  emu_body = &emu_bound_kernel<Args...>::run;
  gridDim = {gx, gy, 1};
  blockDim = {bx, 1, 1};
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned b = 0; b < gx; ++b) {
      blockIdx = {b, by, 0};
      if (!emu_run_block(bx, by * gx + b)) return 1;
    }
  return 0;
}
// Python's _KERNEL_LOCK serialises launches, but each copy of the emulator module loaded
// under another name has a lock of its own, while they share this library's fibers.
inline std::atomic<bool> emu_busy{false};
template <typename... Args>
int emu_run_grid(void (*fn)(Args...), void** p, unsigned gx, unsigned gy, unsigned bx) {
  if (emu_busy.exchange(true)) {
    std::snprintf(emu_error, sizeof emu_error, "another kernel of its module is running");
    std::fprintf(stderr, "emulator: %s\n", emu_error);
    return 4;
  }
  const int failed = emu_run_grid_alone(fn, p, gx, gy, bx);
  emu_busy = false;
  return failed;
}
extern "C" const char* emu_last_error() { return emu_error; }
"""

_KERNEL_NAME = re.compile(r'extern\s+"C"\s+void\s+(\w+)\s*\(')


def compiler_available() -> bool:
    return shutil.which("g++") is not None


def _build(code: str) -> ctypes.CDLL:
    """Compile ``code`` (a kernel source) with the shim into a cached shared library."""
    cache = os.path.join(tempfile.gettempdir(), "needle_cuda_emulator")
    os.makedirs(cache, exist_ok=True)
    key = hashlib.sha256((SHIM + code).encode()).hexdigest()[:20]
    lib_path = os.path.join(cache, f"{key}.so")
    if not os.path.exists(lib_path):
        flags = ["-std=c++20", "-DNEEDLE_OWN_HALF", "-DNEEDLE_HOST_EMULATION", "-w"]
        src = os.path.join(cache, f"{key}.cpp")
        with open(src, "w", encoding="utf-8") as f:
            f.write(SHIM + code)
        pre = subprocess.run(["g++", "-E", "-P", *flags, src], check=True,
                             capture_output=True, text=True).stdout
        names = _KERNEL_NAME.findall(pre)
        with open(src, "a", encoding="utf-8") as f:
            for name in names:
                f.write(f'\nextern "C" int emu_launch_{name}(void** p, unsigned gx, unsigned gy, '
                        f'unsigned bx) {{ return emu_run_grid(&{name}, p, gx, gy, bx); }}')
        tmp = lib_path + f".{os.getpid()}.tmp"
        subprocess.run(["g++", "-O1", "-shared", "-fPIC", *flags, src, "-o", tmp],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, lib_path)
    return ctypes.CDLL(lib_path)


def _c_arg(value):
    if isinstance(value, np.ndarray):  # a struct passed by value (StridedView)
        return (ctypes.c_char * value.nbytes).from_buffer_copy(value.tobytes())
    if isinstance(value, np.float16):
        return ctypes.c_uint16(int(np.asarray(value).view(np.uint16)))
    if isinstance(value, np.uint16):  # a bfloat16 scalar's two bytes
        return ctypes.c_uint16(int(value))
    ctype = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.float32: ctypes.c_float,
             np.float64: ctypes.c_double}.get(type(value))
    if ctype is None:  # the real launcher would pass it wrongly too: fail loudly
        raise TypeError(f"emulator: unsupported kernel argument {value!r} ({type(value)})")
    return ctype(value)


class _Function:
    def __init__(self, lib: ctypes.CDLL, name: str):
        self._fn = getattr(lib, f"emu_launch_{name}")
        self._fn.restype = ctypes.c_int
        self._last_error = lib.emu_last_error
        self._last_error.restype = ctypes.c_char_p
        self.name = name
        self.launches: list = []

    def __call__(self, grid, block, args) -> None:
        grid = tuple(grid) + (1, 1)
        cargs = [_c_arg(a) for a in args]
        pointers = (ctypes.c_void_p * len(cargs))(*[ctypes.addressof(c) for c in cargs])
        self.launches.append((tuple(grid[:2]), tuple(block)))
        # cargs: the arguments, by value, as captured; self: names a failed launch
        run = (self._fn, pointers, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]),
               ctypes.c_uint(block[0]), cargs, self)
        if _captured(lambda: _run_kernel(run)):
            return
        COUNTS["kernels"] += 1
        _run_kernel(run)


# One kernel at a time in the process: a kernel's fibers share the scheduler's state, the
# barriers and the static __shared__ arrays, so two kernels launched at once from two threads
# (the thread ranks of a distributed test) would corrupt each other or mix their partial
# sums. A GPU runs them on streams of their own; taking turns here changes no value.
_KERNEL_LOCK = threading.Lock()


def _run_kernel(run) -> None:
    with _KERNEL_LOCK:
        failed = run[0](*run[1:5])
    if failed:
        function = run[6]
        raise RuntimeError(f"emulator: kernel {function.name} abandoned: "
                           f"{function._last_error().decode()}")


class _RawModule:
    def __init__(self, code: str, options=()):
        self.code, self.options, self._lib = code, tuple(options), None

    def compile(self) -> None:
        if self._lib is None:
            self._lib = _build(self.code)

    def get_function(self, name: str) -> _Function:
        self.compile()
        return _Function(self._lib, name)


class _HostMemory:
    """'Device' memory: a 256-byte aligned host buffer."""

    def __init__(self, nbytes: int):
        self._raw = np.zeros(nbytes + 256, dtype=np.uint8)
        self.ptr = self._raw.ctypes.data + (-self._raw.ctypes.data) % 256
        self.size = nbytes


class _Pointer:
    def __init__(self, mem, offset: int):
        self.mem, self.ptr = mem, mem.ptr + offset


class _UnownedMemory:
    def __init__(self, ptr: int, size: int, owner, device_id: int = -1):
        self.ptr, self.size, self.owner = ptr, size, owner


class _DeviceArray:
    def __init__(self, shape, dtype, memptr=None, strides=None, _view=None):
        if _view is None:
            dtype = np.dtype(dtype)
            shape = tuple(int(n) for n in shape)
            if strides is None:
                count = int(np.prod(shape))
            else:  # byte strides >= 0: the view reaches one past its last element
                reach = sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
                count = 1 + reach // dtype.itemsize
            buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(memptr.ptr)
            flat = np.frombuffer(buf, dtype=dtype, count=count)
            _view = (flat.reshape(shape) if strides is None else
                     np.lib.stride_tricks.as_strided(flat, shape, tuple(strides)))
        self._view, self._keep = _view, memptr

    def get(self) -> np.ndarray:
        _refuse_in_capture("a device-to-host copy")
        return self._view.copy()

    def copy(self) -> "_DeviceArray":
        _refuse_in_capture("an allocating copy")
        return _DeviceArray(None, None, _view=self._view.copy())

    def set(self, src) -> None:
        _refuse_in_capture("a copy from pageable host memory")
        self._view[...] = src

    def reshape(self, *shape):
        return _DeviceArray(None, None, self._keep, _view=self._view.reshape(*shape))

    @property
    def T(self):  # noqa: N802 - CuPy's name
        return _DeviceArray(None, None, self._keep, _view=self._view.T)

    def __setitem__(self, key, value) -> None:
        src = value._view if isinstance(value, _DeviceArray) else value

        def assign(view=self._view):
            view[key] = src

        if not _captured(assign):
            assign()


class _Runtime:
    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802 - CuPy's names
        return 1

    @staticmethod
    def getDevice() -> int:  # noqa: N802
        return 0

    def __init__(self, num_sms: int):
        self.num_sms = num_sms

    def getDeviceProperties(self, dev: int) -> dict:  # noqa: N802
        return {"multiProcessorCount": self.num_sms}

    @staticmethod
    def deviceSynchronize() -> None:  # noqa: N802
        _refuse_in_capture("a device synchronisation")

    memcpyDeviceToDevice = 3  # noqa: N815 - CuPy's name

    @staticmethod
    def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:  # noqa: N802
        def copy():
            ctypes.memmove(dst, src, size)

        if not _captured(copy):
            COUNTS["copies"] += 1
            copy()


# ---- stream capture: what a CUDA graph freezes ---------------------------------------------
# While a stream captures, every kernel launch, cuBLAS product and device-to-device copy on it
# is recorded, not run: a launch's arguments by value (device pointers included), exactly what
# a real graph keeps; a graph's launch runs the records in order. What a real capture refuses
# (a host synchronisation, a copy to or from pageable host memory, work on another stream)
# raises here and invalidates the capture, as the CUDA runtime does.
COUNTS = {"kernels": 0, "copies": 0, "captures": 0, "graph_launches": 0}
_STREAMS: list = []  # the current stream stack (`with stream:`); empty: the legacy stream
_CAPTURE: dict = {}  # the capture in progress: stream, records, invalidated


def _captured(run) -> bool:
    """Record ``run`` when a capture is in progress (False: run it now)."""
    if not _CAPTURE:
        return False
    if not _STREAMS or _STREAMS[-1] is not _CAPTURE["stream"]:
        _CAPTURE["invalid"] = "work queued on another stream during a capture"
        raise RuntimeError("emulator: cudaErrorStreamCaptureImplicit (work on another stream "
                           "while one captures)")
    _CAPTURE["records"].append(run)
    return True


def _refuse_in_capture(what: str) -> None:
    if _CAPTURE:
        _CAPTURE["invalid"] = what
        raise RuntimeError(f"emulator: cudaErrorStreamCaptureUnsupported ({what} while a "
                           "stream captures)")


class _Graph:
    def __init__(self, records: list):
        self.records = records

    def launch(self, stream=None) -> None:
        _refuse_in_capture("a graph launch")
        COUNTS["graph_launches"] += 1
        for run in self.records:
            run()


class _Stream:
    def __init__(self, non_blocking: bool = False, null: bool = False):
        self.ptr = 0 if null else id(self)

    def __enter__(self):
        _STREAMS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _STREAMS.pop()

    def begin_capture(self, mode=None) -> None:
        if self.ptr == 0 or _CAPTURE:
            raise RuntimeError("emulator: cannot capture the legacy stream or two at once")
        _CAPTURE.update(stream=self, records=[], invalid=None)

    def is_capturing(self) -> bool:
        return bool(_CAPTURE) and _CAPTURE["stream"] is self

    def end_capture(self) -> _Graph:
        if not self.is_capturing():
            raise RuntimeError("emulator: end_capture on a stream that does not capture")
        records, invalid = _CAPTURE["records"], _CAPTURE["invalid"]
        _CAPTURE.clear()
        if invalid is not None:
            raise RuntimeError(f"emulator: cudaErrorStreamCaptureInvalidated ({invalid})")
        COUNTS["captures"] += 1
        return _Graph(records)


_NULL_STREAM = _Stream(null=True)


class _CudaNamespace:
    def __init__(self, num_sms: int):
        self.runtime = _Runtime(num_sms)
        self.UnownedMemory = _UnownedMemory
        self.MemoryPointer = _Pointer
        self.Stream = _Stream
        self.allocated_bytes = 0

    @staticmethod
    def get_current_stream() -> _Stream:
        return _STREAMS[-1] if _STREAMS else _NULL_STREAM

    def alloc(self, nbytes: int) -> _HostMemory:
        _refuse_in_capture("an allocation")
        self.allocated_bytes += nbytes
        return _HostMemory(nbytes)


class FakeCupy:
    """Just enough of ``cupy`` for the backend; ``num_sms`` steers the reduction plans."""

    counts = COUNTS  # launches, copies, captures and graph launches since the import

    def __init__(self, num_sms: int = 2):
        self.cuda = _CudaNamespace(num_sms)
        self.RawModule = _RawModule
        self.ndarray = _DeviceArray

    @staticmethod
    def matmul(a, b, out=None):
        if out is None:
            _refuse_in_capture("a product into a new array")
            return _DeviceArray(None, None, None, _view=np.matmul(a._view, b._view))

        def product():
            out._view[...] = np.matmul(a._view, b._view)

        if not _captured(product):
            product()
        return out
