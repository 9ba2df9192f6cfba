"""ndl.compile: k replayed steps give bitwise the parameters of k eager steps.

The same kernels run in the same order on the same inputs (only the buffers' addresses
differ), so equality is exact. Each model trains with dropout (fresh masks every step, drawn
from the needle.random streams) and an optimiser with state; one model wraps a block in a
checkpoint region. Every test runs on cpu_numpy() and cpu().
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import needle as ndl
from needle import nn

sys.path.append(os.path.join(os.path.dirname(__file__), "..", "..", "apps"))
import mlp_resnet  # noqa: E402 - apps/ on sys.path
from models import LanguageModel, ResNet9  # noqa: E402

STEPS = 4  # warm-up, trace, two replays


@pytest.fixture(params=["cpu_numpy", "cpu"])
def dev(request):
    return getattr(ndl, request.param)()


class MLPResNet(nn.Module):
    """apps/mlp_resnet.py's MLPResNet (Linear, ReLU, residual blocks with BatchNorm and
    Dropout) on a device; ``checkpoint_block`` recomputes the first residual block in
    backward."""

    def __init__(self, dim, hidden, blocks, classes, device, drop=0.2, checkpoint_block=False):
        super().__init__()
        self.net = mlp_resnet.MLPResNet(dim, hidden, num_blocks=blocks, num_classes=classes,
                                        drop_prob=drop, device=device)
        self.checkpoint_block = checkpoint_block

    def forward(self, x):
        stem_linear, stem_relu, *blocks, head = self.net.modules
        h = stem_relu(stem_linear(x))
        for i, block in enumerate(blocks):
            h = ndl.checkpoint(block, h) if self.checkpoint_block and i == 0 else block(h)
        return head(h)


class TinyTransformer(nn.Module):
    def __init__(self, dim, heads, device):
        super().__init__()
        self.block = nn.TransformerBlock(dim, heads, hidden_dim=2 * dim, dropout=0.1,
                                         causal=True, device=device)
        self.head = nn.Linear(dim, 5, device=device)

    def forward(self, x):
        b, t, d = x.shape
        return self.head(self.block(x).reshape((b * t, d)))


def mlp(dev, **kw):
    return MLPResNet(20, 32, 2, 10, dev, **kw)


def make(kind, dev):
    """(model, optimizer, inputs per step) for one workload."""
    rng = np.random.default_rng(5)
    if kind in ("mlp", "mlp_checkpoint"):
        model = mlp(dev, checkpoint_block=kind == "mlp_checkpoint")
        opt = ndl.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
        batches = [(rng.standard_normal((16, 20)), rng.integers(0, 10, 16)) for _ in range(STEPS)]
    elif kind == "resnet9":
        model = ResNet9(device=dev)
        opt = ndl.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        batches = [(rng.standard_normal((2, 3, 32, 32)), rng.integers(0, 10, 2))
                   for _ in range(3)]
    elif kind == "lstm":
        model = LanguageModel(8, 12, 16, num_layers=2, seq_model="lstm", device=dev)
        opt = ndl.optim.SGD(model.parameters(), lr=0.1)
        batches = [(rng.integers(0, 12, (5, 3)).astype(np.float32), rng.integers(0, 12, 15))
                   for _ in range(STEPS)]
    else:
        model = TinyTransformer(8, 2, dev)
        opt = ndl.optim.Adam(model.parameters(), lr=1e-2)
        batches = [(rng.standard_normal((2, 4, 8)), rng.integers(0, 5, 8)) for _ in range(STEPS)]
    data = [(ndl.Tensor(x, device=dev, dtype="float32"), ndl.Tensor(y, device=dev,
                                                                     dtype="float32"))
            for x, y in batches]
    return model, opt, data


def step_for(model, opt):
    loss_fn = nn.SoftmaxLoss()

    def train_step(x, y):
        opt.reset_grad()
        out = model(x)
        if isinstance(out, tuple):
            out = out[0]
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        return loss

    return train_step


def train(kind, dev, compiled):
    np.random.seed(11)  # weights
    model, opt, data = make(kind, dev)
    model.train()
    step = step_for(model, opt)
    if compiled:
        step = ndl.compile(step)
    np.random.seed(3)  # dropout masks
    losses = [step(x, y) for x, y in data]
    return ([p.numpy() for p in model.parameters()], [float(l.numpy()) for l in losses],
            step)


@pytest.mark.parametrize("kind", ["mlp", "mlp_checkpoint", "resnet9", "lstm", "transformer"])
def test_replayed_steps_equal_eager_steps_bitwise(kind, dev):
    eager_params, eager_losses, _ = train(kind, dev, compiled=False)
    params, losses, step = train(kind, dev, compiled=True)
    stats = step.stats()
    steps = len(losses)
    assert stats["traces"] == 1 and stats["divergences"] == 0
    assert stats["replays"] == steps - 2  # warm-up and trace run eagerly
    assert losses == eager_losses
    for got, want in zip(params, eager_params, strict=True):
        np.testing.assert_array_equal(got, want)
    assert len({round(x, 6) for x in losses}) == steps  # the model actually trained


def test_dropout_draws_fresh_masks_on_every_replay(dev):
    x = ndl.Tensor(np.ones((64, 64)), device=dev)
    drop = nn.Dropout(0.5)
    step = ndl.compile(lambda a: drop(a) * 1.0)
    masks = [step(x).numpy() != 0 for _ in range(5)]
    assert step.stats()["replays"] == 3
    for i in range(5):
        for j in range(i + 1, 5):
            assert (masks[i] != masks[j]).any()
