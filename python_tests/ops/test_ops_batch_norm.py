"""The fused batch-norm op and the BatchNorm modules that use it: against NumPy formulas,
numerical gradients, the composed (unfused) modules and PyTorch; layouts (NCHW compact,
channels-last views of a convolution output, sliced views) and refusals."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import needle.ops as ops
from needle import nn
from needle._core.errors import ShapeError
from needle.autograd import Tensor, gradcheck
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")


def T(a, device, dtype="float64", requires_grad=True):
    return Tensor(np.asarray(a), device=device, dtype=dtype, requires_grad=requires_grad)


def _reference(x, w, b, g, eps):
    """Forward and gradients of training-mode batch norm over axis 1, in float64 NumPy."""
    axes = (0,) + tuple(range(2, x.ndim))
    per = (1, -1) + (1,) * (x.ndim - 2)
    count = x.size // x.shape[1]
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    xhat = (x - mean.reshape(per)) / np.sqrt(var.reshape(per) + eps)
    y = w.reshape(per) * xhat + b.reshape(per)
    db, dw = g.sum(axis=axes), (g * xhat).sum(axis=axes)
    dx = (w / np.sqrt(var + eps)).reshape(per) / count * (
        count * g - db.reshape(per) - xhat * dw.reshape(per))
    return y, mean, var, dx, dw, db


def _layouts(rng, shape):
    """The same values as a compact array, as a channels-last view (an NHWC buffer seen as
    NCHW, what a convolution returns) and as a sliced (non-dense) view."""
    x = rng.standard_normal(shape) * 3 + 2
    yield "compact", x, lambda t: t
    if len(shape) == 4:
        n, c, h, w = shape
        nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
        yield "channels-last", nhwc, lambda t: ops.transpose(ops.transpose(t, (2, 3)), (1, 2))
    wide = np.concatenate([x, x[:1] * 0 + 99.0], axis=0)
    yield "sliced", wide, lambda t: ops.get_item(t, (slice(0, shape[0]),))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(6, 5), (1, 3), (4, 3, 5, 6), (2, 16, 4, 4)])
def test_batch_norm_matches_numpy_on_every_layout(device, dtype, shape):
    rng = np.random.default_rng(len(shape) * 10 + shape[1])
    c = shape[1]
    w, b, g = rng.standard_normal(c), rng.standard_normal(c), rng.standard_normal(shape)
    tol = 2e-5 if dtype == "float32" else 1e-10
    for name, data, view in _layouts(rng, shape):
        x = T(data, device, dtype)
        xv = view(x)
        assert xv.shape == shape, name
        y, mean, var = ops.batch_norm(xv, T(w, device, dtype), T(b, device, dtype), eps=1e-5)
        want = _reference(xv.numpy().astype(np.float64), w, b, g, 1e-5)
        scale = np.abs(want[0]).max()
        np.testing.assert_allclose(y.numpy(), want[0], rtol=tol, atol=tol * scale, err_msg=name)
        np.testing.assert_allclose(mean.numpy(), want[1], rtol=tol, atol=tol * 5, err_msg=name)
        np.testing.assert_allclose(var.numpy(), want[2], rtol=tol * 10, atol=tol, err_msg=name)
        wt, bt = T(w, device, dtype), T(b, device, dtype)
        out = ops.batch_norm(view(x), wt, bt, eps=1e-5)[0]
        (out * T(g, device, dtype, False)).sum().backward()
        dx = x.grad.numpy()
        if name == "channels-last":
            dx = dx.transpose(0, 3, 1, 2)
        elif name == "sliced":
            assert np.all(dx[shape[0]:] == 0), "no gradient reaches the unused rows"
            dx = dx[:shape[0]]
        count = np.prod(shape) // c
        gscale = count * np.abs(g).max()
        np.testing.assert_allclose(dx, want[3], rtol=tol * 10, atol=tol * 10 * gscale,
                                   err_msg=name)
        np.testing.assert_allclose(wt.grad.numpy(), want[4], rtol=tol * 10,
                                   atol=tol * 10 * gscale, err_msg=name)
        np.testing.assert_allclose(bt.grad.numpy(), want[5], rtol=tol * 10,
                                   atol=tol * 10 * gscale, err_msg=name)


def test_channels_last_input_gives_channels_last_output_without_copies(device):
    """An NCHW view of an NHWC buffer is normalised where it lies: the output keeps the
    layout, and relu, the sum and both backward passes run without copying it."""
    if not ops.batch_norm_has_kernel(T(np.zeros((1, 1)), device, "float32")):
        pytest.skip("device without the batch-norm kernels (composed ops)")
    rng = np.random.default_rng(0)
    x = T(rng.standard_normal((2, 4, 3, 5)), device, "float32")  # N, H, W, C
    view = ops.transpose(ops.transpose(x, (2, 3)), (1, 2))  # N, C, H, W over the same buffer
    w, b = T(np.ones(5), device, "float32"), T(np.zeros(5), device, "float32")
    copies = []
    mod = device.mod
    original = mod.compact
    device.__dict__["compact"] = lambda *a: (copies.append(a), original(*a))[1]
    try:
        y = ops.batch_norm(view, w, b)[0]
        assert y.realize_cached_data().strides == view.realize_cached_data().strides
        ops.relu(y).sum().backward()
    finally:
        device.__dict__.pop("compact", None)
    # the only copy materialises the broadcast gradient of sum(); none reads the activation
    assert [strides for _, _, _, strides, _ in copies if 0 not in strides] == []
    assert len(copies) == 1
    assert x.grad.shape == (2, 4, 3, 5)


def test_batch_norm_numerical_gradients(device):
    rng = np.random.default_rng(4)
    for shape in ((5, 3), (3, 2, 2, 3)):
        args = [T(rng.standard_normal(shape) * 2 + 1, device), T(rng.standard_normal(shape[1]),
                                                                 device),
                T(rng.standard_normal(shape[1]), device)]
        assert gradcheck(lambda x, w, b: ops.batch_norm(x, w, b)[0], *args, atol=1e-6)


def test_gradient_of_gradient_matches_numerical(device):
    """With create_graph the gradient is built from ops that recompute the statistics, so
    it can be differentiated again."""
    rng = np.random.default_rng(5)
    x0 = rng.standard_normal((4, 3)) * 2
    w0, b0 = rng.standard_normal(3), rng.standard_normal(3)
    g = rng.standard_normal((4, 3))

    def first_grads(x, w, b):
        # the create_graph rule reads only the node's inputs
        node = SimpleNamespace(inputs=(x, w, b))
        dx, dw, db = ops.FusedBatchNorm(1e-5).gradient(T(g, device, requires_grad=False), node)
        return dx * dx + ops.summation(dw * db)

    assert gradcheck(first_grads, T(x0, device), T(w0, device), T(b0, device), atol=1e-5)


def test_plain_and_graph_gradients_agree(device):
    rng = np.random.default_rng(6)
    x0, w0, b0 = rng.standard_normal((3, 4, 2, 2)), rng.standard_normal(4), rng.standard_normal(4)
    g = T(rng.standard_normal((3, 4, 2, 2)), device, requires_grad=False)
    grads = []
    for create in (False, True):
        args = [T(x0, device), T(w0, device), T(b0, device)]
        (ops.batch_norm(*args)[0] * g).sum().backward(create_graph=create)
        grads.append([a.grad.numpy() for a in args])
    for plain, graph in zip(*grads, strict=True):
        np.testing.assert_allclose(plain, graph, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("module", ["1d", "2d"])
def test_modules_fused_equal_composed_and_pytorch(device, module, monkeypatch):
    """Two training steps and one eval step: outputs, gradients and running statistics of
    the fused module equal the composed one (kernels off) and PyTorch's (whose running
    variance is unbiased: compared through the batch variance)."""
    rng = np.random.default_rng(7)
    shape = (8, 5) if module == "1d" else (4, 5, 3, 3)
    xs = [rng.standard_normal(shape) * 2 + 1 for _ in range(3)]
    g = rng.standard_normal(shape)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(ops, "batch_norm_has_kernel", lambda x: False)
        bn = (nn.BatchNorm1d if module == "1d" else nn.BatchNorm2d)(5, device=device,
                                                                    momentum=0.2)
        bn.weight.data = T(np.arange(1, 6), device, "float32")
        run = []
        for k, data in enumerate(xs):
            if k == 2:
                bn.eval()
            x = T(data, device, "float32")
            y = bn(x)
            (y * T(g, device, "float32", False)).sum().backward()
            run += [y.numpy(), x.grad.numpy(), bn.running_mean.numpy(), bn.running_var.numpy()]
        run += [bn.weight.grad.numpy(), bn.bias.grad.numpy()]
        results.append(run)
    for fused, composed in zip(*results, strict=True):
        np.testing.assert_allclose(fused, composed, rtol=2e-5, atol=2e-5)
    tb = (torch.nn.BatchNorm1d if module == "1d" else torch.nn.BatchNorm2d)(5, momentum=0.2)
    with torch.no_grad():
        tb.weight.copy_(torch.arange(1, 6, dtype=torch.float32))
    tx = torch.tensor(xs[0], dtype=torch.float32, requires_grad=True)
    ty = tb(tx)  # one call: each training-mode call updates the running statistics
    (ty * torch.tensor(g, dtype=torch.float32)).sum().backward()
    np.testing.assert_allclose(results[0][0], ty.detach().numpy(), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(results[0][1], tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(results[0][2], tb.running_mean.numpy(), rtol=1e-5, atol=1e-6)


def test_fused_module_records_one_node(device):
    if not ops.batch_norm_has_kernel(T(np.zeros((1, 1)), device, "float32")):
        pytest.skip("device without the batch-norm kernels (composed ops)")
    bn = nn.BatchNorm2d(3, device=device)
    x = T(np.random.default_rng(0).standard_normal((2, 3, 4, 4)), device, "float32")
    y = bn(x)
    assert isinstance(y.op, ops.FusedBatchNorm)
    assert [id(t) for t in y.inputs] == [id(x), id(bn.weight), id(bn.bias)]


def test_bad_shapes_are_refused(device):
    w, b = T(np.ones(3), device), T(np.zeros(3), device)
    with pytest.raises(ShapeError, match="at least 2 dims"):
        ops.batch_norm(T(np.ones(3), device), w, b)
    with pytest.raises(ShapeError, match="expected 4 .axis 1 of the input., got 3"):
        ops.batch_norm(T(np.ones((2, 4)), device), w, b)
    with pytest.raises(ShapeError, match="bias must have one value per channel, expected 3"):
        ops.batch_norm(T(np.ones((2, 3)), device), w, T(np.zeros(2), device))
    with pytest.raises(ShapeError, match="at least one value per channel"):
        ops.batch_norm(T(np.ones((0, 3)), device), w, b)
    with pytest.raises(ShapeError, match="BatchNorm2d: expected 3 channels"):
        nn.BatchNorm2d(3, device=device)(T(np.ones((2, 4, 2, 2)), device, "float32"))
    # the composed path (eval mode; training on a device without the kernels) names the layer
    # and the NCHW shape too, not the (N*H*W, C) rows it normalises
    with pytest.raises(ShapeError, match=r"BatchNorm2d: expected 3 channels .*\(2, 4, 2, 2\)"):
        nn.BatchNorm2d(3, device=device).eval()(T(np.ones((2, 4, 2, 2)), device, "float32"))


@pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")
def test_conv_batch_norm_block_on_emulated_cuda_matches_cpu(emulated_cuda, monkeypatch):
    """cuda() normalises with its own kernels (two launches each way): a conv's NHWC output
    seen as NCHW (the channels-last rows case) and a compact NCHW input give cpu_numpy's
    values, running statistics and gradients, float64."""
    from needle.backend_ndarray import cpu_numpy
    from needle.backend_ndarray._cuda import runtime

    launched, real_launch = [], runtime.launch

    def counting(spec, *args, **kwargs):
        launched.append(spec.base)
        return real_launch(spec, *args, **kwargs)

    monkeypatch.setattr(runtime, "launch", counting)
    x = np.random.default_rng(16).standard_normal((3, 2, 5, 4)) * 3 + 1
    results = []
    for dev in (emulated_cuda, cpu_numpy()):
        np.random.seed(0)
        conv = nn.Conv(2, 4, 3, device=dev, dtype="float64")
        bns = [nn.BatchNorm2d(2, device=dev, dtype="float64"),
               nn.BatchNorm2d(4, device=dev, dtype="float64")]
        xt = T(x, dev)
        y = bns[1](conv(bns[0](xt)))
        (y * y).sum().backward()
        results.append([y.numpy(), xt.grad.numpy()]
                       + [p.grad.numpy() for m in [conv] + bns for p in m.parameters()]
                       + [a.numpy() for bn in bns for a in (bn.running_mean, bn.running_var)])
    for name in ("batch_norm_stats", "batch_norm_apply", "batch_norm_grad_stats",
                 "batch_norm_grad_input"):
        assert launched.count(name) == 2, (name, launched)
    for got, want in zip(*results, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
