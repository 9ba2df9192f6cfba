"""``Optimizer.grads_finite`` (what ``amp.GradScaler`` asks before a step) and
``Optimizer.set_grad_scale`` (the scale the next steps divide gradients by)."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle import optim

OPTIMIZERS = [lambda ps: optim.SGD(ps, lr=0.1), lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
              lambda ps: optim.Adam(ps, lr=0.1)]


def _params(dtype: str, n: int = 3) -> list:
    return [ndl.Tensor(np.ones(4), dtype=dtype, requires_grad=True) for _ in range(n)]


def _grad(values, dtype: str):
    return ndl.Tensor(np.asarray(values, dtype="float64"), dtype=dtype)


@pytest.mark.parametrize("make", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_one_bad_element_of_one_gradient_is_found(make, dtype, bad):
    ps = _params(dtype)
    opt = make(ps)
    for p in ps:
        p.grad = _grad(np.ones(4), dtype)
    assert opt.grads_finite() is True
    ps[2].grad = _grad([1.0, 2.0, bad, 3.0], dtype)
    assert opt.grads_finite() is False
    ps[2].grad = None  # a parameter without a gradient does not count
    assert opt.grads_finite() is True


def test_no_gradient_at_all_is_finite():
    ps = _params("float32")
    assert optim.SGD(ps, lr=0.1).grads_finite() is True
    assert optim.SGD([], lr=0.1).grads_finite() is True


def test_float16_overflow_is_found_with_float32_masters_and_a_fused_history():
    ps = _params("float16")
    opt = optim.Adam(ps, lr=0.1)
    for p in ps:
        p.grad = _grad(np.ones(4), "float16")
    opt.step()  # masters made, moments made
    assert set(opt.master) == set(ps)
    with np.errstate(over="ignore"):  # past float16's range: inf, as a scaled loss makes
        ps[0].grad = _grad([70000.0, 1.0, 1.0, 1.0], "float16")
    assert opt.grads_finite() is False
    qs = _params("float32")
    sgd = optim.SGD(qs, lr=0.1)
    for q in qs:
        q.grad = _grad(np.ones(4), "float32")
    sgd.step()  # the in-place fused path and its plan
    qs[1].grad = _grad([np.nan, 1.0, 1.0, 1.0], "float32")
    assert sgd.grads_finite() is False


def test_only_its_own_parameters_count():
    mine, other = _params("float32", 1), _params("float32", 1)
    opt = optim.SGD(mine, lr=0.1)
    other[0].grad = _grad([np.inf] * 4, "float32")
    mine[0].grad = _grad(np.ones(4), "float32")
    assert opt.grads_finite() is True


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_set_grad_scale_divides_what_the_step_reads(dtype):
    p = ndl.Tensor(np.full(2, 3.0), dtype=dtype)
    opt = optim.SGD([p], lr=1.0)
    p.grad = _grad([8.0, 16.0], dtype)
    opt.set_grad_scale(8.0)
    assert opt.grad_scale == 8.0
    opt.step()
    assert p.numpy().tolist() == [2.0, 1.0]
    opt.set_grad_scale(None)
    assert opt.grad_scale is None
    opt.step()
    assert p.numpy().tolist() == [-6.0, -15.0]
