"""ResNet9's convolution layers one by one: needle vs PyTorch CPU (oneDNN), forward and backward.

Usage::

    python bench/bench_conv.py                 # 1 and 2 threads, every layer
    python bench/bench_conv.py --threads 2 --batch 128 --repeats 15

Each row is one conv layer of ``apps/models.py``'s ResNet9 at batch 128 on 3x32x32 images
(kernel, stride, padding K//2 and the feature-map size that layer sees in the model). Timed:

* ``fwd``: the layer's convolution forward.
* ``bwd``: ``backward`` from an output gradient: the gradients of input and kernel (conv1's
  input is the image batch, whose gradient training never asks for: there only the kernel's),
  and of the bias for ``layer``. The forward that records the graph is not timed.

Two variants per side: ``op`` is the bare convolution in each framework's native layout
(needle ``ops.conv`` on NHWC with a (K, K, Cin, Cout) kernel; PyTorch ``F.conv2d`` on NCHW,
which oneDNN reorders internally), ``layer`` the module as the model uses it (needle
``nn.Conv``: NCHW in and out, layout transposes and bias included; PyTorch ``nn.Conv2d``).

Both sides get the same thread count: ``torch.set_num_threads(n)`` and needle's
``set_num_threads(n)``; BLAS pools are limited to ``n`` with threadpoolctl. Timing alternates
blocks of calls (needle, PyTorch, needle, ...) with pauses between them; torch is imported
first, so both sides share its libgomp at PyTorch's default settings (``bench/_openmp.py``);
each side reports the best block median
(``--stat median``: the median of all calls). Ratio = PyTorch time / needle time, so > 1
means needle is faster. On a shared machine, ``--threads 1 --clock cpu`` times each call by
its thread's CPU time, which other processes disturb far less than wall time.

``--as-avx2`` emulates an AVX2-only machine on an AVX-512 one: needle runs its AVX2 kernels
(``NEEDLE_CPU_ISA=avx2``), PyTorch its AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``) and oneDNN
its AVX2 JIT code (``ONEDNN_MAX_CPU_ISA=AVX2``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

if "--as-avx2" in sys.argv:  # before needle's module and torch load
    os.environ.update(NEEDLE_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2",
                      ONEDNN_MAX_CPU_ISA="AVX2", OPENBLAS_CORETYPE="Haswell")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _openmp  # noqa: E402
import numpy as np  # noqa: E402
from _machine import cpu_model  # noqa: E402

_openmp.load_torch_first()  # before needle loads the C++ kernels: see bench/_openmp.py

PAUSE_S = 0.1

# (name, Cin, Cout, kernel, stride, input height = width) for a 3x32x32 image batch
LAYERS = [
    ("conv1 3->16 k7 s4", 3, 16, 7, 4, 32),
    ("conv2 16->32 k3 s2", 16, 32, 3, 2, 8),
    ("res1 32->32 k3 s1", 32, 32, 3, 1, 4),
    ("conv3 32->64 k3 s2", 32, 64, 3, 2, 4),
    ("conv4 64->128 k3 s2", 64, 128, 3, 2, 2),
    ("res2 128->128 k3 s1", 128, 128, 3, 1, 1),
]


def _needle_case(variant, batch, cin, cout, k, s, hw, needs_input_grad):
    import needle as ndl
    from needle import nn, ops
    from needle.backend_ndarray import cpu

    rng = np.random.default_rng(0)
    device = cpu()
    if variant == "op":
        x = ndl.Tensor(rng.standard_normal((batch, hw, hw, cin)), device=device,
                       dtype="float32", requires_grad=needs_input_grad)
        w = ndl.Tensor(rng.standard_normal((k, k, cin, cout)) * 0.1, device=device,
                       dtype="float32", requires_grad=True)

        def forward():
            return ops.conv(x, w, stride=s, padding=k // 2)
    else:
        layer = nn.Conv(cin, cout, k, stride=s, device=device)
        x = ndl.Tensor(rng.standard_normal((batch, cin, hw, hw)), device=device,
                       dtype="float32", requires_grad=needs_input_grad)

        def forward():
            return layer(x)

    out = forward()
    grad = ndl.Tensor(rng.standard_normal(out.shape), device=device, dtype="float32",
                      requires_grad=False)

    def fwd():
        with ndl.no_grad():
            forward().realize_cached_data()

    def bwd_setup():
        return forward()

    def bwd(y):
        y.backward(grad)

    return fwd, bwd_setup, bwd


def _torch_case(variant, batch, cin, cout, k, s, hw, needs_input_grad):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, cin, hw, hw, generator=gen, requires_grad=needs_input_grad)
    if variant == "op":
        w = (torch.randn(cout, cin, k, k, generator=gen) * 0.1).requires_grad_()

        def forward():
            return F.conv2d(x, w, stride=s, padding=k // 2)
    else:
        layer = torch.nn.Conv2d(cin, cout, k, stride=s, padding=k // 2)

        def forward():
            return layer(x)

    out = forward()
    grad = torch.randn(out.shape, generator=gen)

    def fwd():
        with torch.no_grad():
            forward()

    def bwd_setup():
        return forward()

    def bwd(y):
        y.backward(grad)

    return fwd, bwd_setup, bwd


CLOCK = time.perf_counter  # --clock cpu: time.thread_time (1 thread only)


def _time_calls(fn, setup, calls: int) -> list:
    times = []
    for _ in range(calls):
        arg = setup() if setup else None
        start = CLOCK()
        fn(arg) if setup else fn()
        times.append(CLOCK() - start)
    return times


def compare(sides: dict, phases: int, calls: int, stat: str) -> dict:
    """Seconds per call for each side: alternating phases, best phase median or median."""
    meds = {name: [] for name in sides}
    every = {name: [] for name in sides}
    for fn, setup in sides.values():  # warm-up
        for _ in range(2):
            _time_calls(fn, setup, 1)
    for _ in range(phases):
        for name, (fn, setup) in sides.items():
            time.sleep(PAUSE_S)
            ts = _time_calls(fn, setup, calls)
            meds[name].append(statistics.median(ts))
            every[name] += ts
    if stat == "best":
        return {name: min(m) for name, m in meds.items()}
    return {name: statistics.median(ts) for name, ts in every.items()}


def run(threads: int, batch: int, variants, phases: int, calls: int, stat: str,
        only=()) -> list:
    import torch
    from threadpoolctl import threadpool_limits

    from needle.backend_ndarray import ndarray_backend_cpu as cpu_mod

    torch.set_num_threads(threads)
    cpu_mod.set_num_threads(threads)
    rows = []
    with threadpool_limits(limits=threads, user_api="blas"):
        for name, cin, cout, k, s, hw in LAYERS:
            if only and not name.startswith(tuple(only)):
                continue
            needs_input_grad = not name.startswith("conv1")
            for variant in variants:
                args = (variant, batch, cin, cout, k, s, hw, needs_input_grad)
                n_fwd, n_setup, n_bwd = _needle_case(*args)
                t_fwd, t_setup, t_bwd = _torch_case(*args)
                f = compare({"needle": (n_fwd, None), "torch": (t_fwd, None)}, phases, calls,
                            stat)
                b = compare({"needle": (n_bwd, n_setup), "torch": (t_bwd, t_setup)}, phases,
                            calls, stat)
                rows.append((name, variant, threads, f["needle"], f["torch"], b["needle"],
                             b["torch"]))
                print(_format(rows[-1]), flush=True)
    return rows


def _format(row) -> str:
    name, variant, threads, nf, tf, nb, tb = row
    return (f"| {name} | {variant} | {threads} | {nf * 1e3:.3f} | {tf * 1e3:.3f} | "
            f"{tf / nf:.2f}x | {nb * 1e3:.3f} | {tb * 1e3:.3f} | {tb / nb:.2f}x |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--variants", default="op,layer")
    parser.add_argument("--layers", default="",
                        help="comma-separated name prefixes (conv1,res1): only those layers")
    parser.add_argument("--phases", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--stat", choices=["best", "median"], default="best")
    parser.add_argument("--quick", action="store_true", help="2 phases of 5 calls")
    parser.add_argument("--as-avx2", action="store_true",
                        help="both sides restricted to AVX2 (see the module docstring)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this thread's CPU time, steadier on a shared machine but "
                             "only meaningful with --threads 1")
    args = parser.parse_args(argv)
    global CLOCK
    if args.clock == "cpu":
        if args.threads != [1]:
            parser.error("--clock cpu measures one thread: use it with --threads 1")
        CLOCK = time.thread_time
    import torch

    from needle.backend_ndarray import ndarray_backend_cpu as cpu_mod

    phases, calls = (2, 5) if args.quick else (args.phases, args.calls)
    info = (cpu_mod._kernel_info() if hasattr(cpu_mod, "_kernel_info")
            else {"isa": cpu_mod._get_isa(), "sgemm": "?"})
    print(f"# {datetime.date.today()} {cpu_model()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; needle kernels {info['isa']} (sgemm {info['sgemm']}); "
          f"PyTorch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, oneDNN "
          f"{torch.backends.mkldnn.is_available()}; batch {args.batch}; statistic {args.stat} "
          f"of {phases} phases x {calls} calls; clock {args.clock}; {_openmp.describe()}")
    print("| layer | variant | threads | needle fwd ms | torch fwd ms | fwd ratio | "
          "needle bwd ms | torch bwd ms | bwd ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        run(threads, args.batch, args.variants.split(","), phases, calls, args.stat,
            [p for p in args.layers.split(",") if p])
    return 0


if __name__ == "__main__":
    sys.exit(main())
