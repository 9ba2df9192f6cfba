"""ndl.compile's memory: the planned arena and replay peak against the eager step's peak.

For each course model (MLPResNet on MNIST-sized rows, ResNet9 on 3×32×32 images, a 2-layer
LSTM language model, a transformer block), each optimiser (SGD with momentum, Adam), with and
without Dropout, one training step (forward, SoftmaxLoss, backward, optimiser step) is
compiled twice: with the default arena (``arena="bounded"``: a replay never needs more than
the eager step) and with every intermediate in the arena (``arena="all"``, what the compiler
did before). Columns, in requested bytes above those live before the step:

* ``eager``: the peak of the traced eager step;
* ``arena``: the arena's size; ``share``: the part of the intermediates' bytes it holds
  (the rest comes from the device's pools, when the step asks for it, as eagerly);
* ``planned``: the arena plus the pools' peak during a replay; ``/eager``: planned ÷ eager;
* ``measured``: the peak the allocator measured during the last replay (a kernel program's,
  which frees a pool buffer right after its last kernel, so it can be below ``planned``);
* ``all arena``, ``all planned``, ``/eager``: the same with ``arena="all"``;
* ``plain``: the peak of the same step not compiled (there optimisers update weights and
  moments in place; in a compiled step they make new ones, see docs/compile.md).

Bytes are counts (the same on every run of the same build); the date and the CPU are printed
for the record. ResNet9 and the language model have no Dropout of their own: "with" adds one
before ResNet9's classifier and one after the language model's embedding.

Usage:
    python bench/bench_compile_arena.py [--device cpu|cpu_numpy] [--only mlp,resnet9]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import numpy as np  # noqa: E402
from _machine import cpu_model  # noqa: E402

import needle as ndl  # noqa: E402
import needle.memory as mem  # noqa: E402
from needle import nn  # noqa: E402

MODELS = ("mlp_resnet", "resnet9", "lstm", "transformer")
STEPS = 6  # warm-up, trace, two recorded replays, two kernel replays


class _Classifier(nn.Module):
    """A transformer block over (batch, seq, dim) and a per-token linear head."""

    def __init__(self, dim, heads, classes, drop, device):
        super().__init__()
        self.block = nn.TransformerBlock(dim, heads, hidden_dim=2 * dim, dropout=drop,
                                         causal=True, device=device)
        self.head = nn.Linear(dim, classes, device=device)

    def forward(self, x):
        b, t, d = x.shape
        return self.head(self.block(x).reshape((b * t, d)))


def _strip_dropout(module) -> None:
    """Replace every Dropout under ``module`` by an Identity (no mask drawn, none kept)."""
    for key, value in list(vars(module).items()):
        if isinstance(value, nn.Dropout):
            setattr(module, key, nn.Identity())
        elif isinstance(value, nn.Module):
            _strip_dropout(value)
        elif isinstance(value, (list, tuple)):
            items = [nn.Identity() if isinstance(v, nn.Dropout) else v for v in value]
            for v in items:
                if isinstance(v, nn.Module):
                    _strip_dropout(v)
            setattr(module, key, type(value)(items))


def build(name: str, dropout: bool, device):
    """(model, batches) of one workload: inputs and labels as Tensors on ``device``."""
    import mlp_resnet
    from models import LanguageModel, ResNet9

    rng = np.random.default_rng(0)
    p = 0.1 if dropout else 0.0
    if name == "mlp_resnet":
        model = mlp_resnet.MLPResNet(784, 100, num_blocks=3, num_classes=10, drop_prob=p,
                                     device=device)
        x, y = rng.standard_normal((100, 784)), rng.integers(0, 10, 100)
    elif name == "resnet9":
        model = ResNet9(device=device)
        if dropout:
            *body, head = model.model.modules
            model.model = nn.Sequential(*body, nn.Dropout(p), head)
        x, y = rng.standard_normal((16, 3, 32, 32)), rng.integers(0, 10, 16)
    elif name == "lstm":
        model = LanguageModel(30, 1000, 100, num_layers=2, seq_model="lstm", device=device)
        if dropout:
            model.embedding = nn.Sequential(model.embedding, nn.Dropout(p))
        x, y = rng.integers(0, 1000, (20, 16)).astype(np.float32), rng.integers(0, 1000, 320)
    else:
        model = _Classifier(64, 4, 10, p, device)
        x, y = rng.standard_normal((8, 32, 64)), rng.integers(0, 10, 8 * 32)
    if not dropout:
        _strip_dropout(model)
    batch = (ndl.Tensor(x, device=device, dtype="float32"),
             ndl.Tensor(y, device=device, dtype="float32"))
    return model, batch


def measure(name: str, optimizer: str, dropout: bool, device, arena: str) -> dict:
    np.random.seed(0)
    model, (x, y) = build(name, dropout, device)
    model.train()
    opt = (ndl.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if optimizer == "sgd"
           else ndl.optim.Adam(model.parameters(), lr=1e-3))
    loss_fn = nn.SoftmaxLoss()

    def train_step(x, y):
        opt.reset_grad()
        out = model(x)
        loss = loss_fn(out[0] if isinstance(out, tuple) else out, y)
        loss.backward()
        opt.step()
        return loss

    step = ndl.compile(train_step, arena=arena) if arena else train_step
    peak = 0
    for _ in range(STEPS):
        gc.collect()  # a cycle of the previous step collected inside this one would hide bytes
        before = mem.stats(device)["requested_bytes"]
        mem.reset_peak(device)
        step(x, y)
        peak = mem.stats(device)["peak_requested_bytes"] - before
    if not arena:
        return {"measured": peak}
    return {**step.memory(), "measured": peak, "mode": step.replay_mode()["mode"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cpu_numpy"])
    parser.add_argument("--only", default=",".join(MODELS))
    args = parser.parse_args(argv)
    device = getattr(ndl, args.device)()
    print(f"# {datetime.date.today().isoformat()}, {cpu_model()}, device {args.device}")
    print(f"{'model':<12}{'opt':<5}{'drop':<6}{'eager':>10}{'arena':>10}{'share':>7}"
          f"{'planned':>10}{'/eager':>8}{'measured':>10}{'all arena':>11}"
          f"{'all planned':>12}{'/eager':>8}{'plain':>10}  mode")
    worst = 0.0
    for name in args.only.split(","):
        for optimizer in ("sgd", "adam"):
            for dropout in (False, True):
                plain = measure(name, optimizer, dropout, device, None)["measured"]
                b = measure(name, optimizer, dropout, device, "bounded")
                a = measure(name, optimizer, dropout, device, "all")
                ratio = b["planned_peak_bytes"] / b["eager_peak_bytes"]
                worst = max(worst, ratio)
                print(f"{name:<12}{optimizer:<5}{'yes' if dropout else 'no':<6}"
                      f"{b['eager_peak_bytes']:>10,}{b['arena_bytes']:>10,}"
                      f"{b['arena_share']:>7.0%}{b['planned_peak_bytes']:>10,}{ratio:>8.3f}"
                      f"{b['measured']:>10,}{a['arena_bytes']:>11,}"
                      f"{a['planned_peak_bytes']:>12,}"
                      f"{a['planned_peak_bytes'] / a['eager_peak_bytes']:>8.3f}{plain:>10,}"
                      f"  {b['mode']}")
                if b["planned_peak_bytes"] > b["eager_peak_bytes"]:
                    print(f"  above the eager peak: {b['strategy']} (the trace did not "
                          "account for every buffer outside the intermediates)")
    print(f"largest planned/eager with the default arena: {worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
