"""Run the CUDA backend's .cu kernels on the host, for tests on machines without a GPU.

A tiny stand-in for the parts of CuPy that ``needle.backend_ndarray._cuda.runtime`` and
``ndarray_backend_cuda`` use. ``RawModule`` compiles the very source NVRTC would get with g++
(C++20), after a shim header that maps the CUDA built-ins to host code: ``threadIdx`` and
``blockIdx`` are thread-local, each launch runs one host thread per CUDA thread of a block
(blocks one after another), ``__syncthreads`` is a ``std::barrier``, ``__shfl_down_sync`` goes
through a per-warp exchange buffer, ``__shared__`` arrays are static. So every index
computation, bound guard, barrier and reduction tree of the kernels runs for real; only speed
and memory-model subtleties are not those of a GPU. Device memory is host memory.

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
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(n)
#define __align__(n) alignas(n)
#define __shared__ static
struct emu_dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;
using std::max;
using std::min;
inline std::barrier<>* emu_block_barrier = nullptr;
inline std::barrier<>* emu_warp_barrier[32] = {};
inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
template <typename A> A __shfl_down_sync(unsigned, A v, int delta) {
  static double slots[1024];
  const unsigned t = threadIdx.x, lane = t & 31u;
  slots[t] = (double)v;
  emu_warp_barrier[t >> 5]->arrive_and_wait();
  A r = lane + delta < 32u ? (A)slots[t + delta] : v;
  emu_warp_barrier[t >> 5]->arrive_and_wait();
  return r;
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
template <typename... Args, std::size_t... I>
void emu_call(void (*fn)(Args...), void** p, std::index_sequence<I...>) {
  fn(*static_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(p[I])...);
}
// One host thread per CUDA thread of a block; the threads walk the blocks in order and meet
// at a barrier between blocks (static "shared memory" is reused by the next block).
template <typename... Args>
void emu_run_grid(void (*fn)(Args...), void** p, unsigned gx, unsigned gy, unsigned bx) {
  gridDim = {gx, gy, 1};
  blockDim = {bx, 1, 1};
  std::barrier<> block_barrier(bx);
  std::vector<std::barrier<>*> warps;
  for (unsigned w = 0; w < (bx + 31) / 32; ++w) {
    warps.push_back(new std::barrier<>(std::min(32u, bx - 32 * w)));
    emu_warp_barrier[w] = warps.back();
  }
  emu_block_barrier = &block_barrier;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < bx; ++t) {
    threads.emplace_back([=, &block_barrier] {
      threadIdx = {t, 0, 0};
      for (unsigned by = 0; by < gy; ++by)
        for (unsigned b = 0; b < gx; ++b) {
          blockIdx = {b, by, 0};
          emu_call(fn, p, std::index_sequence_for<Args...>{});
          block_barrier.arrive_and_wait();
        }
    });
  }
  for (auto& th : threads) th.join();
  for (auto* w : warps) delete w;
}
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
                f.write(f'\nextern "C" void emu_launch_{name}(void** p, unsigned gx, '
                        f'unsigned gy, unsigned bx) {{ emu_run_grid(&{name}, p, gx, gy, bx); }}')
        tmp = lib_path + f".{os.getpid()}.tmp"
        subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-pthread", *flags, src, "-o", tmp],
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
        self._fn.restype = None
        self.name = name
        self.launches: list = []

    def __call__(self, grid, block, args) -> None:
        grid = tuple(grid) + (1, 1)
        cargs = [_c_arg(a) for a in args]
        pointers = (ctypes.c_void_p * len(cargs))(*[ctypes.addressof(c) for c in cargs])
        self.launches.append((tuple(grid[:2]), tuple(block)))
        run = (self._fn, pointers, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]),
               ctypes.c_uint(block[0]), cargs)  # cargs: the arguments, by value, as captured
        if _captured(lambda: _run_kernel(run)):
            return
        COUNTS["kernels"] += 1
        _run_kernel(run)


# One kernel at a time in the process: a kernel's blocks run on host threads that share one
# __syncthreads barrier and the static __shared__ arrays, so two kernels launched at once from
# two threads (the thread ranks of a distributed test) would deadlock or mix their partial
# sums. A GPU runs them on streams of their own; taking turns here changes no value.
_KERNEL_LOCK = threading.Lock()


def _run_kernel(run) -> None:
    with _KERNEL_LOCK:
        run[0](*run[1:5])


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
