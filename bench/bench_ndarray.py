"""Side-by-side benchmark of the C++ CPU backend's kernels against NumPy, in one run.

Usage::

    python bench/bench_ndarray.py            # full table (several minutes on 2 cores)
    python bench/bench_ndarray.py --quick    # fewer repeats and sizes
    python bench/bench_ndarray.py --dispatch-only   # only the per-op table (NDArray level)
    python bench/bench_ndarray.py --as-avx2  # both sides restricted to AVX2 (see below)
    python bench/bench_ndarray.py --threads 1 --clock cpu   # steadier on a shared machine

What is timed, and how:

* needle is called at the kernel level (``ndarray_backend_cpu``), writing into a pre-allocated
  ``out`` buffer; NumPy runs its natural expression (``a @ b``, ``a + b``, ``np.exp(a)``,
  ``a.sum()``), which allocates its result. The ``numpy out=`` column repeats NumPy with a
  pre-allocated ``out`` where the ufunc allows it, for a like-for-like comparison.
* needle's threads are set with ``set_num_threads``; NumPy/OpenBLAS's with threadpoolctl.
* Timing alternates between *phases* (a block of NumPy calls, a pause, a block of needle calls,
  a pause, ...) instead of single calls: OpenBLAS and OpenMP workers spin for ~0.1 s after a
  call and would steal the core from the other library.
* Reported: per side, the fastest of the phases' median times (``--stat median``: the median
  of all calls), so that other processes on a shared machine disturb the ratio less.
* The ``dispatch`` table times whole NDArray operations on small (8 x 8) arrays against the
  same NumPy expression: per-op overhead (argument and size checks, allocation, the call into
  the kernel), where the size and bounds checks of docs/limits.md would show. Its "NumPy" and
  "needle" columns are microseconds per op (lower is faster); the ratio is still NumPy/needle.
* This process drops ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` from its environment
  before NumPy loads, so OpenBLAS picks its kernel from the CPU it actually runs on.
* The header prints the kernels each side runs: needle's kernel family and matmul
  micro-kernels (``_kernel_info()``), OpenBLAS's core type and NumPy's SIMD targets.
* matmul shapes for each n: square ``n x n @ n x n``; tall-skinny ``8n x n @ n x n/8``; and the
  square product with a transposed operand (``a.T @ b``, ``a @ b.T``), which NumPy hands to
  BLAS as a transpose flag and needle packs straight from the strided view. ``--kinds layers``
  times fixed shapes instead: the forward and both gradient products of the widest linear
  layers of the trained models (MLPResNet's 784 -> 100, the LSTM LM's 100 -> 10,000 head).
* ``--as-avx2`` emulates an AVX2-only machine on an AVX-512 one: needle runs its AVX2 build
  (``NEEDLE_CPU_ISA=avx2``), OpenBLAS its Haswell kernels (``OPENBLAS_CORETYPE=Haswell``) and
  NumPy drops its AVX-512 loops (``NPY_DISABLE_CPU_FEATURES``).
* ``--clock cpu`` times each call by the calling thread's CPU time instead of wall time: other
  processes on a shared machine then disturb the ratio far less (1 thread only).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from functools import partial

for _var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
    os.environ.pop(_var, None)
if "--as-avx2" in sys.argv:  # must be set before NumPy, OpenBLAS and needle's module load
    os.environ["NEEDLE_CPU_ISA"] = "avx2"
    os.environ["OPENBLAS_CORETYPE"] = "Haswell"
    os.environ["NPY_DISABLE_CPU_FEATURES"] = "X86_V4 AVX512_ICL AVX512_SPR"

import numpy as np  # noqa: E402
from _machine import cpu_model  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

from needle.backend_ndarray import ndarray_backend_cpu as cpu  # noqa: E402

PAUSE_S = 0.15  # longer than the spin-wait of either thread pool


CLOCK = time.perf_counter  # --clock cpu: time.thread_time


def _time_calls(fn, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
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


def _matmul_operands(rng, kind: str, n: int, dtype: str):
    """(m, k, p), NumPy's operands and needle's call for one matmul family."""
    if kind == "colsum":  # the rows of X (n x 8n) added up: a bias gradient's column sum,
        # needle's reduce_sum_leading against NumPy's X.sum(axis=0) (counted as ones @ X)
        x = rng.standard_normal((n, 8 * n)).astype(dtype)
        hx, hc = _buffer(x), cpu.Array(8 * n, dtype)
        call = partial(cpu.reduce_sum_leading, hx, hc, n, 8 * n)
        return (1, n, 8 * n), partial(np.sum, x, axis=0), call
    if kind == "layers":
        m, k, p, a_t, b_t = LAYER_PRODUCTS[n]
    else:
        m, k, p = (8 * n, n, max(n // 8, 1)) if kind == "tall" else (n, n, n)
        a_t, b_t = kind == "aT", kind == "bT"
    a_store = rng.standard_normal((k, m) if a_t else (m, k)).astype(dtype)
    b_store = rng.standard_normal((p, k) if b_t else (k, p)).astype(dtype)
    a = a_store.T if a_t else a_store
    b = b_store.T if b_t else b_store
    ha, hb, hc = _buffer(a_store), _buffer(b_store), cpu.Array(m * p, dtype)
    a_strides = (1, m) if a_t else (k, 1)
    b_strides = (1, k) if b_t else (p, 1)
    call = partial(cpu.matmul_strided, ha, hb, hc, m, k, p, 0, *a_strides, 0, *b_strides)
    return (m, k, p), partial(np.matmul, a, b), call


MATMUL_KINDS = {"square": "n x n @ n x n", "tall": "8n x n @ n x n/8", "aT": "a.T @ b",
                "bT": "a @ b.T", "colsum": "sum of n rows, n x 8n",
                "layers": "the course models' layer products (sizes ignored)"}

# kind "layers": the products of the benchmarked models' widest linear layers, forward and
# both gradients, as autograd computes them: (m, k, p, a transposed, b transposed).
LAYER_PRODUCTS = {
    "MLP x@W 128x784x100": (128, 784, 100, False, False),
    "MLP dX=dY@W.T 128x100x784": (128, 100, 784, False, True),
    "MLP dW=X.T@dY 784x128x100": (784, 128, 100, True, False),
    "LSTM head 320x100x10000": (320, 100, 10000, False, False),
    "LSTM dX 320x10000x100": (320, 10000, 100, False, True),
    "LSTM dW 100x320x10000": (100, 320, 10000, True, False),
}


def bench_matmul(sizes, threads, phases: int, dtypes=("float32",), kinds=("square",)):
    rows = []
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        for kind in kinds:
            for n in (LAYER_PRODUCTS if kind == "layers" else sizes):
                (m, k, p), np_fn, nd_fn = _matmul_operands(rng, kind, n, dtype)
                flop = 2 * m * k * p
                calls = max(1, int(1e9 / flop))  # ~1 GFLOP per phase and side
                for nt in threads:
                    cpu.set_num_threads(nt)
                    with threadpool_limits(limits=nt, user_api="blas"):
                        t = compare(np_fn, nd_fn, phases, calls)
                    name = (f"matmul {dtype[5:]} {n}" if kind == "layers"
                            else f"matmul {dtype[5:]} {kind} n={n}")
                    rows.append((name, nt, flop / 1e9 / t["numpy"], flop / 1e9 / t["needle"],
                                 t["numpy"] / t["needle"], "GFLOP/s"))
                    print(_row_text(rows[-1]), flush=True)
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
                print(_row_text(row), flush=True)
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
    # nn.Conv's layout changes at ResNet9's batch 128 (conv3's input, conv2's output)
    "NCHW->NHWC 128x32x4x4": (128 * 32 * 4 * 4, (128, 4, 4, 32), (512, 4, 1, 16), 0),
    "NHWC->NCHW 128x8x8x32": (128 * 8 * 8 * 32, (128, 32, 8, 8), (2048, 1, 256, 32), 0),
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
            print(_row_text(rows[-1]), flush=True)
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
        print(_row_text(rows[-1]), flush=True)
    return rows


def _row_text(row) -> str:
    name, nt, numpy_rate, needle_rate, ratio, unit = row[:6]
    extra = f"{row[6]:.2f}x" if len(row) > 6 else "-"
    return (f"| {name} | {nt} | {numpy_rate:.1f} | {needle_rate:.1f} | {unit} | "
            f"{ratio:.2f}x | {extra} |")


def _kernel_info() -> dict:
    """needle's kernel family and matmul micro-kernels (older builds: what is known)."""
    if hasattr(cpu, "_kernel_info"):
        return cpu._kernel_info()
    return {"isa": cpu._get_isa(), "sgemm": "?", "dgemm": "?"}


def print_header() -> None:
    info = _kernel_info()
    print(f"# {datetime.date.today()} {cpu_model()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}, statistic: {STAT}, clock: "
          f"{'cpu' if CLOCK is time.thread_time else 'wall'}")
    print(f"# needle: kernels {info['isa']}, sgemm {info['sgemm']}, dgemm {info['dgemm']} "
          f"(available: {', '.join(getattr(cpu, '_available_isas', lambda: ['?'])())})")
    print(f"# NumPy {np.__version__}: SIMD {_numpy_simd()}")
    for info in threadpool_info():
        print(f"# {info['user_api']}: {info['internal_api']} {info.get('version')} "
              f"kernel={info.get('architecture')} threads={info['num_threads']}")
    print("| kernel | threads | NumPy | needle | unit | needle/NumPy | vs NumPy out= |")
    print("|---|---|---|---|---|---|---|")


def _numpy_simd() -> str:
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:  # NumPy < 2
        return "?"
    found = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
    return ", ".join(found) or "baseline"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="matmul n (default 64 ... 2048; --quick: 64 256 1024)")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--kinds", default=",".join(MATMUL_KINDS),
                        help=f"matmul families: {', '.join(MATMUL_KINDS)}")
    parser.add_argument("--skip-matmul", action="store_true")
    parser.add_argument("--skip-elementwise", action="store_true")
    parser.add_argument("--skip-compact", action="store_true")
    parser.add_argument("--skip-dispatch", action="store_true")
    parser.add_argument("--dispatch-only", action="store_true",
                        help="only the per-op dispatch table")
    parser.add_argument("--stat", choices=["best", "median"], default="best",
                        help="best phase median (default) or median of all calls")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--as-avx2", action="store_true",
                        help="both sides restricted to AVX2 (see the module docstring)")
    args = parser.parse_args()
    global STAT, CLOCK
    STAT = args.stat
    if args.clock == "cpu":
        if args.threads != [1]:
            parser.error("--clock cpu measures one thread: use it with --threads 1")
        CLOCK = time.thread_time
    phases = 2 if args.quick else 5
    if args.dispatch_only:
        args.skip_matmul = args.skip_elementwise = args.skip_compact = True
    print_header()
    if not args.skip_matmul:
        sizes = args.sizes or ([64, 256, 1024] if args.quick else [64, 128, 256, 512, 1024,
                                                                   2048])
        bench_matmul(sizes, args.threads, phases, args.dtypes.split(","), args.kinds.split(","))
    if not args.skip_elementwise:
        bench_elementwise([10**6, 10**7], args.threads, phases)
    if not args.skip_compact:
        bench_compact(args.threads, phases)
    if not args.skip_dispatch:
        bench_dispatch(phases)


if __name__ == "__main__":
    main()
