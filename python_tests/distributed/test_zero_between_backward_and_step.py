"""ZeroDataParallel between a backward and the step, on thread ranks.

Pinned: two synchronized backwards before one step (``finish_gradient_sync()`` after the
first) add their reduced gradients in stages 2 and 3 (the other tests accumulate only under
``no_sync()``; stage 1 does not yet: an expected failure), checked against NumPy backprop
of a linear network; and stage 3 frees a unit's gathered weights as soon as its last gradient is
final, during the backward, not only when the step releases everything.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle.distributed as dist
from needle import nn, optim
from needle._core.errors import ReleasedDataError
from needle.autograd import Tensor

from . import _zero_checks as zc

WORLD, LR = 2, 0.5
SIZES = (3, 4, 2)


def _linear_net():
    with zc._BUILD:
        np.random.seed(3)
        return nn.Sequential(*[nn.Linear(a, b, dtype="float64")
                               for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)])


def _batch(backward: int, rank: int) -> np.ndarray:
    """Different data on every rank and in every backward (3 examples each)."""
    return np.random.default_rng(10 * backward + rank).standard_normal((3, SIZES[0]))


def _numpy_grads(params: list, x: np.ndarray) -> list:
    """Gradients of sum(y * y) / len(x) for y = (x W1 + b1) W2 + b2, by hand."""
    w1, b1, w2, b2 = params
    h = x @ w1 + b1
    dy = 2 * (h @ w2 + b2) / len(x)
    dh = dy @ w2.T
    return [x.T @ dh, dh.sum(0, keepdims=True), h.T @ dy, dy.sum(0, keepdims=True)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_synced_backwards_before_one_step_add_up(stage):
    def job(rank):
        model = _linear_net()
        zero = dist.ZeroDataParallel(model, optimizer=lambda ps: optim.SGD(ps, lr=LR),
                                     stage=stage, bucket_cap_mb=1e-4)
        before = zero.full_parameters()
        for k in range(2):  # no no_sync(): each backward reduces its gradients
            out = zero(Tensor(_batch(k, rank), dtype="float64", requires_grad=False))
            ((out * out).sum() / 3).backward()
            if k == 0:
                zero.finish_gradient_sync()  # the first backward's pieces are in place
        zero.step()
        after = zero.full_parameters()
        zero.close()
        return before, after

    results = dist.spawn_threads(job, WORLD, timeout=60)
    before = results[0][0]
    # each backward's reduced gradient is the mean over the ranks; the two add up
    total = [sum(np.mean([_numpy_grads(before, _batch(k, r))[i] for r in range(WORLD)], 0)
                 for k in range(2)) for i in range(len(before))]
    for _, after in results:
        for got, w, g in zip(after, before, total, strict=True):
            np.testing.assert_allclose(got, w - LR * g, rtol=1e-10, atol=1e-12)


def test_stage3_frees_each_unit_when_its_last_gradient_is_final():
    """Three units: when the backward reaches a unit, the units after it (their gradients
    final) are already sharded again; after the backward, before the step, all are."""
    def job(rank):
        with zc._BUILD:
            np.random.seed(4)
            model = nn.Sequential(nn.Linear(3, 4, dtype="float64"),
                                  nn.Linear(4, 5, dtype="float64"),
                                  nn.Linear(5, 2, dtype="float64"))
        zero = dist.ZeroDataParallel(model, optimizer=lambda ps: optim.SGD(ps, lr=LR),
                                     stage=3, prefetch=False)
        units = zero.units.units
        seen = []
        for k, unit in enumerate(units):
            inner = unit.original_forward

            def spy(*args, _k=k, _inner=inner):
                out = _inner(*args)
                out.register_hook(lambda g: seen.append((_k, [u.state for u in units])))
                return out

            unit.original_forward = spy
        out = zero(Tensor(_batch(0, rank), dtype="float64", requires_grad=False))
        (out * out).sum().backward()
        between = [u.state for u in units]
        released = []
        for p in model.parameters():
            try:
                p.numpy()
            except ReleasedDataError:
                released.append(True)
        zero.step()
        zero.close()
        return seen, between, len(released)

    for seen, between, released in dist.spawn_threads(job, WORLD, timeout=60):
        at = dict(seen)  # unit k -> every unit's state when the gradient of k's output is done
        assert sorted(at) == [0, 1, 2]
        assert at[1][2] == "sharded"                    # unit 2's gradients were final
        assert at[0][1:] == ["sharded", "sharded"]      # units 1 and 2 likewise
        assert between == ["sharded"] * 3               # before the step
        assert released == 6                            # no weight readable in between
