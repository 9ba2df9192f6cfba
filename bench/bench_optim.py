"""Optimizer step time: needle's fused update, its composed arithmetic, and PyTorch CPU.

For the parameters of the training benchmark's models (MLPResNet, ResNet9, the LSTM LM; built
by ``bench_training.py``), each rule (SGD, SGD with momentum 0.9, Adam) takes one step over
every parameter with a gradient set:

* ``fused``: needle as it runs on ``cpu()`` (one ``ewise_program`` per parameter, Adam two);
* ``composed``: the same update as separate kernels (what ``cuda()`` runs), forced by making
  ``ewise_program.available`` say no;
* ``torch``: ``torch.optim`` on tensors of the same shapes (its default implementation).

Blocks of ``--steps`` steps alternate between the three, ``--repeats`` times; the median
block gives microseconds per step. Ratios are ``torch / needle`` time (> 1: needle faster).

Run:  python bench/bench_optim.py [--steps 20] [--repeats 7] [--only mlp,resnet9,lstm]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import _openmp  # noqa: E402
import numpy as np  # noqa: E402

_openmp.load_torch_first()  # both sides under PyTorch's OpenMP settings: see bench/_openmp.py

RULES = ("sgd", "momentum", "adam")


def _shapes(workload: str, device) -> list:
    from bench_training import _mlp_on
    from models import LanguageModel, ResNet9

    if workload == "mlp":
        model = _mlp_on(device)
    elif workload == "resnet9":
        model = ResNet9(device=device)
    else:
        model = LanguageModel(30, 10000, 100, num_layers=2, seq_model="lstm", device=device)
    return [tuple(p.shape) for p in model.parameters()]


def _needle_step(shapes, rule: str, device):
    from needle import nn, optim
    from needle.autograd import Tensor

    rng = np.random.default_rng(0)
    params = [nn.Parameter(Tensor(rng.standard_normal(s), device=device)) for s in shapes]
    for p in params:
        p.grad = Tensor(rng.standard_normal(p.shape) * 1e-3, device=device,
                        requires_grad=False)
    return _make(optim.SGD, optim.Adam, params, rule).step


def _torch_step(shapes, rule: str):
    import torch

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-3
    opt = _make(torch.optim.SGD, torch.optim.Adam, params, rule)
    return opt.step


def _make(sgd, adam, params, rule):
    if rule == "adam":
        return adam(params, lr=1e-3)
    return sgd(params, lr=1e-3, momentum=0.9 if rule == "momentum" else 0.0)


def _block(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n * 1e6


def measure(workload: str, rule: str, steps: int, repeats: int, device) -> dict:
    import torch

    from needle.backend_ndarray import ewise_program

    shapes = _shapes(workload, device)
    sides = {"fused": _needle_step(shapes, rule, device),
             "composed": _needle_step(shapes, rule, device),
             "torch": _torch_step(shapes, rule)}
    real = ewise_program.available
    times = {name: [] for name in sides}

    def run(name, n):
        ewise_program.available = (lambda arrays: False) if name == "composed" else real
        try:
            return _block(sides[name], n)
        finally:
            ewise_program.available = real

    torch.set_num_threads(2)
    for name in sides:
        run(name, 2)  # warm-up: first steps create the moments
    for _ in range(repeats):
        for name in sides:
            times[name].append(run(name, steps))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"workload": workload, "rule": rule, "params": len(shapes), **med}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", default="mlp,resnet9,lstm")
    args = parser.parse_args(argv)
    import torch

    import needle.backend_ndarray as nd

    device = nd.cpu()
    if not device.enabled():
        raise SystemExit("cpu() backend not built")
    print(f"needle on cpu(), PyTorch {torch.__version__}; µs per optimizer step, median of "
          f"{args.repeats} blocks of {args.steps} alternating steps; load average "
          f"{os.getloadavg()[0]:.2f}; {_openmp.describe()}")
    print(f"{'workload':10s} {'rule':9s} {'params':>6s} {'fused':>10s} {'composed':>10s} "
          f"{'torch':>10s} {'comp/fused':>10s} {'torch/fused':>11s}")
    for workload in args.only.split(","):
        for rule in RULES:
            r = measure(workload, rule, args.steps, args.repeats, device)
            print(f"{workload:10s} {rule:9s} {r['params']:6d} {r['fused']:10.0f} "
                  f"{r['composed']:10.0f} {r['torch']:10.0f} "
                  f"{r['composed'] / r['fused']:9.2f}x {r['torch'] / r['fused']:10.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
