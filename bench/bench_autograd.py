"""Per-op dispatch cost of the autograd layer: a 50-op chain on 10×10 float32, vs PyTorch CPU.

The chain cycles add, mul, tanh, matmul, relu; timings are per op (chain time / 50), median
of alternating repeats (needle, torch, needle, torch, ...). Forward is timed with graph
recording on; forward+backward adds ``sum().backward()``. Tiny tensors: this measures Python
and dispatch overhead, which decides the speed of small models.

The column ``needle chk`` runs the same chain with one in-place write into an unrelated array
between forward and backward: backward then checks the saved tensors of every node (the
version check's slow path, autograd/versions.py); plain ``needle`` shows the common case,
where no write happened and the check is one integer comparison per node.

The column ``compiled`` runs the forward+backward step under ``ndl.compile`` (a kernel program
after its warm-up, trace and two recorded calls): what is left per op once op dispatch and
autograd are gone. Below the table, its time per kernel call of the program.

Run:  python bench/bench_autograd.py [--repeats 30] [--device cpu|cpu_numpy]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import needle.ops as ops  # noqa: E402
from needle.autograd import Tensor  # noqa: E402

N_OPS = 50


def needle_chain(device, write_between=False):
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((10, 10)), device=device, dtype="float32")
    w = Tensor(rng.standard_normal((10, 10)) * 0.3, device=device, dtype="float32")
    c = Tensor(rng.standard_normal((10, 10)) * 0.1, device=device, dtype="float32",
               requires_grad=False)
    other = Tensor(np.zeros(4), device=device, dtype="float32").realize_cached_data()
    between = (lambda: other.fill(0.0)) if write_between else None
    return _chain(x, w, c, ops.tanh, ops.relu, between)


def torch_chain():
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((10, 10)), dtype=torch.float32, requires_grad=True)
    w = torch.tensor(rng.standard_normal((10, 10)) * 0.3, dtype=torch.float32,
                     requires_grad=True)
    c = torch.tensor(rng.standard_normal((10, 10)) * 0.1, dtype=torch.float32)

    return _chain(x, w, c, torch.tanh, torch.relu)


def _chain(x, w, c, tanh, relu, between=None):
    """The same 50-op chain for either framework: (forward, forward + backward) closures."""

    def forward():
        h = x
        for i in range(N_OPS):
            k = i % 5
            if k == 0:
                h = h + c
            elif k == 1:
                h = h * c
            elif k == 2:
                h = tanh(h)
            elif k == 3:
                h = h @ w
            else:
                h = relu(h)
        return h

    def step():
        loss = forward().sum()
        if between is not None:
            between()
        loss.backward()
        x.grad = None
        w.grad = None

    return forward, step


def _time_us_per_op(fn, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner / N_OPS * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cpu_numpy"])
    args = parser.parse_args(argv)
    from needle.backend_ndarray import device_by_name

    device = device_by_name(args.device)
    if not device.enabled():
        raise SystemExit(f"device {args.device}() not available")
    runs = {"needle": needle_chain(device), "needle chk": needle_chain(device, True)}
    from needle import compile as ndl_compile

    fwd, step = needle_chain(device)
    compiled = ndl_compile(step)
    runs["compiled"] = (fwd, compiled)
    try:
        runs["torch"] = torch_chain()
    except ImportError:
        print("torch not importable: needle column only")
    results = {name: {"fwd": [], "fwd+bwd": []} for name in runs}
    for fwd, step in runs.values():  # warm-up (a compiled step: through its recorded calls)
        for _ in range(5):
            fwd()
            step()
    for _ in range(args.repeats):
        for name, (fwd, step) in runs.items():
            results[name]["fwd"].append(_time_us_per_op(fwd, args.inner))
            results[name]["fwd+bwd"].append(_time_us_per_op(step, args.inner))
    print(f"50-op chain (add, mul, tanh, matmul, relu) on 10x10 float32, device "
          f"{args.device}(); µs per op over {args.repeats} alternating repeats "
          f"(median, and best = least disturbed by other load)")
    header = "".join(f"{name + ' med':>16s}{name + ' best':>16s}" for name in runs)
    print(f"{'':9s}{header}   chk/needle med / best"
          + ("   needle/torch med / best" if "torch" in runs else ""))
    for kind in ("fwd", "fwd+bwd"):
        med = {name: statistics.median(results[name][kind]) for name in runs}
        best = {name: min(results[name][kind]) for name in runs}
        line = f"{kind:9s}" + "".join(f"{med[n]:16.2f}{best[n]:16.2f}" for n in runs)
        line += (f"   {med['needle chk'] / med['needle']:9.3f}x / "
                 f"{best['needle chk'] / best['needle']:.3f}x")
        if "torch" in runs:
            line += (f"   {med['needle'] / med['torch']:12.2f}x / "
                     f"{best['needle'] / best['torch']:.2f}x")
        print(line)
    mode = compiled.replay_mode()
    if mode["mode"] == "kernels":
        per_step = statistics.median(results["compiled"]["fwd+bwd"]) * N_OPS
        print(f"compiled fwd+bwd: a program of {mode['kernels']} kernel calls "
              f"({mode['fused_runs']} fused runs): {per_step / mode['kernels']:.2f} µs per "
              f"kernel call, kernel time included")
    else:
        print(f"compiled step replays as {mode}")


if __name__ == "__main__":
    main()
