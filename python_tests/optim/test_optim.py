"""Optimisers against hand-written NumPy updates (the course's SGD/Adam formulas)."""
from __future__ import annotations

import numpy as np
import pytest

from needle import nn, optim
from needle._core.errors import NeedleError, ShapeError
from needle.autograd import Tensor


def _param(value, device, dtype="float32"):
    return nn.Parameter(Tensor(np.asarray(value), device=device, dtype=dtype))


def _set_grad(p, g):
    p.grad = Tensor(np.asarray(g), device=p.device, dtype=p.dtype, requires_grad=False)


def _run(opt_factory, device, steps=4, dtype="float32"):
    """Apply ``steps`` updates with fixed pseudo-random gradients; return params, grads."""
    rng = np.random.default_rng(0)
    ps = [_param(rng.standard_normal((3, 2)), device, dtype),
          _param(rng.standard_normal(4), device, dtype)]
    opt = opt_factory(ps)
    grads = [[rng.standard_normal(p.shape) for p in ps] for _ in range(steps)]
    start = [p.numpy().astype(np.float64) for p in ps]
    for gs in grads:
        for p, g in zip(ps, gs, strict=False):
            _set_grad(p, g)
        opt.step()
    return ps, start, grads, opt


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.1)])
def test_sgd_formula(device, momentum, wd):
    ps, start, grads, _ = _run(lambda p: optim.SGD(p, lr=0.1, momentum=momentum,
                                                   weight_decay=wd), device)
    for k, theta in enumerate(start):
        u = np.zeros_like(theta)
        for gs in grads:
            g = gs[k] + wd * theta
            u = momentum * u + (1 - momentum) * g
            theta = theta - 0.1 * u
        np.testing.assert_allclose(ps[k].numpy(), theta, rtol=1e-5, atol=1e-6)
        assert ps[k].dtype == "float32"


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_adam_formula(device, wd):
    b1, b2, eps, lr = 0.8, 0.95, 1e-8, 0.05
    ps, start, grads, opt = _run(lambda p: optim.Adam(p, lr=lr, beta1=b1, beta2=b2, eps=eps,
                                                      weight_decay=wd), device)
    assert opt.t == len(grads)
    for k, theta in enumerate(start):
        m = v = np.zeros_like(theta)
        for t, gs in enumerate(grads, start=1):
            g = gs[k] + wd * theta
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            theta = theta - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        np.testing.assert_allclose(ps[k].numpy(), theta, rtol=1e-4, atol=1e-5)


def test_step_keeps_grad_dtype_and_skips_missing_grads(device):
    p, q = _param(np.ones(3), device), _param(np.ones(2) * 5, device, "float64")
    opt = optim.SGD([p, q], lr=0.5, weight_decay=0.1)
    _set_grad(q, [1.0, 2.0])
    grad_before = q.grad.numpy().copy()
    grad_obj = q.grad
    opt.step()
    np.testing.assert_array_equal(p.numpy(), np.ones(3))  # no grad: untouched
    assert q.dtype == "float64" and q.grad is grad_obj
    np.testing.assert_array_equal(q.grad.numpy(), grad_before)  # grad not modified in place
    np.testing.assert_allclose(q.numpy(), 5 - 0.5 * (grad_before + 0.5))
    opt.reset_grad()
    assert q.grad is None and p.grad is None


def test_state_dict_resume_matches_uninterrupted(device):
    ps_a, _, _, _ = _run(lambda p: optim.Adam(p, lr=0.01), device, steps=4)
    # Same run split in two: 2 steps, save, restore into a fresh optimiser, 2 more steps.
    rng = np.random.default_rng(0)
    ps = [_param(rng.standard_normal((3, 2)), device), _param(rng.standard_normal(4), device)]
    grads = [[rng.standard_normal(p.shape) for p in ps] for _ in range(4)]
    opt = optim.Adam(ps, lr=0.01)
    for gs in grads[:2]:
        for p, g in zip(ps, gs, strict=False):
            _set_grad(p, g)
        opt.step()
    state = opt.state_dict()
    opt2 = optim.Adam(ps, lr=0.5)
    opt2.load_state_dict(state)
    assert opt2.t == 2 and opt2.lr == 0.01
    for gs in grads[2:]:
        for p, g in zip(ps, gs, strict=False):
            _set_grad(p, g)
        opt2.step()
    for a, b in zip(ps_a, ps, strict=False):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
    with pytest.raises(NeedleError, match="type"):
        optim.SGD(ps).load_state_dict(state)
    bad = {**state, "state": {"m": {0: np.zeros(7)}, "v": {}}}
    with pytest.raises(ShapeError):
        optim.Adam(ps).load_state_dict(bad)


def test_sgd_momentum_state_roundtrip(device):
    ps, _, _, opt = _run(lambda p: optim.SGD(p, lr=0.1, momentum=0.9), device, steps=2)
    state = opt.state_dict()
    assert set(state["state"]["u"]) == {0, 1}
    opt2 = optim.SGD(ps, lr=0.1, momentum=0.9)
    opt2.load_state_dict(state)
    np.testing.assert_array_equal(opt2.u[ps[1]].numpy() if hasattr(opt2.u[ps[1]], "numpy")
                                  else opt2.u[ps[1]], state["state"]["u"][1])


def test_clip_grad_norm(device):
    p, q = _param(np.zeros(3), device), _param(np.zeros(2), device)
    g1, g2 = np.array([3.0, 0.0, 4.0]), np.array([12.0, 0.0])
    _set_grad(p, g1)
    _set_grad(q, g2)
    old = p.grad
    opt = optim.SGD([p, q], lr=1.0)
    norm = opt.clip_grad_norm(max_norm=1.3)
    assert norm == pytest.approx(13.0)
    scale = 1.3 / (13.0 + 1e-6)
    np.testing.assert_allclose(p.grad.numpy(), g1 * scale, rtol=1e-6)
    np.testing.assert_allclose(q.grad.numpy(), g2 * scale, rtol=1e-6)
    np.testing.assert_array_equal(old.numpy(), g1)  # replaced, not modified in place
    assert optim.clip_grad_norm([p, q], max_norm=100.0) == pytest.approx(1.3, rel=1e-5)
    np.testing.assert_allclose(p.grad.numpy(), g1 * scale, rtol=1e-6)  # under the limit


def test_training_reduces_loss_without_leaking_graphs(device):
    import needle.autograd as ag

    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 8, device=device), nn.ReLU(),
                          nn.Linear(8, 3, device=device))
    x = Tensor(np.random.randn(32, 4), device=device)
    y = Tensor(np.random.randint(0, 3, 32), device=device)
    opt = optim.Adam(model.parameters(), lr=0.05)
    losses, counts = [], []
    for _ in range(30):
        loss = nn.SoftmaxLoss()(model(x), y)
        opt.reset_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.numpy()))
        counts.append(ag.TENSOR_COUNTER)
    assert losses[-1] < 0.7 * losses[0]
    assert counts[-1] - counts[5] < 50  # state is detached: no growth per step


def test_wider_gradient_does_not_widen_the_parameter():
    import needle.backend_ndarray as nd

    dev = nd.cpu_numpy()
    p = _param(np.ones(3), dev)
    p.grad = Tensor(np.array([1.0, 2.0, 3.0]), device=dev, dtype="float64")
    optim.Adam([p], lr=0.1).step()
    assert p.dtype == "float32"
    optim.SGD([p], lr=0.1, momentum=0.5).step()
    assert p.dtype == "float32"
