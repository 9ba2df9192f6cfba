"""Where needle's time goes on a CUDA device: the facts the next round of CUDA work needs.

Four parts, each printed as it finishes:
  * ``resnet9``: a ResNet9 batch-128 SGD step on cuda(): synchronised wall time per step;
    per step, the kernel launches (by kernel family), cuBLAS products, host<->device copies
    and device synchronisations, counted by wrapping the backend's entry points; the time of
    each kernel family with a synchronisation after every launch (launch + GPU time,
    serialised); and cProfile's top functions by own and by cumulative time.
  * ``overlap``: eager and compiled (``ndl.compile``, replayed) ResNet9 steps: when the
    step's Python returns against when the GPU has drained its kernels (host- or GPU-bound),
    where the device-to-host copies of a step come from, and cProfile of one replayed step.
  * ``launch``: the host cost of one small launch (1,000 float32 elements): needle's backend
    call, the same CuPy RawKernel called directly, and ``torch.mul(out=)``.
  * ``ewise``: shapes of the same scalar-multiply kernel on 1e8 float32 (one element per
    thread; a grid capped at 8 blocks per multiprocessor and strided; four elements per
    thread; float4 loads, as needle's elementwise kernels do since they measured 0.98x of
    copy here), in GB/s against cudaMemcpy.

Usage:
    python bench/gpu_profile.py [--only resnet9,overlap,launch,ewise] [--steps 3] [--batch 128]
Needs CuPy and an NVIDIA GPU (PyTorch for the ``launch`` row). Timings never decide a test.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import numpy as np  # noqa: E402


def _wrap(module, name: str, counter: collections.Counter, key=None):
    """Replace ``module.name`` by a counting wrapper; returns a function that restores it."""
    real = getattr(module, name)

    def counting(*args, **kwargs):
        counter[key(*args) if key else name] += 1
        return real(*args, **kwargs)

    setattr(module, name, counting)
    return lambda: setattr(module, name, real)


def profile_resnet9(steps: int, batch: int = 128) -> None:
    from bench_gpu import _needle_resnet9_step

    from needle.backend_ndarray import ndarray_backend_cuda as B
    from needle.backend_ndarray._cuda import runtime

    step = _needle_resnet9_step(batch)
    for _ in range(2):  # warm-up: NVRTC compiles, the caching allocator fills
        step()
    runtime.synchronize()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        runtime.synchronize()
        walls.append(time.perf_counter() - start)
    med = statistics.median(walls)
    print(f"resnet9 b{batch} step on cuda(): median {med * 1e3:.1f} ms ({batch / med:.0f} "
          f"img/s), steps {[round(w * 1e3, 1) for w in walls]}", flush=True)

    # every cuBLAS product of the backend (matmul, matmul_strided, the convolutions) goes
    # through cupy.matmul: counted and timed there
    cupy = runtime.cupy_module()
    counts: collections.Counter = collections.Counter()
    restore = [_wrap(runtime, "launch", counts, key=lambda spec, *a, **k: f"kernel {spec.base}"),
               _wrap(cupy, "matmul", counts, key=lambda *a, **k: "cuBLAS product"),
               _wrap(runtime, "synchronize", counts, key=lambda: "device synchronisation")]
    for name in ("to_numpy", "from_numpy"):
        restore.append(_wrap(B, name, counts, key=lambda *a, _n=name: f"host copy {_n}"))
    step()
    for undo in restore:
        undo()
    print(f"per step: {sum(v for k, v in counts.items() if k.startswith('kernel'))} kernel "
          f"launches through runtime.launch", flush=True)
    for key, n in counts.most_common(40):
        print(f"  {n:6d}  {key}", flush=True)

    # Each launch followed by a synchronisation: launch cost + GPU time per kernel family.
    spent: collections.Counter = collections.Counter()
    real_launch, real_matmul = runtime.launch, cupy.matmul

    def timed_launch(spec, *args, **kwargs):
        runtime.synchronize()
        start = time.perf_counter()
        real_launch(spec, *args, **kwargs)
        runtime.synchronize()
        spent[spec.base] += time.perf_counter() - start

    def timed_matmul(*args, **kwargs):
        runtime.synchronize()
        start = time.perf_counter()
        result = real_matmul(*args, **kwargs)
        runtime.synchronize()
        spent["cuBLAS product"] += time.perf_counter() - start
        return result

    runtime.launch, cupy.matmul = timed_launch, timed_matmul
    try:
        start = time.perf_counter()
        step()
        runtime.synchronize()
        total = time.perf_counter() - start
    finally:
        runtime.launch, cupy.matmul = real_launch, real_matmul
    print(f"serialised step {total * 1e3:.1f} ms; launch+GPU time by family "
          f"({sum(spent.values()) * 1e3:.1f} ms in all):", flush=True)
    for key, secs in spent.most_common(25):
        print(f"  {secs * 1e3:8.2f} ms  {key}", flush=True)

    prof = cProfile.Profile()
    prof.enable()
    step()
    runtime.synchronize()
    prof.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(30)
        print(f"--- cProfile, one step, by {order}\n{text.getvalue()}", flush=True)


def profile_overlap(steps: int, batch: int = 128) -> None:
    """Host-bound or GPU-bound: for the eager and the compiled (replayed) ResNet9 step, the
    time until the step's Python returns (kernels queued) against the time until the GPU has
    drained them; where each device-to-host copy (which waits for the GPU) comes from; and a
    cProfile of one replayed step."""
    import traceback

    from bench_gpu import _needle_resnet9_step

    from needle.backend_ndarray import ndarray_backend_cuda as B
    from needle.backend_ndarray._cuda import runtime

    compiled_step = None
    for name, compiled in (("eager", False), ("compiled", True)):
        step = _needle_resnet9_step(batch, compiled=compiled)
        for _ in range(2):
            step()
        queued, drained, cpu = [], [], []
        for _ in range(steps):
            runtime.synchronize()
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            queued.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)  # this process only: other jobs'
            runtime.synchronize()                          # load inflates wall time alone
            drained.append(time.perf_counter() - start)
        print(f"resnet9 b{batch} {name:8s}: Python returns after "
              f"{statistics.median(queued) * 1e3:6.2f} ms ({statistics.median(cpu) * 1e3:.2f} "
              f"ms of CPU), GPU drained after {statistics.median(drained) * 1e3:6.2f} ms "
              f"(medians of {steps} steps)", flush=True)
        real, seen = B.to_numpy, []

        def noting(*args, _real=real, _seen=seen):
            _seen.append("".join(traceback.format_stack(limit=6)[:-1]))
            return _real(*args)

        B.to_numpy = noting
        try:
            step()
        finally:
            B.to_numpy = real
        print(f"  {len(seen)} device-to-host copies per {name} step", flush=True)
        for where in seen[:2]:
            print(where, flush=True)
        compiled_step = step
    prof = cProfile.Profile()
    prof.enable()
    compiled_step()
    runtime.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(f"--- cProfile, one replayed (compiled) step, by tottime\n{text.getvalue()}", flush=True)


def _events_ms(cupy, fn, repeats: int = 20) -> float:
    fn()
    cupy.cuda.runtime.deviceSynchronize()
    times = []
    for _ in range(repeats):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(begin, end))
    return statistics.median(times)


def profile_launch() -> None:
    import cupy

    from needle.backend_ndarray import ndarray_backend_cuda as B

    n, calls = 1000, 2000
    x, out = B.Array(n, "float32"), B.Array(n, "float32")
    B.fill(x, 1.0)
    raw = cupy.RawKernel(r'''extern "C" __global__ void mul(const float* a, float v, float* o,
        long long n) { long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
        if (i < n) o[i] = a[i] * v; }''', "mul")
    cx, cout = cupy.ones(n, dtype=cupy.float32), cupy.empty(n, dtype=cupy.float32)
    rows = [("needle B.scalar_mul", lambda: B.scalar_mul(x, 1.5, out)),
            ("CuPy RawKernel call", lambda: raw((4,), (256,), (cx, np.float32(1.5), cout,
                                                               np.int64(n))))]
    try:
        import torch
        tx, tout = torch.ones(n, device="cuda"), torch.empty(n, device="cuda")
        rows.append(("torch.mul(out=)", lambda: torch.mul(tx, 1.5, out=tout)))
    except ImportError:
        pass
    for name, fn in rows:
        fn()
        cupy.cuda.runtime.deviceSynchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls
        cupy.cuda.runtime.deviceSynchronize()
        print(f"launch 1e3 f32 {name:22s} {host * 1e6:7.2f} us per call (host side)", flush=True)


EWISE = r'''
extern "C" __global__ void one_per_thread(const float* a, float v, float* o, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) o[i] = a[i] * v;
}
extern "C" __global__ void four_per_thread(const float* a, float v, float* o, long long n) {
  long long base = blockIdx.x * (long long)blockDim.x * 4 + threadIdx.x;
  #pragma unroll
  for (int k = 0; k < 4; ++k) {
    long long i = base + (long long)k * blockDim.x;
    if (i < n) o[i] = a[i] * v;
  }
}
extern "C" __global__ void vec4(const float4* a, float v, float4* o, long long n4) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4;
       i += (long long)gridDim.x * blockDim.x) {
    float4 x = a[i];
    o[i] = make_float4(x.x * v, x.y * v, x.z * v, x.w * v);
  }
}
'''


def profile_ewise() -> None:
    import cupy

    n, threads = 10**8, 256
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    mod = cupy.RawModule(code=EWISE)
    a = cupy.random.random(n, dtype=cupy.float32)
    o = cupy.empty_like(a)
    v, nn = np.float32(1.5), np.int64(n)
    blocks = -(-n // threads)
    variants = {
        "one per thread": lambda: mod.get_function("one_per_thread")(
            (blocks,), (threads,), (a, v, o, nn)),
        f"grid capped at {8 * sms} blocks": lambda: mod.get_function("one_per_thread")(
            (8 * sms,), (threads,), (a, v, o, nn)),
        "four per thread": lambda: mod.get_function("four_per_thread")(
            (-(-n // (4 * threads)),), (threads,), (a, v, o, nn)),
        "float4 loads (needle)": lambda: mod.get_function("vec4")(
            (-(-(n // 4) // threads),), (threads,), (a, v, o, np.int64(n // 4))),
        "float4 loads, capped grid": lambda: mod.get_function("vec4")(
            (8 * sms,), (threads,), (a, v, o, np.int64(n // 4))),
    }
    copy_ms = _events_ms(cupy, lambda: o.data.copy_from_device(a.data, 4 * n))
    print(f"ewise 1e8 f32 cudaMemcpy D2D: {8 * n / copy_ms / 1e6:7.1f} GB/s", flush=True)
    want = a * v
    for name, fn in variants.items():
        ms = _events_ms(cupy, fn)
        ok = bool(cupy.array_equal(o, want))
        o.fill(0)
        print(f"ewise 1e8 f32 scalar_mul {name:32s} {8 * n / ms / 1e6:7.1f} GB/s "
              f"({copy_ms / ms:.2f}x copy) correct={ok}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="resnet9,overlap,launch,ewise")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args(argv)
    parts = {"resnet9": lambda: profile_resnet9(args.steps, args.batch), "launch": profile_launch,
             "ewise": profile_ewise, "overlap": lambda: profile_overlap(args.steps, args.batch)}
    for name in args.only.split(","):
        parts[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
