"""Side-by-side benchmark of the C++ CPU backend's kernels against NumPy, in one run.

Usage::

    python bench/bench_ndarray.py            # full table (about two minutes on 2 cores)
    python bench/bench_ndarray.py --quick    # fewer repeats and sizes
    python bench/bench_ndarray.py --dispatch-only   # only the per-op table (NDArray level)

What is timed, and how:

* needle is called at the kernel level (``ndarray_backend_cpu``), writing into a pre-allocated
  ``out`` buffer; NumPy runs its natural expression (``a @ b``, ``a + b``, ``np.exp(a)``,
  ``a.sum()``), which allocates its result. The ``numpy out=`` column repeats NumPy with a
  pre-allocated ``out`` where the ufunc allows it, for a like-for-like comparison.
* needle's threads are set with ``set_num_threads``; NumPy/OpenBLAS's with threadpoolctl.
* Timing alternates between *phases* (a block of NumPy calls, a pause, a block of needle calls,
  a pause, ...) instead of single calls: OpenBLAS and OpenMP workers spin for ~0.1 s after a
  call and would steal the core from the other library (PERF_NOTES).
* Reported: per side, the fastest of the phases' median times (``--stat median``: the median
  of all calls), so that other processes on a shared machine disturb the ratio less.
* The ``dispatch`` table times whole NDArray operations on small (8 x 8) arrays against the
  same NumPy expression: per-op overhead (argument and size checks, allocation, the call into
  the kernel), where the size and bounds checks of docs/limits.md would show.
* This process drops ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` from its environment
  before NumPy loads, so OpenBLAS picks its kernel from the CPU it actually runs on.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from functools import partial

for _var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
    os.environ.pop(_var, None)

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

from needle.backend_ndarray import ndarray_backend_cpu as cpu  # noqa: E402

PAUSE_S = 0.15  # longer than the spin-wait of either thread pool


def _time_calls(fn, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


STAT = "best"  # or "median"; set from the command line


def compare(numpy_fn, needle_fn, phases: int, calls: int, numpy_out_fn=None):
    """Seconds per call for each side, timed in alternating phases.

    Each phase gives the median of its calls. ``STAT == "best"`` reports the fastest phase
    median of each side (on a shared machine other processes only ever slow a phase down, and
    a 2-thread parallel region stalls for a whole scheduler slice when another process holds
    a core); ``"median"`` the median of all calls.
    """
    sides = {"numpy": numpy_fn, "needle": needle_fn}
    if numpy_out_fn is not None:
        sides["numpy_out"] = numpy_out_fn
    phase_medians = {name: [] for name in sides}
    all_calls = {name: [] for name in sides}
    for fn in sides.values():  # warm-up: page in buffers, start thread pools
        fn()
    for _ in range(phases):
        for name, fn in sides.items():
            time.sleep(PAUSE_S)
            times = _time_calls(fn, calls)
            phase_medians[name].append(statistics.median(times))
            all_calls[name] += times
    if STAT == "best":
        return {name: min(meds) for name, meds in phase_medians.items()}
    return {name: statistics.median(ts) for name, ts in all_calls.items()}


def _buffer(values: np.ndarray):
    arr = cpu.Array(values.size, str(values.dtype))
    cpu.from_numpy(values, arr)
    return arr


def bench_matmul(sizes, threads, phases: int) -> list[tuple]:
    rows = []
    rng = np.random.default_rng(0)
    for n in sizes:
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        ha, hb, hc = _buffer(a), _buffer(b), cpu.Array(n * n)
        calls = max(1, int(2e9 / (2 * n**3)))  # ~2 GFLOP per phase and side
        for nt in threads:
            cpu.set_num_threads(nt)
            with threadpool_limits(limits=nt, user_api="blas"):
                t = compare(partial(np.matmul, a, b), partial(cpu.matmul, ha, hb, hc, n, n, n),
                            phases, calls)
            gflop = 2 * n**3 / 1e9
            rows.append((f"matmul n={n}", nt, gflop / t["numpy"], gflop / t["needle"],
                         t["numpy"] / t["needle"], "GFLOP/s"))
    return rows


ELEMENTWISE = {
    # name: (numpy expression, numpy with out=, needle call, arrays moved per element)
    "add": (lambda a, b, o: a + b, lambda a, b, o: np.add(a, b, out=o),
            lambda a, b, o: cpu.ewise_add(a, b, o), 3),
    "mul": (lambda a, b, o: a * b, lambda a, b, o: np.multiply(a, b, out=o),
            lambda a, b, o: cpu.ewise_mul(a, b, o), 3),
    "exp": (lambda a, b, o: np.exp(a), lambda a, b, o: np.exp(a, out=o),
            lambda a, b, o: cpu.ewise_exp(a, o), 2),
    "tanh": (lambda a, b, o: np.tanh(a), lambda a, b, o: np.tanh(a, out=o),
             lambda a, b, o: cpu.ewise_tanh(a, o), 2),
    "sum": (lambda a, b, o: a.sum(), None, lambda a, b, o: cpu.reduce_sum(a, o, a.size), 1),
    "max": (lambda a, b, o: a.max(), None, lambda a, b, o: cpu.reduce_max(a, o, a.size), 1),
}


def bench_elementwise(sizes, threads, phases: int) -> list[tuple]:
    rows = []
    rng = np.random.default_rng(1)
    for size in sizes:
        a = rng.standard_normal(size, dtype=np.float32)
        b = rng.standard_normal(size, dtype=np.float32)
        o = np.empty_like(a)
        ha, hb, ho, h1 = _buffer(a), _buffer(b), cpu.Array(size), cpu.Array(1)
        calls = max(3, int(3e7 / size))
        for name, (np_fn, np_out_fn, nd_fn, arrays) in ELEMENTWISE.items():
            out = h1 if name in ("sum", "max") else ho
            for nt in threads:
                cpu.set_num_threads(nt)
                with threadpool_limits(limits=1, user_api="blas"):
                    t = compare(partial(np_fn, a, b, o), partial(nd_fn, ha, hb, out), phases,
                                calls, partial(np_out_fn, a, b, o) if np_out_fn else None)
                gbytes = arrays * size * 4 / 1e9
                row = (f"{name} {size:.0e}", nt, gbytes / t["numpy"], gbytes / t["needle"],
                       t["numpy"] / t["needle"], "GB/s")
                if "numpy_out" in t:
                    row += (t["numpy_out"] / t["needle"],)
                rows.append(row)
    return rows


def _im2col(n: int, h: int, w: int, c: int, k: int, stride: int) -> tuple:
    """(shape, strides) in elements of conv's im2col view of a compact NHWC array."""
    ho, wo = (h - k) // stride + 1, (w - k) // stride + 1
    return ((n, ho, wo, k, k, c),
            (h * w * c, stride * w * c, stride * c, w * c, c, 1))


# name: (source elements, shape, strides, offset) of the view that compact gathers.
COMPACT = {
    "im2col C=3 (conv1)": (32 * 32 * 32 * 3, *_im2col(32, 32, 32, 3, 3, 1), 0),
    "im2col C=32": (32 * 32 * 32 * 32, *_im2col(32, 32, 32, 32, 3, 1), 0),
    "im2col C=128 s=2": (32 * 16 * 16 * 128, *_im2col(32, 16, 16, 128, 3, 2), 0),
    "slice [:, 1:-1] 1024x1024": (1024 * 1024, (1024, 1022), (1024, 1), 1),
    "transpose 1024x1024": (1024 * 1024, (1024, 1024), (1, 1024), 0),
    "NHWC->NCHW 32x32x32x64": (32 * 32 * 32 * 64, (32, 64, 32, 32), (65536, 1, 2048, 64), 0),
    "broadcast (1024,1)->(1024,1024)": (1024, (1024, 1024), (1, 0), 0),
}


def bench_compact(threads, phases: int) -> list[tuple]:
    """compact (gather a strided view) against np.ascontiguousarray of the same view."""
    rows = []
    rng = np.random.default_rng(2)
    for name, (size, shape, strides, offset) in COMPACT.items():
        src = rng.standard_normal(size, dtype=np.float32)
        view = np.lib.stride_tricks.as_strided(
            src[offset:], shape, tuple(4 * s for s in strides))
        count = int(np.prod(shape))
        ha, ho = _buffer(src), cpu.Array(count)
        calls = max(3, int(3e7 / count))
        for nt in threads:
            cpu.set_num_threads(nt)
            t = compare(partial(np.ascontiguousarray, view),
                        partial(cpu.compact, ha, ho, shape, strides, offset), phases, calls)
            gbytes = 2 * count * 4 / 1e9  # read + write of every output element
            rows.append((f"compact {name}", nt, gbytes / t["numpy"], gbytes / t["needle"],
                         t["numpy"] / t["needle"], "GB/s"))
    return rows


def bench_dispatch(phases: int) -> list[tuple]:
    """Microseconds per NDArray op on 8 x 8 float32 arrays, against NumPy's equivalent."""
    import needle.backend_ndarray as nd
    dev = nd.cpu()
    cpu.set_num_threads(1)
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((8, 8), dtype=np.float32) for _ in range(2))
    a, b = nd.NDArray(x, device=dev), nd.NDArray(y, device=dev)
    at = a.permute((1, 0))
    cases = {
        "a + b": (lambda: x + y, lambda: a + b),
        "a * 2.0": (lambda: x * 2.0, lambda: a * 2.0),
        "exp(a)": (lambda: np.exp(x), lambda: a.exp()),
        "a.sum(axis=1)": (lambda: x.sum(axis=1), lambda: a.sum(axis=1)),
        "a @ b": (lambda: x @ y, lambda: a @ b),
        "a[1:5, ::2]": (lambda: x[1:5, ::2], lambda: a[1:5, ::2]),
        "a.T (permute)": (lambda: x.T, lambda: at.permute((1, 0))),
        "reshape (64,)": (lambda: x.reshape(64), lambda: a.reshape((64,))),
        "broadcast_to (4,8,8)": (lambda: np.broadcast_to(x, (4, 8, 8)),
                                 lambda: a.broadcast_to((4, 8, 8))),
        "as_strided (8,8),(1,8)": (
            lambda: np.lib.stride_tricks.as_strided(x, (8, 8), (4, 32)),
            lambda: a.as_strided((8, 8), (1, 8))),
        "compact of a.T": (lambda: np.ascontiguousarray(x.T), lambda: at.compact()),
        "empty (8,8)": (lambda: np.empty((8, 8), np.float32), lambda: nd.empty((8, 8),
                                                                               device=dev)),
        "numpy()": (lambda: x.copy(), lambda: a.numpy()),
    }
    rows = []
    for name, (np_fn, nd_fn) in cases.items():
        t = compare(np_fn, nd_fn, phases, 2000)
        rows.append((f"dispatch {name}", 1, t["numpy"] * 1e6, t["needle"] * 1e6,
                     t["numpy"] / t["needle"], "us/op"))
    return rows


def print_table(rows) -> None:
    print("| kernel | threads | NumPy | needle | unit | needle/NumPy | vs NumPy out= |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        name, nt, numpy_rate, needle_rate, ratio, unit = row[:6]
        extra = f"{row[6]:.2f}x" if len(row) > 6 else "-"
        print(f"| {name} | {nt} | {numpy_rate:.1f} | {needle_rate:.1f} | {unit} | "
              f"{ratio:.2f}x | {extra} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--skip-matmul", action="store_true")
    parser.add_argument("--skip-elementwise", action="store_true")
    parser.add_argument("--skip-compact", action="store_true")
    parser.add_argument("--skip-dispatch", action="store_true")
    parser.add_argument("--dispatch-only", action="store_true",
                        help="only the per-op table (NDArray level, small arrays)")
    parser.add_argument("--stat", choices=["best", "median"], default="best",
                        help="best phase median (default) or median of all calls")
    args = parser.parse_args()
    global STAT
    STAT = args.stat
    phases = 2 if args.quick else 5
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, NumPy {np.__version__}, needle kernels: {cpu._get_isa()}, "
          f"load average {os.getloadavg()[0]:.2f}, statistic: {STAT}")
    for info in threadpool_info():
        print(f"# {info['user_api']}: {info['internal_api']} {info.get('version')} "
              f"kernel={info.get('architecture')} threads={info['num_threads']}")
    rows = []
    if args.dispatch_only:
        args.skip_matmul = args.skip_elementwise = args.skip_compact = True
    if not args.skip_matmul:
        sizes = [256, 1024] if args.quick else [256, 512, 1024, 2048]
        rows += bench_matmul(sizes, args.threads, phases)
    if not args.skip_elementwise:
        rows += bench_elementwise([10**6, 10**7], args.threads, phases)
    if not args.skip_compact:
        rows += bench_compact(args.threads, phases)
    if not args.skip_dispatch:
        rows += bench_dispatch(phases)
    print_table(rows)


if __name__ == "__main__":
    main()
