"""The CUDA emulator's scheduler: fibers, barriers, warp shuffles, deadlocks, grid indexing.

Small kernels compiled through ``_cuda_emulator._RawModule`` check what the backend's kernels
rely on: a block-wide tree with ``__syncthreads`` and a warp tree with ``__shfl_down_sync``
give exact sums for full and partial blocks and warps, a missing barrier shows as a wrong
result, a barrier that only some threads reach raises RuntimeError instead of hanging, and
``blockIdx.y`` walks a two-dimensional grid.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from _cuda_emulator import SHIM, _RawModule, compiler_available

pytestmark = pytest.mark.skipif(not compiler_available(), reason="g++ not found")

KERNELS = r"""
// Interleaved pairs: in each round a reader's partner writes nothing, so one barrier a
// round suffices for any blockDim.
extern "C" __global__ void tree_sum(const long long* in, long long* out) {
  __shared__ long long s[1024];
  const unsigned t = threadIdx.x;
  s[t] = in[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (unsigned stride = 1; stride < blockDim.x; stride *= 2) {
    if (t % (2 * stride) == 0 && t + stride < blockDim.x) s[t] += s[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

extern "C" __global__ void tree_sum_without_barrier(const long long* in, long long* out) {
  __shared__ long long s[1024];
  const unsigned t = threadIdx.x;
  s[t] = in[t];
  __syncthreads();
  for (unsigned stride = 1; stride < blockDim.x; stride *= 2) {
    if (t % (2 * stride) == 0 && t + stride < blockDim.x) s[t] += s[t + stride];
  }
  if (t == 0) out[0] = s[0];
}

// Lanes past the end of a partial warp hold nothing: each lane adds only real partners.
extern "C" __global__ void warp_sums(const long long* in, long long* out) {
  const unsigned t = threadIdx.x, lane = t & 31u;
  const unsigned lanes = min(32u, blockDim.x - (t & ~31u));
  long long v = in[t];
  for (int delta = 16; delta > 0; delta >>= 1) {
    const long long other = __shfl_down_sync(0xffffffffu, v, delta);
    if (lane + delta < lanes) v += other;
  }
  if (lane == 0) out[t >> 5] = v;
}

// Each warp's sum of a row goes through shared memory to thread 0. Without the trailing
// barrier a warp that runs ahead rewrites its partial for the next row before thread 0 reads.
template <bool TRAILING_BARRIER>
__device__ void row_sums(const long long* in, long long* out, long long rows) {
  __shared__ long long partials[32];
  const unsigned t = threadIdx.x;
  for (long long r = 0; r < rows; ++r) {
    long long v = in[r * blockDim.x + t];
    for (int delta = 16; delta > 0; delta >>= 1) v += __shfl_down_sync(0xffffffffu, v, delta);
    if (t % 32 == 0) partials[t / 32] = v;
    __syncthreads();
    if (t == 0) {
      long long sum = 0;
      for (unsigned w = 0; w < blockDim.x / 32; ++w) sum += partials[w];
      out[r] = sum;
    }
    if (TRAILING_BARRIER) __syncthreads();
  }
}
extern "C" __global__ void row_sums_guarded(const long long* in, long long* out, long long rows) {
  row_sums<true>(in, out, rows);
}
extern "C" __global__ void row_sums_unguarded(const long long* in, long long* out,
                                              long long rows) {
  row_sums<false>(in, out, rows);
}

extern "C" __global__ void grid_ids(long long* out) {
  const long long i = ((long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  out[i] = blockIdx.y * 1000000LL + blockIdx.x * 1000LL + threadIdx.x;
}

// Holds its module busy until the host sets *go.
extern "C" __global__ void wait_for_host(long long* started, const long long* go) {
  *started = 1;
  while (*(volatile const long long*)go == 0) {
  }
}

extern "C" __global__ void half_block_barrier(long long* out) {
  if (threadIdx.x < blockDim.x / 2) __syncthreads();
  out[threadIdx.x] = 1;
}

extern "C" __global__ void divergent_shuffle(long long* out) {
  long long v = threadIdx.x;
  if (threadIdx.x % 2 == 0) v = __shfl_down_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
"""

_MODULE = _RawModule(KERNELS)


def _launch(name: str, grid, block, *args) -> None:
    """Run kernel ``name``; a host array's address stands for a device pointer."""
    args = [np.uint64(a.ctypes.data) if isinstance(a, np.ndarray) else a for a in args]
    _MODULE.get_function(name)(grid, block, args)


def _values(n: int, seed: int) -> np.ndarray:
    """Large random integers: a stale or lost partial sum changes the exact total."""
    rng = np.random.default_rng(seed)
    return rng.integers(1 << 40, 1 << 50, size=n, dtype=np.int64)


@pytest.mark.parametrize("threads", [1, 33, 256, 1024])
def test_block_tree_sum_with_barriers_is_exact(threads):
    blocks = 3
    x = _values(blocks * threads, threads)
    out = np.zeros(blocks, np.int64)
    _launch("tree_sum", (blocks,), (threads,), x, out)
    np.testing.assert_array_equal(out, x.reshape(blocks, threads).sum(axis=1))


@pytest.mark.parametrize("threads", [256, 1024])
def test_a_tree_without_its_barrier_comes_out_wrong(threads):
    """The scheduler interleaves threads so that a missing __syncthreads loses partial sums,
    as a GPU would, rather than hiding the race behind a lucky order."""
    x = _values(threads, threads + 1)
    out = np.zeros(1, np.int64)
    _launch("tree_sum_without_barrier", (1,), (threads,), x, out)
    assert out[0] != x.sum()


@pytest.mark.parametrize("threads", [1, 5, 32, 33, 70, 1024])
def test_warp_shuffle_sums_full_and_partial_warps_exactly(threads):
    x = _values(threads, 7 * threads)  # partial sums pass 2**53: shuffles move all 8 bytes
    warps = -(-threads // 32)
    out = np.zeros(warps, np.int64)
    _launch("warp_sums", (1,), (threads,), x, out)
    padded = np.concatenate([x, np.zeros(warps * 32 - threads, np.int64)])
    np.testing.assert_array_equal(out, padded.reshape(warps, 32).sum(axis=1))


@pytest.mark.parametrize(("kernel", "exact"), [("row_sums_guarded", True),
                                               ("row_sums_unguarded", False)])
def test_a_warp_running_ahead_shows_a_missing_trailing_barrier(kernel, exact):
    """Warps are not kept in step: one may reach the next row's barrier before warp 0 has
    read this row's partials, so a barrier that only stops that is needed here too."""
    rows, threads = 4, 256
    x = _values(rows * threads, 3)
    out = np.zeros(rows, np.int64)
    _launch(kernel, (1,), (threads,), x, out, np.int64(rows))
    assert np.array_equal(out, x.reshape(rows, threads).sum(axis=1)) == exact


def test_block_index_walks_both_grid_dimensions():
    gx, gy, threads = 3, 4, 64
    out = np.full(gx * gy * threads, -1, np.int64)
    _launch("grid_ids", (gx, gy), (threads,), out)
    by, bx, t = np.meshgrid(np.arange(gy), np.arange(gx), np.arange(threads), indexing="ij")
    np.testing.assert_array_equal(out, (by * 1000000 + bx * 1000 + t).ravel())


_DEADLOCK_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {here!r})
    import test_cuda_emulator_scheduler as s
    out = np.zeros(64, np.int64)
    try:
        s._launch({kernel!r}, (1,), (64,), out)
    except RuntimeError as e:
        print("raised:", e)
    x = s._values(64, 1)
    total = np.zeros(1, np.int64)
    s._launch("tree_sum", (1,), (64,), x, total)  # the emulator still works afterwards
    print("next launch right:", bool(total[0] == x.sum()))
""")


@pytest.mark.parametrize("kernel", ["half_block_barrier", "divergent_shuffle"])
def test_a_barrier_only_some_threads_reach_raises(kernel):
    """In a subprocess with a timeout: a hang fails the test instead of stalling the run."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = _DEADLOCK_SCRIPT.format(here=here, kernel=kernel)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"raised: emulator: kernel {kernel} abandoned: deadlock in block (0, 0)" in run.stdout
    assert "next launch right: True" in run.stdout
    assert "deadlock" in run.stderr


def test_two_copies_of_the_emulator_never_run_one_library_at_once():
    """Each copy of the emulator module has its own _KERNEL_LOCK while the copies share one
    compiled library: a second launch while a first runs is refused, not interleaved."""
    spec = importlib.util.spec_from_file_location(
        "_needle_cuda_emulator_second_copy",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cuda_emulator.py"))
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    started, go = np.zeros(1, np.int64), np.zeros(1, np.int64)
    first = threading.Thread(target=_launch, args=("wait_for_host", (1,), (1,), started, go))
    first.start()
    try:
        while not started[0] and first.is_alive():
            first.join(0.001)
        second = copy._RawModule(KERNELS).get_function("tree_sum")
        x, out = np.ones(1, np.int64), np.zeros(1, np.int64)
        with pytest.raises(RuntimeError, match="another kernel of its module is running"):
            second((1,), (1,), [np.uint64(x.ctypes.data), np.uint64(out.ctypes.data)])
    finally:
        go[0] = 1
        first.join(60)
    assert started[0] == 1 and not first.is_alive()


_UCONTEXT_MAIN = r"""
#include <cstdio>
int main() {
  static long long in[1024], out[32];
  long long total = 0, first_warp = 0;
  for (int i = 0; i < 1024; ++i) {
    in[i] = (long long)i * 7919 + 3;
    total += in[i];
    if (i < 32) first_warp += in[i];
  }
  long long *pin = in, *pout = out;
  void* args[2] = {&pin, &pout};
  void* out_only[1] = {&pout};
  const int tree = emu_run_grid(&tree_sum, args, 1, 1, 1024);
  std::printf("tree %d %d\n", tree, out[0] == total);
  const int warp = emu_run_grid(&warp_sums, args, 1, 1, 1024);
  std::printf("warp %d %d\n", warp, out[0] == first_warp);
  std::printf("deadlock %d\n", emu_run_grid(&half_block_barrier, out_only, 1, 1, 32));
  const int again = emu_run_grid(&tree_sum, args, 1, 1, 1024);
  std::printf("again %d %d\n", again, out[0] == total);
}
"""


def test_the_portable_context_switch_runs_the_same_kernels(tmp_path):
    """Off x86-64 the fibers switch with swapcontext: built here with NEEDLE_EMU_UCONTEXT."""
    src, exe = tmp_path / "kernels.cpp", tmp_path / "kernels"
    src.write_text(SHIM + KERNELS + _UCONTEXT_MAIN, encoding="utf-8")
    subprocess.run(["g++", "-std=c++20", "-O1", "-w", "-DNEEDLE_EMU_UCONTEXT", str(src),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.stdout.split("\n")[:4] == ["tree 0 1", "warp 0 1", "deadlock 1", "again 0 1"]
