"""Eager, compiled and graph-replayed training steps on one device: bitwise the same.

Trains MLPResNet and ResNet9 a few SGD-with-momentum steps three ways from the same seed and
batches: eagerly, under ``ndl.compile(graphs=False)`` (the recorded kernel program replayed
from Python) and under ``ndl.compile()`` (on cuda(), one CUDA graph launch per step where
capture is possible). After every step the parameters, the BatchNorm statistics and the
loss must be bitwise equal to the eager run's. Prints one ``RESULT`` line per model and mode
(``RESULT equal_<model>_<mode> 1|0 bool - eager``) and the replay mode the compiled step
reached; exits 1 when any differ.

Usage:
    python bench/gpu_equality.py [--device cuda|cpu] [--steps 8]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))

import numpy as np  # noqa: E402


def _models(device) -> dict:
    import mlp_resnet
    from models import ResNet9

    return {"mlp_resnet": (lambda: mlp_resnet.MLPResNet(64, 128, num_blocks=2, num_classes=10,
                                                         drop_prob=0.1, device=device),
                           (128, 64)),
            "resnet9": (lambda: ResNet9(device=device), (16, 3, 32, 32))}


def train(device, make_model, x_shape, mode: str, steps: int):
    """``steps`` steps; returns (per-step values, the compiled step or None)."""
    import needle as ndl
    from needle import nn

    np.random.seed(0)
    model = make_model()
    params = model.parameters()
    optimizer = ndl.optim.SGD(params, lr=0.05, momentum=0.5, weight_decay=0.01)
    loss_fn = nn.SoftmaxLoss()
    norms = [m for m in _modules(model) if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))]

    def step(x, y):
        optimizer.reset_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    compiled = None
    if mode != "eager":
        compiled = step = ndl.compile(step, graphs=False if mode == "kernels" else None)
    rng = np.random.default_rng(1)
    np.random.seed(2)  # dropout masks: the same draws in every mode
    seen = []
    for _ in range(steps):
        x = ndl.Tensor(rng.standard_normal(x_shape).astype(np.float32), device=device)
        y = ndl.Tensor(rng.integers(0, 10, x_shape[0]), device=device)
        loss = step(x, y)
        seen.append([loss.numpy()] + [p.numpy() for p in params]
                    + [b.running_mean.numpy() for b in norms]
                    + [b.running_var.numpy() for b in norms])
    return seen, compiled


def _modules(module):
    yield module
    for child in module._children():
        yield from _modules(child)


def _differences(a, b) -> int:
    return sum(not np.array_equal(u, v) for sa, sb in zip(a, b, strict=True)
               for u, v in zip(sa, sb, strict=True))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--only", default="mlp_resnet,resnet9")
    args = p.parse_args(argv)
    import needle as ndl

    device = ndl.cuda() if args.device == "cuda" else ndl.cpu()
    if not device.enabled():
        raise SystemExit(f"gpu_equality: {args.device}() is not available here")
    bad = 0
    for name, (make, shape) in _models(device).items():
        if name not in args.only.split(","):
            continue
        eager, _ = train(device, make, shape, "eager", args.steps)
        for mode in ("kernels", "graph"):
            try:
                seen, compiled = train(device, make, shape, mode, args.steps)
            except TypeError as exc:  # a needle without the graphs option
                print(f"{name} {mode}: not run ({exc})", flush=True)
                continue
            diff = _differences(eager, seen)
            bad += diff > 0
            replay = compiled.replay_mode() if compiled is not None else {}
            print(f"{name} {mode}: {diff} of {len(eager) * len(eager[0])} values differ from "
                  f"eager; replay {replay}", flush=True)
            print(f"RESULT equal_{name}_{mode} {int(diff == 0)} bool - eager", flush=True)
            if mode == "graph":  # whether the step reached one graph launch per replay
                print(f"RESULT graph_used_{name} {int(replay.get('graph') is True)} bool - -",
                      flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
