"""Pipeline checks shared by the thread tests and the multi-process script.

The expected loss and gradients come from NumPy (manual backprop of a ReLU MLP with a mean
softmax loss over the whole batch, in float64), never from the code under test.
"""
from __future__ import annotations

import threading
import time

import numpy as np

import needle as ndl
import needle.distributed as dist
from needle import nn
from needle.distributed import pipeline

WIDTHS = (6, 16, 16, 16, 16, 16, 16, 16, 3)  # 8 Linear layers: up to 8 pipeline chunks
_BUILD = threading.Lock()  # thread ranks share NumPy's and needle's global generators


def build_mlp(widths=WIDTHS, seed: int = 0) -> nn.Sequential:
    with _BUILD:
        np.random.seed(seed)
        ndl.random.seed(seed)
        layers: list = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
            layers += ([nn.ReLU()] if i else []) + [nn.Linear(a, b)]
        return nn.Sequential(*layers)


def data(n: int = 13, seed: int = 1, widths=WIDTHS) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    return (rng.randn(n, widths[0]).astype(np.float32),
            rng.randint(0, widths[-1], n).astype(np.uint8))


def numpy_loss_and_grads(params: list[np.ndarray], X: np.ndarray, y: np.ndarray):
    """Mean softmax cross-entropy of relu-MLP(X) and its gradients (weight, bias per layer)."""
    ws = [p.astype(np.float64) for p in params[0::2]]
    bs = [p.astype(np.float64).reshape(1, -1) for p in params[1::2]]
    acts, h = [X.astype(np.float64)], X.astype(np.float64)
    for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
        z = h @ w + b
        h = np.maximum(z, 0) if i < len(ws) - 1 else z
        acts.append(h)
    z = acts[-1]
    z = z - z.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(prob[np.arange(n), y]).mean())
    d = prob
    d[np.arange(n), y] -= 1
    d /= n
    grads: list[np.ndarray] = []
    for i in reversed(range(len(ws))):
        grads = [acts[i].T @ d, d.sum(axis=0, keepdims=True)] + grads
        d = (d @ ws[i].T) * (acts[i] > 0)
    return loss, grads


def stages_for(rank: int, world: int, model: nn.Sequential, v: int = 1,
               group=None) -> list[pipeline.PipelineStage]:
    chunks = world * v
    pieces = pipeline.split_sequential(model, chunks)
    return [pipeline.PipelineStage(pieces[s], s, chunks, group=group)
            for s in range(rank, chunks, world)]


def run_schedule(rank: int, world: int, name: str, m: int, v: int = 1, n: int = 13,
                 steps: int = 2, record: bool = False):
    """Run ``steps`` steps (gradients reset in between); returns (loss, {index: grad}, sched)."""
    model = build_mlp()
    X, y = data(n)
    stages = stages_for(rank, world, model, v)
    sched = pipeline.schedule_class(name)(stages if v > 1 else stages[0], m,
                                          loss_fn=nn.SoftmaxLoss(), record=record)
    loss = None
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        loss = sched.step(X if rank == 0 else None, y if rank == world - 1 else None)
    mine = {id(p) for s in stages for p in s.parameters()}
    grads = {i: p.grad.numpy() for i, p in enumerate(model.parameters()) if id(p) in mine}
    return loss, grads, sched


def check_schedule(rank: int, world: int, name: str, m: int, v: int = 1, n: int = 13) -> None:
    """This rank's gradients (and the last rank's loss) equal NumPy's full-batch ones."""
    loss, grads, _ = run_schedule(rank, world, name, m, v, n)
    X, y = data(n)
    want_loss, want = numpy_loss_and_grads([p.numpy() for p in build_mlp().parameters()], X, y)
    assert grads, f"rank {rank} holds no parameters"
    for i, g in grads.items():
        np.testing.assert_allclose(g, want[i], rtol=1e-4, atol=1e-6,
                                   err_msg=f"{name} p={world} m={m} v={v} parameter {i}")
    if rank == world - 1:
        assert abs(loss - want_loss) < 1e-5, (loss, want_loss)
    else:
        assert loss is None


class Boom(nn.Module):
    """Raises on its ``at``-th call: a stage that fails in the middle of a step."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("boom")
        return x


def check_failing_stage(rank: int, world: int, name: str = "1f1b") -> str:
    """Stage 1 raises in its second forward: it re-raises ValueError, every other rank raises
    CommError naming stage 1 (rank 1), long before the group's timeout."""
    model = build_mlp()
    X, y = data()
    stages = stages_for(rank, world, model)
    if rank == 1:
        stages[0].module = nn.Sequential(Boom(at=2), stages[0].module)
    sched = pipeline.schedule_class(name)(stages[0], 4, loss_fn=nn.SoftmaxLoss())
    start = time.monotonic()
    try:
        sched.step(X if rank == 0 else None, y if rank == world - 1 else None)
    except ValueError as exc:
        assert rank == 1 and str(exc) == "boom"
        return "raised"
    except dist.CommError as exc:
        assert rank != 1, exc
        text = str(exc)
        assert "stage 1 (rank 1)" in text and "ValueError: boom" in text, text
        assert time.monotonic() - start < 30, "the abort should beat the 60+ s timeout"
        return text
    raise AssertionError(f"rank {rank}: the step did not fail")


def check_missing_targets(rank: int, world: int) -> str:
    """The last stage gets no targets: ShapeError there, CommError naming it elsewhere."""
    model = build_mlp()
    X, _ = data()
    stages = stages_for(rank, world, model)
    sched = pipeline.Schedule1F1B(stages[0], 4, loss_fn=nn.SoftmaxLoss())
    try:
        sched.step(X if rank == 0 else None, None)
    except dist.CommError as exc:
        assert rank != world - 1 and f"stage {world - 1}" in str(exc), exc
        return "comm"
    except ValueError as exc:
        assert rank == world - 1 and "expected targets" in str(exc), exc
        return "shape"
    raise AssertionError("no error")


def activation_peaks(rank: int, world: int, m: int = 4, n: int = 256):
    """Measured peak activation bytes per stage of GPipe and 1F1B (rank 0), wide layers so
    that activations dominate: needs real processes (one allocator per rank)."""
    widths = (32,) + (256,) * 6 + (4,)
    X, y = data(n, widths=widths)
    peaks = {}
    for name in ("gpipe", "1f1b"):
        model = build_mlp(widths)
        stages = stages_for(rank, world, model)
        sched = pipeline.schedule_class(name)(stages[0], m, loss_fn=nn.SoftmaxLoss(),
                                              record=True)
        for _ in range(3):
            sched.step(X if rank == 0 else None, y if rank == world - 1 else None)
        report = sched.report()
        if rank == 0:
            peaks[name] = report
    return peaks
