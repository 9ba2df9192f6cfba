"""The fused softmax cross-entropy op and nn.SoftmaxLoss on it: against NumPy, numerical
gradients, the composed loss (kernels off) and PyTorch; label and shape refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import needle.ops as ops
from needle import nn
from needle._core.errors import IndexOutOfRange, NeedleError, ShapeError
from needle.autograd import Tensor, gradcheck
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")


def T(a, device, dtype="float64", requires_grad=True):
    return Tensor(np.asarray(a), device=device, dtype=dtype, requires_grad=requires_grad)


def _case(rng, n, k, spread):
    return rng.standard_normal((n, k)) * spread, rng.integers(0, k, n).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n,k,spread", [(5, 3, 1.0), (7, 40, 30.0), (1, 1, 1.0)])
def test_values_and_gradient_match_numpy(device, dtype, n, k, spread):
    rng = np.random.default_rng(n * k)
    z0, y0 = _case(rng, n, k, spread)
    g = rng.standard_normal(n)
    z = T(z0, device, dtype)
    loss = ops.softmax_cross_entropy(z, T(y0, device, dtype, False))
    (loss * T(g, device, dtype, False)).sum().backward()
    lse = np.log(np.exp(z0 - z0.max(axis=1, keepdims=True)).sum(axis=1)) + z0.max(axis=1)
    rows = np.arange(n), y0.astype(int)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(loss.numpy(), lse - z0[rows], rtol=tol, atol=tol * spread)
    soft = np.exp(z0 - lse[:, None])
    soft[rows] -= 1
    np.testing.assert_allclose(z.grad.numpy(), soft * g[:, None], rtol=tol * 10, atol=tol)


def test_numerical_gradient_and_both_rules_agree(device):
    rng = np.random.default_rng(1)
    z0, y0 = _case(rng, 4, 5, 2.0)
    labels = T(y0, device, requires_grad=False)
    assert gradcheck(lambda z: ops.softmax_cross_entropy(z, labels), T(z0, device))
    grads = []
    for create in (False, True):
        z = T(z0, device)
        (ops.softmax_cross_entropy(z, labels) * T(np.arange(1.0, 5.0), device, requires_grad=False)
         ).sum().backward(create_graph=create)
        grads.append(z.grad.numpy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_softmax_loss_fused_equals_composed_and_pytorch(device, monkeypatch):
    rng = np.random.default_rng(2)
    z0, y0 = _case(rng, 16, 10, 3.0)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(ops, "softmax_xent_has_kernel", lambda z: False)
        z = T(z0, device, "float32")
        loss = nn.SoftmaxLoss()(z, T(y0, device, "float32", False))
        loss.backward()
        results.append((loss.numpy(), z.grad.numpy()))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)
    tz = torch.tensor(z0, dtype=torch.float32, requires_grad=True)
    tl = torch.nn.functional.cross_entropy(tz, torch.tensor(y0, dtype=torch.long))
    tl.backward()
    np.testing.assert_allclose(results[0][0], tl.item(), rtol=1e-6)
    np.testing.assert_allclose(results[0][1], tz.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_fused_loss_records_one_node_and_builds_no_one_hot(device):
    z = T(np.zeros((6, 50)), device, "float32")
    if not ops.softmax_xent_has_kernel(z):
        pytest.skip("device without the softmax cross-entropy kernels (composed ops)")
    uploads = []
    original = device.mod.from_numpy
    device.__dict__["from_numpy"] = lambda src, out: (uploads.append(src.size),
                                                      original(src, out))[1]
    try:
        y = T(np.arange(6.0), device, "float32", False)
        uploads.clear()
        loss = nn.SoftmaxLoss()(z, y)
    finally:
        device.__dict__.pop("from_numpy", None)
    assert 6 * 50 not in uploads  # no (n, k) one-hot made on the host and copied over
    # one node: the per-row losses and their mean
    assert isinstance(loss.op, ops.SoftmaxCrossEntropy) and loss.op.mean
    assert loss.inputs[0] is z and loss.inputs[1] is y


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_bad_labels_raise_index_out_of_range(device, fused, monkeypatch):
    if not fused:
        monkeypatch.setattr(ops, "softmax_xent_has_kernel", lambda z: False)
    z = T(np.zeros((3, 4)), device, "float32")
    # at the call, or (cuda(): the check waits for the device) at the next copy to the host
    for bad in (4.0, -1.0, 2.5):
        y = T(np.array([0.0, bad, 1.0]), device, "float32", False)
        with pytest.raises(IndexOutOfRange):
            nn.SoftmaxLoss()(z, y).numpy()
    with pytest.raises(IndexOutOfRange, match="at row 1, expected an integer in \\[0, 4\\)"):
        ops.softmax_cross_entropy(z, T(np.array([0.0, 9.0, 1.0]), device, "float32",
                                       False)).numpy()


def test_bad_shapes_are_refused(device):
    z = T(np.zeros((3, 4)), device)
    with pytest.raises(ShapeError, match="one label per row, shape \\(3,\\), got \\(2,\\)"):
        ops.softmax_cross_entropy(z, T(np.zeros(2), device, requires_grad=False))
    with pytest.raises(ShapeError, match="logits must be \\(batch, classes\\)"):
        ops.softmax_cross_entropy(T(np.zeros(3), device), T(np.zeros(3), device))


def test_a_cuda_step_copies_nothing_to_the_host_for_its_labels(emulated_cuda, monkeypatch):
    """On cuda() the label check waits for the next synchronisation (a copy to the host at
    the launch would stall the device queue twice per step): a loss forward and backward
    with the fused kernels copy nothing to the host, and a bad label raises from the next
    copy, naming the op and the row."""
    from needle.backend_ndarray import ndarray_backend_cuda as B

    B.check_pending()  # nothing of earlier tests left
    copies = []
    real = B.to_numpy
    monkeypatch.setattr(B, "to_numpy", lambda *a: copies.append(a) or real(*a))
    rng = np.random.default_rng(0)
    z0 = rng.standard_normal((4, 3))
    z = T(z0, emulated_cuda, "float32")
    loss = nn.SoftmaxLoss()(z, T([0.0, 2.0, 1.0, 2.0], emulated_cuda, "float32", False))
    loss.backward()
    assert copies == [] and B.pending_checks() == 2  # forward and backward each deferred
    lse = np.log(np.exp(z0).sum(axis=1))
    np.testing.assert_allclose(loss.numpy(), np.mean(lse - z0[range(4), [0, 2, 1, 2]]),
                               rtol=1e-5)
    assert B.pending_checks() == 0
    bad = nn.SoftmaxLoss()(z, T([0.0, 3.0, 1.0, 2.0], emulated_cuda, "float32", False))
    with pytest.raises(IndexOutOfRange, match="softmax_xent_forward: class label out of range "
                                              "at row 1, expected an integer in \\[0, 3\\), "
                                              "got 3.0"):
        bad.numpy()
    assert np.isnan(bad.numpy())  # the kernel's NaN for the bad row, checked once


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mean_reduction_is_bitwise_the_composed_mean(device, dtype):
    """reduction="mean" (nn.SoftmaxLoss's one node) runs the kernels of
    summation(rows) / n forward and of their gradients backward: the same bits."""
    rng = np.random.default_rng(3)
    z0, y0 = rng.standard_normal((9, 6)) * 4, rng.integers(0, 6, 9).astype(np.float64)
    results = []
    for one_node in (True, False):
        z, y = T(z0, device, dtype), T(y0, device, dtype, False)
        if one_node:
            loss = ops.softmax_cross_entropy(z, y, reduction="mean")
        else:
            loss = ops.summation(ops.softmax_cross_entropy(z, y)) / 9
        loss.backward()
        results.append((loss.numpy(), z.grad.numpy()))
    assert results[0][0].shape == ()
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_unknown_reduction_is_refused(device):
    z = T(np.zeros((2, 3)), device)
    with pytest.raises(NeedleError, match="unknown reduction, expected 'none' or 'mean', "
                                          "got 'sum'"):
        ops.softmax_cross_entropy(z, T([0.0, 1.0], device, requires_grad=False), "sum")
