"""What memory attribution and profiling cost a training step, side by side.

Two comparisons on the course's MLP-ResNet (784 -> hidden, 3 residual blocks, batch 128):

* ``attribution``: ``Optimizer.step`` with needle.memory's attribution (optimizer phase,
  ``optimizer_temp`` scope, new weights allocated as weights, moments retagged) against the same
  step with those calls replaced by no-ops in the same process;
* ``profile``: a whole training step (forward, backward, Adam step) plain and inside
  ``needle.memory.profile()`` (every allocation recorded with its op, phase, shape and line).

Alternating repeats (A, B, A, B, ...), medians, printed as milliseconds and the ratio B / A.
Timings on a shared 2-core machine are noisy: read the ratios, not the absolute numbers.

Run:  python bench/bench_memory_overhead.py [--device cpu|cpu_numpy] [--repeats 15]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import needle as ndl  # noqa: E402
import needle.optim as optim_module  # noqa: E402
from needle import nn, optim  # noqa: E402


def _model(device, hidden=100, blocks=3):
    def block():
        inner = nn.Sequential(nn.Linear(hidden, hidden // 2, device=device),
                              nn.BatchNorm1d(hidden // 2, device=device), nn.ReLU(),
                              nn.Dropout(0.1), nn.Linear(hidden // 2, hidden, device=device),
                              nn.BatchNorm1d(hidden, device=device))
        return nn.Sequential(nn.Residual(inner), nn.ReLU())

    np.random.seed(0)
    return nn.Sequential(nn.Linear(784, hidden, device=device), nn.ReLU(),
                         *[block() for _ in range(blocks)], nn.Linear(hidden, 10, device=device))


@contextlib.contextmanager
def _without_attribution():
    """Replace the optimizer's memory calls by no-ops (the B side of ``attribution``)."""
    saved = (optim_module._phase, optim_module._framework_category, optim_module._attribute)
    optim_module._phase = lambda *a: contextlib.nullcontext()
    optim_module._framework_category = lambda *a: contextlib.nullcontext()
    optim_module._attribute = lambda *a: None
    try:
        yield
    finally:
        optim_module._phase, optim_module._framework_category, optim_module._attribute = saved


def _median_ms(fn, repeats):
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cpu_numpy"], default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    device = ndl.backend_ndarray.device_by_name(args.device)
    model = _model(device)
    opt = optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = ndl.Tensor(rng.standard_normal((128, 784)), device=device, requires_grad=False)
    y = ndl.Tensor(rng.integers(0, 10, 128), device=device, requires_grad=False)
    loss_fn = nn.SoftmaxLoss()

    def step():
        opt.reset_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    def profiled():
        with ndl.memory.profile(device):
            step()

    def attributed():
        opt.step()

    def bare():
        with _without_attribution():
            opt.step()

    step()  # warm: state, caches, first-touch pages
    rows = {"attribution": [[], []], "profile": [[], []]}
    for _ in range(args.repeats):
        rows["attribution"][0].append(_median_ms(bare, 3))
        rows["attribution"][1].append(_median_ms(attributed, 3))
        rows["profile"][0].append(_median_ms(step, 1))
        rows["profile"][1].append(_median_ms(profiled, 1))
    print(f"device {device}, MLP-ResNet batch 128, Adam; medians of {args.repeats} alternating "
          f"repeats (shared machine: read the ratios)")
    print(f"{'comparison':<14}{'A':>22}{'ms':>9}{'B':>26}{'ms':>9}{'B/A':>7}")
    names = {"attribution": ("Adam.step, no-op mem", "Adam.step, attributed"),
             "profile": ("training step", "step inside profile()")}
    for key, (a, b) in rows.items():
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{key:<14}{names[key][0]:>22}{ma:9.2f}{names[key][1]:>26}{mb:9.2f}"
              f"{mb / ma:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
