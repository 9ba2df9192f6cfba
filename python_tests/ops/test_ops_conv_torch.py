"""conv forward and both gradients against PyTorch (NCHW <-> NHWC), as the course checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch  # part of the [test] extra: a missing torch must fail, not skip

import needle.ops as ops
from needle.autograd import Tensor
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")


@pytest.mark.parametrize("n, h, cin, cout, k, stride, padding", [
    (2, 8, 3, 4, 3, 1, 1), (2, 9, 3, 5, 3, 2, 1), (1, 8, 2, 3, 5, 2, 2), (2, 6, 4, 2, 1, 1, 0),
    (1, 7, 3, 2, 3, 2, 0)])
def test_conv_matches_torch(device, n, h, cin, cout, k, stride, padding):
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((n, h, h, cin)).astype(np.float32)
    w_np = rng.standard_normal((k, k, cin, cout)).astype(np.float32)
    x, w = Tensor(x_np, device=device), Tensor(w_np, device=device)
    y = ops.conv(x, w, stride=stride, padding=padding)
    (y * y).sum().backward()

    xt = torch.tensor(x_np.transpose(0, 3, 1, 2), requires_grad=True)
    wt = torch.tensor(w_np.transpose(3, 2, 0, 1), requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, stride=stride, padding=padding)
    (yt * yt).sum().backward()

    np.testing.assert_allclose(y.numpy(), yt.detach().numpy().transpose(0, 2, 3, 1),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy().transpose(0, 2, 3, 1),
                               rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(w.grad.numpy(), wt.grad.numpy().transpose(2, 3, 1, 0),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("stride", [1, 2])
def test_nchw_layout_matches_torch_with_bias(device, stride):
    """``layout="NCHW"`` (nn.Conv's one node): NCHW in and out, the same values and
    gradients as PyTorch's conv2d, whose layout it is."""
    rng = np.random.default_rng(1)
    x_np = rng.standard_normal((2, 4, 7, 7)).astype(np.float32)
    w_np = rng.standard_normal((3, 3, 4, 5)).astype(np.float32)
    b_np = rng.standard_normal(5).astype(np.float32)
    x, w, b = (Tensor(a, device=device) for a in (x_np, w_np, b_np))
    y = ops.conv(x, w, stride=stride, padding=1, bias=b, layout="NCHW")
    (y * y).sum().backward()
    xt, bt = torch.tensor(x_np, requires_grad=True), torch.tensor(b_np, requires_grad=True)
    wt = torch.tensor(w_np.transpose(3, 2, 0, 1), requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride=stride, padding=1)
    (yt * yt).sum().backward()
    assert y.shape == tuple(yt.shape)
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy(), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(w.grad.numpy(), wt.grad.numpy().transpose(2, 3, 1, 0),
                               rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(b.grad.numpy(), bt.grad.numpy(), rtol=1e-3, atol=1e-3)


def test_conv_layout_refusals(device):
    from needle._core.errors import ShapeError

    w = Tensor(np.ones((3, 3, 2, 1), np.float32), device=device)
    with pytest.raises(ValueError, match="conv: expected layout 'NHWC' or 'NCHW', got 'CHW'"):
        ops.conv(Tensor(np.ones((1, 2, 4, 4), np.float32), device=device), w, layout="CHW")
    with pytest.raises(ShapeError, match=r"conv: expected a 4-D NCHW input, got \(2, 4, 4\)"):
        ops.conv(Tensor(np.ones((2, 4, 4), np.float32), device=device), w, layout="NCHW")
    # NCHW channels are axis 1; the message shows the shape as given
    with pytest.raises(ShapeError, match=r"channels differ.*got 4 \(input \(1, 4, 4, 2\)\)"):
        ops.conv(Tensor(np.ones((1, 4, 4, 2), np.float32), device=device), w, layout="NCHW")
