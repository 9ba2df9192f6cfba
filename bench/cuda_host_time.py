"""The host side of a cuda() ResNet9 step, measured without a GPU.

The CUDA backend runs against the host emulator of the tests
(python_tests/backend_ndarray/_cuda_emulator.py) with every kernel and every cuBLAS product
made a no-op, under needle's caching allocator as on a real device. What remains is needle's
Python per step: autograd, NDArray, the launcher, the allocator (eager), or the replayed
kernel list (``ndl.compile``). Then ``gpu_profile.py``'s ``overlap`` part runs as it would on
a GPU: the time until each step's Python returns (here the whole step), the device-to-host
copies a step makes (each one makes a real GPU wait), and cProfile of one replayed step.

Usage:
    python bench/cuda_host_time.py [--steps 5] [--batch 128]
The last two lines time the compiled step without and with CUDA graph replay (20 steps).
The numbers are host time only; on a GPU the kernels overlap with them. Timings never decide
a test.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "apps"))


class _NoKernel:
    def __call__(self, grid, block, args) -> None:
        pass


def install_no_op_device():
    """Route ``ndl.cuda()`` to the emulated backend with no-op kernels; returns the device."""
    path = os.path.join(ROOT, "python_tests", "backend_ndarray", "_cuda_emulator.py")
    spec = importlib.util.spec_from_file_location("_needle_cuda_emulator", path)
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)

    import needle as ndl
    import needle.backend_ndarray as nd
    from needle.backend_ndarray import ndarray_backend_cuda as B
    from needle.backend_ndarray._cuda import runtime
    from needle.memory.cuda_allocator import install_cuda_allocator
    from needle.memory.registry import register_allocator

    runtime._cupy, runtime._reason, runtime._allocator = emulator.FakeCupy(num_sms=132), None, None
    register_allocator("cuda", install_cuda_allocator(B, runtime._cupy.cuda.alloc))
    runtime.function = lambda source, name: _NoKernel()
    emulator.FakeCupy.matmul = staticmethod(lambda a, b, out=None: out)
    device = nd.BackendDevice("cuda", B)
    ndl.cuda = lambda: device  # what bench_gpu's ResNet9 step asks for
    return device


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args(argv)
    install_no_op_device()
    import gpu_profile

    gpu_profile.profile_overlap(args.steps, args.batch)
    graph_host_time(max(args.steps, 20), args.batch)
    return 0


def graph_host_time(steps: int, batch: int) -> None:
    """Host time of a compiled ResNet9 step replayed as its kernel list (``graphs=False``)
    and as one CUDA graph launch (the default on cuda())."""
    import functools
    import statistics
    import time

    from bench_gpu import _needle_resnet9_step

    import needle as ndl
    from needle.backend_ndarray._cuda import runtime

    cuda_rt = runtime.cupy_module().cuda.runtime
    real_copy = cuda_rt.memcpyAsync

    def copy(dst, src, size, kind, stream):
        # bulk copies (the batch, the weights copied back in the graph) are device work, no-ops
        # like the kernels; the labels' copy stays: their deferred check reads it
        if size <= 1 << 16:
            real_copy(dst, src, size, kind, stream)

    cuda_rt.memcpyAsync = copy
    real_compile = ndl.compile
    for name, graphs in (("plain replay", False), ("graph replay", None)):
        ndl.compile = functools.partial(real_compile, graphs=graphs)
        try:
            step = _needle_resnet9_step(batch, compiled=True)
        finally:
            ndl.compile = real_compile
        step()  # the first replay captures the graph
        times, cpu = [], []
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        # CPU time too: on a loaded machine the wall time also counts waits for a core
        print(f"resnet9 b{batch} compiled, {name}: host {statistics.median(times) * 1e3:6.3f} "
              f"ms per step ({statistics.median(cpu) * 1e3:.3f} ms of CPU; medians of "
              f"{steps})", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
