"""needle's CUDA backend side by side with PyTorch CUDA, in one run on one GPU.

Rows (targets in brackets):
  * float32 matmul n = 1024 … 8192, TFLOP/s: needle through cuBLAS (CuPy) [>= 0.9x PyTorch]
    and needle's own tiled kernel [>= 0.3x PyTorch]. TF32 is off on both sides (PyTorch's
    default for matmul; CuPy uses TF32 only with CUPY_TF32=1, which this script refuses).
  * elementwise on 1e8 float32, GB/s moved: needle ewise_add / scalar_mul / reduce_sum against
    the device's own copy bandwidth (cudaMemcpy device to device) [>= 0.7x copy], and PyTorch.
  * reductions of 1e8 float32, GB/s read [>= 0.8x copy]: sum and max over the last axis
    (10,000 rows of 10,000) and over the leading axis (the same array reduced to its 10,000
    columns: the backend's column sum; max through NDArray's ``max(axis=0)``, the column
    kernel), against PyTorch's sum/amax over the same dim.
  * ResNet9 training, batch 128, SGD, images/s [>= 0.5x PyTorch]; skipped with a message if
    apps/models.py has no ResNet9 or needle cannot train it on cuda(); then the same step
    under ``ndl.compile`` (replayed), against a second PyTorch measurement.
Each measurement: warm-up, then --repeats timed blocks alternating needle and PyTorch, the
median kept; ratios are needle / PyTorch (or / copy bandwidth). Timings never decide a test.
Every row is also printed as ``RESULT name value unit ratio against`` (bench/gpu_check.sh
collects these into its summary).

Usage:
    python bench/bench_gpu.py [--quick] [--json out.json] [--only matmul,ewise,reduce,resnet9]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def _timed(fn, sync, min_seconds: float = 0.05) -> float:
    """Seconds per call of ``fn``: calls are batched until a block lasts ``min_seconds``."""
    calls = 1
    while True:
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds or calls >= 1 << 14:
            return elapsed / calls
        calls *= 2


def result(name: str, value: float, unit: str, ratio=None, against: str = "-") -> None:
    """One machine-readable line: ``RESULT name value unit ratio against``."""
    shown = "-" if ratio is None else f"{ratio:.3f}"
    print(f"RESULT {name} {value:.6g} {unit} {shown} {against}", flush=True)


def _median_pair(needle_fn, torch_fn, needle_sync, torch_sync, repeats: int) -> tuple:
    needle_fn(), torch_fn()  # warm-up: compiles kernels, fills pools, loads cuBLAS
    n_times, t_times = [], []
    for _ in range(repeats):
        n_times.append(_timed(needle_fn, needle_sync))
        t_times.append(_timed(torch_fn, torch_sync))
    return statistics.median(n_times), statistics.median(t_times)


def _backend():
    import needle.backend_ndarray as nd
    from needle.backend_ndarray import ndarray_backend_cuda as B

    if not nd.cuda().enabled():
        raise SystemExit(f"bench_gpu: cuda() is not available ({B.unavailable_reason()})")
    return B


def _device_array(B, x: np.ndarray):
    arr = B.Array(x.size, x.dtype.name)
    B.from_numpy(x, arr)
    return arr


def _matmul_row(B, torch, n: int, repeats: int) -> dict:
    rng = np.random.default_rng(n)
    a = _device_array(B, rng.standard_normal((n, n), dtype=np.float32))
    b = _device_array(B, rng.standard_normal((n, n), dtype=np.float32))
    out = B.Array(n * n, "float32")
    ta, tb = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    tout = torch.empty(n, n, device="cuda")
    flop, row, torch_rates = 2.0 * n ** 3, {"n": n}, []
    for impl in ("cublas", "tiled"):
        B.set_matmul_impl(impl)
        t_needle, t_torch = _median_pair(
            lambda: B.matmul(a, b, out, n, n, n), lambda: torch.matmul(ta, tb, out=tout),
            B.synchronize, torch.cuda.synchronize, repeats)
        row[impl] = flop / t_needle / 1e12
        torch_rates.append(flop / t_torch / 1e12)
    B.set_matmul_impl("cublas")
    row["torch"] = statistics.median(torch_rates)
    return row


def bench_matmul(sizes, repeats: int) -> list:
    import torch

    B = _backend()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for n in sizes:
        row = _matmul_row(B, torch, n, repeats)
        rows.append(row)
        print(f"matmul f32 n={n:5d}  cuBLAS path {row['cublas']:6.2f}  own tiled "
              f"{row['tiled']:6.2f}  PyTorch {row['torch']:6.2f} TFLOP/s   ratios "
              f"{row['cublas'] / row['torch']:.2f} / {row['tiled'] / row['torch']:.2f}",
              flush=True)
        for impl in ("cublas", "tiled"):
            result(f"matmul_f32_{n}_{impl}", row[impl], "TFLOP/s", row[impl] / row["torch"],
                   "pytorch")
    return rows


def bench_elementwise(n: int, repeats: int) -> list:
    import cupy
    import torch

    B = _backend()
    x = _device_array(B, np.random.default_rng(0).random(n, dtype=np.float32))
    y, out = B.Array(n, "float32"), B.Array(n, "float32")
    B.fill(y, 1.5)
    red = B.Array(1, "float32")
    tx, ty = torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
    tout, tred = torch.empty(n, device="cuda"), torch.empty((), device="cuda")
    src, dst = cupy.empty(n, dtype=cupy.float32), cupy.empty(n, dtype=cupy.float32)
    nbytes = 4 * n
    copy_t = statistics.median(
        _timed(lambda: dst.data.copy_from_device(src.data, nbytes), B.synchronize)
        for _ in range(repeats))
    copy_bw = 2 * nbytes / copy_t / 1e9
    print(f"device copy (cudaMemcpy D2D) {n:.0e} f32: {copy_bw:8.1f} GB/s", flush=True)
    result(f"copy_{n:.0e}", copy_bw, "GB/s")
    cases = [
        ("ewise_add", 3, lambda: B.ewise_add(x, y, out), lambda: torch.add(tx, ty, out=tout)),
        ("scalar_mul", 2, lambda: B.scalar_mul(x, 1.5, out), lambda: torch.mul(tx, 1.5,
                                                                                 out=tout)),
        ("reduce_sum", 1, lambda: B.reduce_sum(x, red, n), lambda: torch.sum(tx, dim=0, out=tred)),
    ]
    rows = [{"op": "copy", "needle": copy_bw, "torch": None, "copy": copy_bw}]
    for name, arrays, needle_fn, torch_fn in cases:
        t_needle, t_torch = _median_pair(needle_fn, torch_fn, B.synchronize,
                                         torch.cuda.synchronize, repeats)
        row = {"op": name, "needle": arrays * nbytes / t_needle / 1e9,
               "torch": arrays * nbytes / t_torch / 1e9, "copy": copy_bw}
        rows.append(row)
        _print_bandwidth_row(name, n, row)
    return rows


def _print_bandwidth_row(name: str, n: int, row: dict) -> None:
    print(f"{name:10s} {n:.0e} f32: needle {row['needle']:8.1f} GB/s "
          f"({row['needle'] / row['copy']:.2f}x copy)  PyTorch {row['torch']:8.1f} GB/s "
          f"(ratio {row['needle'] / row['torch']:.2f})", flush=True)
    result(name, row["needle"], "GB/s", row["needle"] / row["copy"], "copy")
    result(name, row["needle"], "GB/s", row["needle"] / row["torch"], "pytorch")


def _copy_bandwidth(B, n: int, repeats: int) -> float:
    import cupy

    src, dst = cupy.empty(n, dtype=cupy.float32), cupy.empty(n, dtype=cupy.float32)
    t = statistics.median(_timed(lambda: dst.data.copy_from_device(src.data, 4 * n),
                                 B.synchronize) for _ in range(repeats))
    return 2 * 4 * n / t / 1e9


def bench_reductions(n: int, repeats: int) -> list:
    """sum and max of an (n / cols, cols) float32 array over its last axis and over its
    leading axis; GB/s read, against the copy bandwidth and PyTorch."""
    import torch

    import needle.backend_ndarray as nd

    B = _backend()
    cols = 10_000 if n >= 10**8 else 1_000
    rows = n // cols
    n = rows * cols
    host = np.random.default_rng(0).random((rows, cols), dtype=np.float32)
    x = nd.NDArray(host, device=nd.cuda())
    buf = x._handle
    tx = torch.from_numpy(host).cuda()
    last, lead = B.Array(rows, "float32"), B.Array(cols, "float32")
    copy_bw = _copy_bandwidth(B, n, repeats)
    cases = [
        ("reduce_sum_last", lambda: B.reduce_sum(buf, last, cols),
         lambda: torch.sum(tx, dim=1)),
        ("reduce_max_last", lambda: B.reduce_max(buf, last, cols),
         lambda: torch.amax(tx, dim=1)),
        ("reduce_sum_leading", lambda: B.reduce_sum_leading(buf, lead, rows, cols),
         lambda: torch.sum(tx, dim=0)),
        ("reduce_max_leading", lambda: x.max(axis=0), lambda: torch.amax(tx, dim=0)),
    ]
    out = []
    for name, needle_fn, torch_fn in cases:
        t_needle, t_torch = _median_pair(needle_fn, torch_fn, B.synchronize,
                                         torch.cuda.synchronize, repeats)
        row = {"op": name, "needle": 4 * n / t_needle / 1e9, "torch": 4 * n / t_torch / 1e9,
               "copy": copy_bw}
        out.append(row)
        _print_bandwidth_row(name, n, row)
    np.testing.assert_allclose(B.to_numpy(lead, (cols,), (1,), 0), host.sum(0), rtol=1e-3)
    np.testing.assert_array_equal(B.to_numpy(last, (rows,), (1,), 0), host.max(1))
    return out


def _needle_resnet9_step(batch: int = 128, compiled: bool = False):
    """One SGD step of ResNet9 on cuda(); ``compiled``: the step runs under ``ndl.compile``
    (traced once, then replayed as its recorded kernel list)."""
    sys.path.insert(0, os.path.join(ROOT, "apps"))
    try:
        from apps.models import ResNet9
    except ImportError:
        from models import ResNet9  # apps/ without __init__.py

    import needle as ndl
    from needle import nn, optim

    device = ndl.cuda()
    np.random.seed(0)
    model = ResNet9(device=device)
    x = ndl.Tensor(np.random.rand(batch, 3, 32, 32).astype(np.float32), device=device)
    y = ndl.Tensor(np.random.randint(0, 10, batch), device=device)
    loss_fn, opt = nn.SoftmaxLoss(), optim.SGD(model.parameters(), lr=0.01)
    model.train()

    def train_step(x, y):
        loss = loss_fn(model(x), y)
        opt.reset_grad()
        loss.backward()
        opt.step()
        return loss

    if compiled:
        train_step = ndl.compile(train_step)
        for _ in range(4):  # warm-up, trace, record twice: later calls replay
            train_step(x, y)

    def step():
        train_step(x, y)

    return step


def _torch_resnet9_step():
    import torch
    from torch import nn

    class Residual(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x) + x

    def cbr(a, b, k, s):
        return nn.Sequential(nn.Conv2d(a, b, k, s, k // 2), nn.BatchNorm2d(b), nn.ReLU())

    torch.manual_seed(0)
    model = nn.Sequential(
        cbr(3, 16, 7, 4), cbr(16, 32, 3, 2), Residual(nn.Sequential(cbr(32, 32, 3, 1),
                                                                   cbr(32, 32, 3, 1))),
        cbr(32, 64, 3, 2), cbr(64, 128, 3, 2),
        Residual(nn.Sequential(cbr(128, 128, 3, 1), cbr(128, 128, 3, 1))),
        nn.Flatten(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).cuda()
    x = torch.rand(128, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (128,), device="cuda")
    loss_fn, opt = nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def bench_resnet9(repeats: int) -> list:
    import torch

    B = _backend()
    try:
        needle_step = _needle_resnet9_step()
        needle_step()
    except Exception as exc:  # noqa: BLE001 - report and go on: this row depends on others' work
        print(f"resnet9: skipped, needle cannot train ResNet9 on cuda() here "
              f"({type(exc).__name__}: {exc})", flush=True)
        traceback.print_exc(limit=3)
        return [{"skipped": f"{type(exc).__name__}: {exc}"}]
    t_needle, t_torch = _median_pair(needle_step, _torch_resnet9_step(), B.synchronize,
                                     torch.cuda.synchronize, repeats)
    row = {"needle": 128 / t_needle, "torch": 128 / t_torch}
    print(f"ResNet9 b128 SGD train: needle {row['needle']:9.0f} img/s  PyTorch "
          f"{row['torch']:9.0f} img/s  ratio {row['needle'] / row['torch']:.2f}", flush=True)
    result("resnet9_b128_eager", row["needle"], "img/s", row["needle"] / row["torch"], "pytorch")
    try:
        compiled_step = _needle_resnet9_step(compiled=True)
        t_compiled, t_torch = _median_pair(compiled_step, _torch_resnet9_step(), B.synchronize,
                                           torch.cuda.synchronize, repeats)
    except Exception as exc:  # noqa: BLE001 - the eager row above still stands
        print(f"resnet9 compiled: failed ({type(exc).__name__}: {exc})", flush=True)
        traceback.print_exc(limit=5)
        return [row]
    row.update(compiled=128 / t_compiled, torch_again=128 / t_torch)
    print(f"ResNet9 b128 SGD train, ndl.compile: needle {row['compiled']:9.0f} img/s  PyTorch "
          f"{row['torch_again']:9.0f} img/s  ratio {row['compiled'] / row['torch_again']:.2f}",
          flush=True)
    result("resnet9_b128_compiled", row["compiled"], "img/s",
           row["compiled"] / row["torch_again"], "pytorch")
    return [row]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="matmul,ewise,reduce,resnet9")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="sizes up to 4096, 1e7 elements")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if os.environ.get("CUPY_TF32") == "1":
        raise SystemExit("bench_gpu: unset CUPY_TF32: the comparison is float32 without TF32")
    try:
        import cupy
        import torch
    except ImportError as exc:
        raise SystemExit(f"bench_gpu: needs CuPy and PyTorch with CUDA ({exc})") from exc

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    info = {"device": props["name"].decode() if isinstance(props["name"], bytes)
            else str(props["name"]), "date": time.strftime("%Y-%m-%d"),
            "cupy": cupy.__version__, "torch": torch.__version__}
    print(f"# bench_gpu {info}", flush=True)
    results = {"info": info}
    only = set(args.only.split(","))
    if "matmul" in only:
        sizes = (1024, 2048, 4096) if args.quick else (1024, 2048, 4096, 8192)
        results["matmul"] = bench_matmul(sizes, args.repeats)
    if "ewise" in only:
        results["elementwise"] = bench_elementwise(10**7 if args.quick else 10**8, args.repeats)
    if "reduce" in only:
        results["reductions"] = bench_reductions(10**7 if args.quick else 10**8, args.repeats)
    if "resnet9" in only:
        results["resnet9"] = bench_resnet9(args.repeats)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
