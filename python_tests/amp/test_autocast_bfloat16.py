"""ndl.amp with bfloat16: autocast(dtype="bfloat16"), gradients through its casts, bfloat16
parameters with float32 masters, and GradScaler beside it (allowed, not needed)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from needle import amp, nn, ops, optim
from needle.autograd import Tensor

BF16 = np.dtype(ml_dtypes.bfloat16)


def _t(a, device, dtype="float32", grad=True):
    return Tensor(np.asarray(a), device=device, dtype=dtype, requires_grad=grad)


def test_autocast_bfloat16_lowers_products_and_keeps_statistics_in_float32(device):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    with amp.autocast(dtype="bfloat16"):
        out = _t(a, device) @ _t(b, device)
        total = out.sum()
    assert out.dtype == "bfloat16" and total.dtype == "float32"
    # both operands rounded to bfloat16, multiplied in float32, the product rounded once
    want = (a.astype(BF16).astype(np.float32) @ b.astype(BF16).astype(np.float32)).astype(BF16)
    np.testing.assert_allclose(out.numpy().astype(np.float32), want.astype(np.float32),
                               rtol=2 ** -7, atol=1e-6)


def _loss(w, x, c):
    y = ops.tanh(x @ w)  # the product in bfloat16, tanh in its argument's dtype
    return (y * y * c).sum()


def test_gradient_through_bfloat16_autocast_matches_central_differences(device):
    """The float32 weight's gradient, computed through the bfloat16 casts, against central
    differences of the same function in float64 (tolerance: bfloat16's 8-bit precision)."""
    rng = np.random.default_rng(1)
    w0, x0, c0 = rng.uniform(-0.5, 0.5, (4, 3)), rng.uniform(-1, 1, (6, 4)), rng.uniform(
        0.5, 1.5, (6, 3))
    w = _t(w0, device)
    with amp.autocast(dtype="bfloat16"):
        loss = _loss(w, _t(x0, device, grad=False), _t(c0, device, grad=False))
    loss.backward()
    assert w.grad.dtype == "float32"

    def f(wv):
        return float(np.sum(np.tanh(x0 @ wv) ** 2 * c0))

    numeric = np.zeros_like(w0)
    for idx in np.ndindex(*w0.shape):
        step = np.zeros_like(w0)
        step[idx] = 1e-4
        numeric[idx] = (f(w0 + step) - f(w0 - step)) / 2e-4
    np.testing.assert_allclose(w.grad.numpy(), numeric, rtol=0.05,
                               atol=0.03 * np.abs(numeric).max())


def test_bfloat16_parameters_train_through_float32_masters(device):
    """cast_parameters(..., "bfloat16"): the optimizer updates a float32 master and rounds it
    into the parameter; updates far below bfloat16's resolution still accumulate."""
    p = _t(np.ones(4), device, dtype="bfloat16")
    opt = optim.SGD([p], lr=1.0)
    for _ in range(64):  # 64 updates of 2^-12: each alone is lost in bfloat16 (ulp at 1: 2^-7)
        p.grad = _t(np.full(4, -2.0 ** -12), device, dtype="bfloat16", grad=False)
        opt.step()
    assert p.dtype == "bfloat16" and opt.master[p].dtype == "float32"
    np.testing.assert_array_equal(opt.master[p].numpy(), np.full(4, 1 + 64 * 2.0 ** -12))
    np.testing.assert_array_equal(p.numpy().astype(np.float32), np.full(4, 1.015625))


def test_a_small_model_trains_in_bfloat16_mixed_with_or_without_a_scaler(device):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)
    for scaler in (amp.GradScaler(enabled=False), amp.GradScaler(init_scale=2.0 ** 8)):
        np.random.seed(0)
        model = amp.cast_parameters(nn.Sequential(nn.Linear(6, 16, device=device), nn.ReLU(),
                                                  nn.Linear(16, 2, device=device)), "bfloat16")
        opt = optim.Adam(model.parameters(), lr=0.05)
        losses = []
        for _ in range(15):
            opt.reset_grad()
            with amp.autocast(dtype="bfloat16"):
                loss = nn.SoftmaxLoss()(model(_t(x, device, grad=False)),
                                        _t(y, device, grad=False))
            scaler.scale(loss).backward()
            assert scaler.step(opt)
            scaler.update()
            losses.append(float(loss.numpy()))
        assert model.parameters()[0].dtype == "bfloat16"
        assert losses[-1] < 0.5 * losses[0], losses
