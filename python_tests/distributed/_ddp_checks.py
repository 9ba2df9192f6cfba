"""DDP checks shared by the thread tests and the multi-process script.

The expected gradients are re-derived with NumPy (manual backprop of a 2-layer MLP on the
union of all ranks' examples), never with the code under test.
"""
from __future__ import annotations

import numpy as np

import needle.distributed as dist
from needle import nn
from needle.autograd import Tensor

IN, HIDDEN, OUT = 5, 7, 3


def make_model(bucket_cap_mb: float = 25, **kw) -> dist.DistributedDataParallel:
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    return dist.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **kw)


def batch(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, IN)).astype(np.float32)


def loss_of(ddp: dist.DistributedDataParallel, x: np.ndarray, divide_by: float) -> Tensor:
    out = ddp(Tensor(x))
    return (out * out).sum() / (2.0 * divide_by)


def numpy_grads(params: list[np.ndarray], x: np.ndarray) -> list[np.ndarray]:
    """Gradients of sum(o**2) / (2 n) for o = relu(x W1 + b1) W2 + b2 over all n rows."""
    w1, b1, w2, b2 = (p.astype(np.float64) for p in params)
    h = x @ w1 + b1.reshape(1, -1)
    a = np.maximum(h, 0)
    o = a @ w2 + b2.reshape(1, -1)
    d_o = o / len(x)
    d_h = (d_o @ w2.T) * (h > 0)
    return [x.T @ d_h, d_h.sum(0).reshape(b1.shape), a.T @ d_o, d_o.sum(0).reshape(b2.shape)]


def check_grads(ddp: dist.DistributedDataParallel, union: np.ndarray) -> None:
    params = [p.numpy() for p in ddp.params]
    want = numpy_grads(params, union.astype(np.float64))
    for p, w in zip(ddp.params, want, strict=False):
        np.testing.assert_allclose(p.grad.numpy(), w, rtol=2e-4, atol=1e-5)


def check_equal_batches(rank: int, world: int) -> None:
    ddp = make_model(bucket_cap_mb=100 / 2**20)  # ~100-byte buckets: several of them
    assert len(ddp.buckets) > 1
    loss_of(ddp, batch(rank, 4), 4).backward()
    ddp.finish_gradient_sync()
    check_grads(ddp, np.concatenate([batch(r, 4) for r in range(world)]))


def check_unequal_batches(rank: int, world: int) -> None:
    sizes = [1 + 2 * r for r in range(world)]
    ddp = make_model()
    ddp.set_num_examples(sizes[rank])
    loss_of(ddp, batch(10 + rank, sizes[rank]), sizes[rank]).backward()
    ddp.finish_gradient_sync()
    check_grads(ddp, np.concatenate([batch(10 + r, sizes[r]) for r in range(world)]))


def check_no_sync_accumulation(rank: int, world: int) -> None:
    """Two micro-batches per rank (sizes differ by rank), sum losses, one sync at the end."""
    sizes = [(2, 1 + r) for r in range(world)]
    ddp = make_model(reduction="sum")
    launched = len([e for e in ddp.events if e[0] == "launch"])
    first, second = (batch(20 + 2 * rank + k, sizes[rank][k]) for k in range(2))
    with ddp.no_sync():
        loss_of(ddp, first, 1.0).backward()
    assert len([e for e in ddp.events if e[0] == "launch"]) == launched  # nothing sent yet
    loss_of(ddp, second, 1.0).backward()
    ddp.set_num_examples(sum(sizes[rank]))
    ddp.finish_gradient_sync()
    union = np.concatenate([batch(20 + 2 * r + k, sizes[r][k]) for r in range(world)
                            for k in range(2)])
    check_grads(ddp, union)


def check_overlap_order(rank: int, world: int) -> None:
    """The first bucket's all-reduce is launched before the last gradient is ready."""
    ddp = make_model(bucket_cap_mb=100 / 2**20)
    loss_of(ddp, batch(rank, 4), 4).backward()
    ddp.finish_gradient_sync()
    kinds = [(kind, idx) for kind, idx, _ in ddp.events]
    last_ready = max(i for i, (kind, _) in enumerate(kinds) if kind == "ready")
    assert kinds.index(("launch", 0)) < last_ready, kinds
    step = ddp.timeline[-1]
    assert step["buckets"][0]["launched"] < step["last_hook"]


class Branchy(nn.Module):
    """``sum(a(x))`` plus ``sum(b(x))`` only when asked: b is used in one step, not the next."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, 2)
        self.b = nn.Linear(IN, 2)

    def forward(self, x: Tensor, use_b: bool) -> Tensor:
        out = self.a(x).sum()
        return out + self.b(x).sum() if use_b else out


def check_unused_across_steps(rank: int, world: int) -> None:
    """With find_unused_parameters, a parameter used in step 1 and skipped in step 2 gets a
    zero gradient in step 2, not step 1's value left in its bucket slot."""
    ddp = dist.DistributedDataParallel(Branchy(), find_unused_parameters=True)
    xs = [batch(40 + 10 * step + rank, 3) for step in range(2)]
    for step, use_b in enumerate((True, False)):
        for p in ddp.params:
            p.grad = None
        ddp(Tensor(xs[step]), use_b).backward()
        ddp.finish_gradient_sync()
        # d sum(x W + 1 c) / dW = column sums of x for each output; mean over ranks.
        col = np.mean([batch(40 + 10 * step + r, 3).sum(0) for r in range(world)], axis=0)
        want_w, want_c = np.repeat(col.reshape(-1, 1), 2, axis=1), np.full((1, 2), 3.0)
        module = ddp.module
        np.testing.assert_allclose(module.a.weight.grad.numpy(), want_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(module.a.bias.grad.numpy(), want_c, rtol=1e-6)
        if use_b:
            np.testing.assert_allclose(module.b.weight.grad.numpy(), want_w, rtol=1e-5,
                                       atol=1e-6)
        else:
            assert not module.b.weight.grad.numpy().any(), module.b.weight.grad.numpy()
            assert not module.b.bias.grad.numpy().any(), module.b.bias.grad.numpy()


def run_all(rank: int, world: int) -> None:
    check_equal_batches(rank, world)
    check_unequal_batches(rank, world)
    check_no_sync_accumulation(rank, world)
    check_overlap_order(rank, world)
    check_unused_across_steps(rank, world)
