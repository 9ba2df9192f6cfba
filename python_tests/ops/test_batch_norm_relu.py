"""A BatchNorm followed by a ReLU as one graph node (``ops.batch_norm(..., relu=True)``,
which ``nn.Sequential`` uses for BatchNorm1d/2d then ReLU): bit for bit the two ops one after
the other, forward, plain and graph gradients, running statistics, on every device and
layout; on cuda() inside the batch-norm kernels (no ReLU launch, no ReLU buffer)."""
from __future__ import annotations

import numpy as np
import pytest

import needle.ops as ops
from needle import nn
from needle.autograd import Tensor, gradcheck
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")


def _inputs(rng, shape, layout):
    """x (with a constant channel: its outputs are exactly the bias, 0 for channel 0, the
    ReLU's kink; and a NaN in the last channel), w, b and an upstream gradient."""
    c = shape[1]
    x = rng.standard_normal(shape) * 3 + 1
    x[:, 0] = 2.5
    x[(1, c - 1) + (0,) * (len(shape) - 2)] = np.nan
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    b[0] = 0.0
    g = rng.standard_normal(shape)
    g[0, 0] = -g[0, 0]  # both signs of dy at the kink: -0.0 and +0.0 products
    if layout == "channels-last":
        return np.ascontiguousarray(x.transpose(0, 2, 3, 1)), w, b, g
    if layout == "sliced":
        return np.concatenate([x, x[:1] + 7.0]), w, b, g
    return x, w, b, g


def _view(t, layout, n):
    if layout == "channels-last":
        return ops.transpose(ops.transpose(t, (2, 3)), (1, 2))
    if layout == "sliced":
        return ops.get_item(t, (slice(0, n),))
    return t


_CASES = [((6, 5), "compact"), ((4, 3, 5, 6), "compact"), ((4, 3, 5, 6), "channels-last"),
          ((3, 4, 2, 3), "sliced")]


def _run(device, dtype, shape, layout, fused, create_graph=False):
    x0, w0, b0, g0 = _inputs(np.random.default_rng(sum(shape)), shape, layout)
    x = Tensor(x0, device=device, dtype=dtype)
    w, b = Tensor(w0, device=device, dtype=dtype), Tensor(b0, device=device, dtype=dtype)
    xv = _view(x, layout, shape[0])
    if fused:
        y, mean, var = ops.batch_norm(xv, w, b, 1e-5, relu=True)
    else:
        y, mean, var = ops.batch_norm(xv, w, b, 1e-5)
        y = ops.relu(y)
    g = Tensor(g0, device=device, dtype=dtype, requires_grad=False)
    (y * g).sum().backward(create_graph=create_graph)
    return [a.numpy() for a in (y, mean, var, x.grad, w.grad, b.grad)]


def _same_bits(got, want):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"),
                                      err_msg=f"output {i}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape,layout", _CASES)
@pytest.mark.parametrize("create_graph", [False, True])
def test_fused_is_bitwise_batch_norm_then_relu(device, dtype, shape, layout, create_graph):
    _same_bits(_run(device, dtype, shape, layout, True, create_graph),
               _run(device, dtype, shape, layout, False, create_graph))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_kernels_on_emulated_cuda_are_bitwise_the_unfused_kernels(emulated_cuda, dtype):
    """The kink (outputs exactly 0, upstream gradients of both signs) and a NaN channel:
    max(y, 0) and the mask rounded as scalar_maximum and ewise_relu_grad round them."""
    for shape, layout in _CASES:
        _same_bits(_run(emulated_cuda, dtype, shape, layout, True),
                   _run(emulated_cuda, dtype, shape, layout, False))


def test_fused_gradients_match_numerical(device):
    rng = np.random.default_rng(3)
    x = Tensor(rng.standard_normal((5, 3, 2, 2)), device=device, dtype="float64")
    w = Tensor(rng.standard_normal(3), device=device, dtype="float64")
    b = Tensor(rng.standard_normal(3) * 0.1, device=device, dtype="float64")
    gradcheck(lambda a, c, d: ops.batch_norm(a, c, d, 1e-5, relu=True)[0], x, w, b,
              atol=1e-5)


def _nodes(t):
    seen, stack = set(), [t]
    while stack:
        n = stack.pop()
        if id(n) in seen or n.op is None:
            continue
        seen.add(id(n))
        stack.extend(n.inputs)
    return len(seen)


def _model(device, dtype, relu_cls=nn.ReLU, bn_cls=nn.BatchNorm2d):
    np.random.seed(1)
    return nn.Sequential(nn.Conv(2, 3, 3, device=device, dtype=dtype),
                         bn_cls(3, device=device, dtype=dtype), relu_cls(),
                         nn.Conv(3, 2, 3, device=device, dtype=dtype))


def _step(model, device, dtype):
    x = Tensor(np.random.default_rng(4).standard_normal((2, 2, 5, 5)), device=device,
               dtype=dtype)
    y = model(x)
    nodes = _nodes(y)
    (y * y).sum().backward()
    bn = model.modules[1]
    return nodes, [y.numpy(), x.grad.numpy(), bn.running_mean.numpy(), bn.running_var.numpy()] \
        + [p.grad.numpy() for p in model.parameters()]


class _PlainReLU(nn.ReLU):
    """A ReLU subclass: Sequential must not fuse it (its forward could differ)."""


class _OwnBatchNorm(nn.BatchNorm2d):
    """A BatchNorm2d subclass: not fused either."""


def test_sequential_fuses_batch_norm_and_relu_into_one_node(device):
    dtype = "float64"
    fused_nodes, fused = _step(_model(device, dtype), device, dtype)
    for relu_cls, bn_cls in ((_PlainReLU, nn.BatchNorm2d), (nn.ReLU, _OwnBatchNorm)):
        nodes, plain = _step(_model(device, dtype, relu_cls, bn_cls), device, dtype)
        assert nodes == fused_nodes + 1  # the ReLU's own node
        _same_bits(fused, plain)
    shadowed = _model(device, dtype)
    shadowed.modules[2].forward = lambda x: ops.relu(x) * 2  # a patched instance: honoured
    nodes, out = _step(shadowed, device, dtype)
    assert nodes == fused_nodes + 2
    assert not np.allclose(out[0], fused[0])  # the patched forward ran


def test_sequential_in_eval_mode_composes_and_still_applies_the_relu(device):
    model = _model(device, "float64").eval()
    x = Tensor(np.random.default_rng(5).standard_normal((2, 2, 5, 5)), device=device,
               dtype="float64")
    y = model.modules[2](model.modules[1](model.modules[0](x)))
    np.testing.assert_array_equal(model.modules[1].forward_relu(model.modules[0](x)).numpy(),
                                  y.numpy())
    assert (y.numpy() >= 0).all() and (y.numpy() == 0).any()


def test_emulated_cuda_fuses_the_relu_into_the_batch_norm_kernels(emulated_cuda, monkeypatch):
    """cuda(): no ReLU launch either way, one buffer fewer each way, and the bits of the
    unfused ReLU kernels (scalar_maximum, ewise_relu_grad) on the same device."""
    from needle.backend_ndarray import cpu_numpy
    from needle.backend_ndarray._cuda import runtime

    launched, real_launch = [], runtime.launch

    def counting(spec, *args, **kwargs):
        launched.append(spec.base)
        return real_launch(spec, *args, **kwargs)

    monkeypatch.setattr(runtime, "launch", counting)
    runs = {}
    for fused in (True, False):
        launched.clear()
        runs[fused] = _step(_model(emulated_cuda, "float32", nn.ReLU if fused else _PlainReLU),
                            emulated_cuda, "float32")[1]
        relu_launches = launched.count("scalar_maximum") + launched.count("ewise_relu_grad")
        assert relu_launches == (0 if fused else 2), launched
    _same_bits(runs[True], runs[False])
    want = _step(_model(cpu_numpy(), "float32"), cpu_numpy(), "float32")[1]
    for got, ref in zip(runs[True], want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
