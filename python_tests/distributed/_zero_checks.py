"""ZeRO checks shared by the thread tests and the multi-process script.

The reference is DDP with the same optimizer on the same data (DDP itself is checked against
NumPy backprop in _ddp_checks.py), and the expected bytes come from the memory ledger.
"""
from __future__ import annotations

import threading

import numpy as np

import needle.distributed as dist
from needle import amp, nn, optim
from needle.autograd import Tensor

_BUILD = threading.Lock()  # NumPy's global generator is shared by thread ranks
STEPS, BATCH, IN, CLASSES = 3, 12, 7, 5


def build_model(device=None, dtype="float32", seed=0):
    """Odd sizes on purpose: no parameter divides evenly over 2 or 4 ranks, and the last
    bias has fewer elements than 4 ranks have pieces... almost (5 over 4)."""
    with _BUILD:
        np.random.seed(seed)
        return nn.Sequential(nn.Linear(IN, 13, device=device, dtype=dtype),
                             nn.BatchNorm1d(13, device=device, dtype=dtype), nn.ReLU(),
                             nn.Linear(13, CLASSES, device=device, dtype=dtype))


def float64_mlp():
    return nn.Sequential(nn.Linear(5, 7, dtype="float64"), nn.ReLU(),
                         nn.Linear(7, 3, dtype="float64"))


def data(step: int, rank: int, world: int, dtype="float32"):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((BATCH, IN))
    y = rng.integers(0, CLASSES, BATCH)
    lo, hi = BATCH * rank // world, BATCH * (rank + 1) // world
    return x[lo:hi].astype(dtype), y[lo:hi]


def make_optimizer(kind: str):
    if kind == "adam":
        return lambda params: optim.Adam(params, lr=0.01, weight_decay=0.01)
    return lambda params: optim.SGD(params, lr=0.1, momentum=0.9)


def train(rank: int, world: int, mode: str, stage: int = 0, kind: str = "adam",
          dtype: str = "float32", device=None, steps: int = STEPS, bucket_cap_mb=1e-4):
    """``steps`` steps of DDP (``mode="ddp"``) or ZeRO; returns the whole parameters."""
    model = build_model(device, dtype)
    if mode == "ddp":
        wrapper = dist.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        opt = wrapper.wrap_optimizer(make_optimizer(kind)(model.parameters()))
    else:
        wrapper = dist.ZeroDataParallel(model, optimizer=make_optimizer(kind), stage=stage,
                                        bucket_cap_mb=bucket_cap_mb)
        opt = wrapper.optimizer
    for step in range(steps):
        x, y = data(step, rank, world, dtype)
        opt.reset_grad()
        logits = wrapper(Tensor(x, device=device, dtype=dtype, requires_grad=False))
        nn.SoftmaxLoss()(logits, Tensor(y, device=device, requires_grad=False)).backward()
        opt.step()
    if mode == "ddp":
        return [p.numpy() for p in model.parameters()]
    return wrapper.full_parameters()


def check_matches_ddp(rank: int, world: int, stage: int) -> None:
    """Multi-process version: the reference runs in the same process, after ZeRO."""
    got = train(rank, world, "zero", stage, kind="sgd")
    want = train(rank, world, "ddp", kind="sgd")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def mixed_zero_step(rank: int, world: int, stage: int, overflow_rank: int | None):
    """Two mixed-precision steps with a GradScaler; in the second, ``overflow_rank`` plants an
    Inf in one element of its last bias gradient, an element whose reduced piece lives on
    rank 0 only (so every other rank must learn of it from rank 0). Returns per step (ran,
    scale, params before, after, optimizer state)."""
    model = amp.cast_parameters(build_model())
    planting = [False]

    def plant(grad):
        if not planting[0]:
            return None
        values = grad.numpy().copy()
        values.flat[0] = np.inf
        return Tensor(values, device=grad.device, dtype=grad.dtype, requires_grad=False)

    model.modules[-1].bias.register_hook(plant)
    zero = dist.ZeroDataParallel(model, optimizer=make_optimizer("adam"), stage=stage,
                                 bucket_cap_mb=1e-4)
    scaler = amp.GradScaler(init_scale=2.0 ** 8)
    results = []
    for step in range(2):
        x, y = data(step, rank, world)
        before = zero.full_parameters()
        zero.optimizer.reset_grad()
        with amp.autocast():
            loss = nn.SoftmaxLoss()(zero(Tensor(x, requires_grad=False)),
                                    Tensor(y, requires_grad=False))
        planting[0] = step == 1 and rank == overflow_rank
        scaler.scale(loss).backward()
        ran = scaler.step(zero.optimizer)
        scaler.update()
        results.append((ran, scaler.get_scale(), before, zero.full_parameters(),
                        zero.inner.state_dict()))
    return results
