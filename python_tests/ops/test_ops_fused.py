"""The fused LSTM cell op against the unfused composition, numerical gradients and PyTorch;
the convolution's pruning of taps that only meet padding against PyTorch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import needle as ndl
import needle.ops as ops
from needle import nn
from needle._core.errors import ShapeError
from needle.autograd import Tensor, gradcheck
from needle.backend_selection import BACKEND


def T(a, device, dtype="float32", requires_grad=True):
    return Tensor(np.asarray(a), device=device, dtype=dtype, requires_grad=requires_grad)


def _unfused(x, h, c, w_ih, w_hh, *biases):
    """The cell written with primitive ops, gate order i, f, g, o (the course's LSTMCell)."""
    z = ops.matmul(x, w_ih) + ops.matmul(h, w_hh)
    for b in biases:
        z = z + ops.broadcast_to(ops.reshape(b, (1, z.shape[1])), z.shape)
    batch, hidden = h.shape
    i, f, g, o = ops.split(ops.reshape(z, (batch, 4, hidden)), axis=1).tuple()
    c2 = ops.sigmoid(f) * c + ops.sigmoid(i) * ops.tanh(g)
    return ops.sigmoid(o) * ops.tanh(c2), c2


def _operands(rng, batch, inp, hidden, bias_shapes, device, dtype):
    shapes = [(batch, inp), (batch, hidden), (batch, hidden), (inp, 4 * hidden),
              (hidden, 4 * hidden)] + list(bias_shapes)
    return [T(rng.standard_normal(s) * (1.5 if k < 3 else 0.5), device, dtype)
            for k, s in enumerate(shapes)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bias_shapes", [[], [(32,)], [(32,), (1, 32)]],
                         ids=["no-bias", "one-bias", "two-biases"])
def test_lstm_cell_matches_unfused_values_and_gradients(device, dtype, bias_shapes):
    rng = np.random.default_rng(0)
    args = _operands(rng, 5, 3, 8, bias_shapes, device, dtype)
    twins = [T(a.numpy(), device, dtype) for a in args]
    h2, c2 = ops.lstm_cell(*args)
    u_h2, u_c2 = _unfused(*twins)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(h2.numpy(), u_h2.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(c2.numpy(), u_c2.numpy(), rtol=tol, atol=tol)
    weights = rng.standard_normal((2, 5, 8))
    loss = (h2 * T(weights[0], device, dtype, False) + c2 * T(weights[1], device, dtype, False))
    u_loss = (u_h2 * T(weights[0], device, dtype, False)
              + u_c2 * T(weights[1], device, dtype, False))
    loss.sum().backward()
    u_loss.sum().backward()
    for a, b in zip(args, twins, strict=True):
        assert a.grad.shape == a.shape
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=tol * 10, atol=tol * 10)


def _one_output_grads_match(fn, reference, args, device, pick):
    """Gradients of ``fn(*args)[pick].sum()`` equal the reference's (float64)."""
    twins = [T(a.numpy(), device, "float64") for a in args]
    fn(*args)[pick].sum().backward()
    reference(*twins)[pick].sum().backward()
    for a, b in zip(args, twins, strict=True):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_lstm_cell_only_h_or_only_c_used(device):
    """A gradient reaching only one of the two outputs (the other's is zero)."""
    rng = np.random.default_rng(1)
    for pick in (0, 1):
        args = _operands(rng, 3, 4, 5, [(20,)], device, "float64")
        _one_output_grads_match(ops.lstm_cell, _unfused, args, device, pick)


def test_lstm_cell_numerical_gradient(device):
    rng = np.random.default_rng(2)
    args = _operands(rng, 3, 2, 3, [(12,), (12,)], device, "float64")

    def f(*xs):
        h2, c2 = ops.lstm_cell(*xs)
        return h2 * 0.7 + c2

    assert gradcheck(f, *[a.detach() for a in args])


def test_lstm_cell_second_order_matches_unfused(device):
    """With create_graph the fused gradient is differentiable like the unfused one."""
    rng = np.random.default_rng(3)
    args = _operands(rng, 2, 3, 2, [(8,)], device, "float64")
    twins = [T(a.numpy(), device, "float64") for a in args]
    results = []
    for fn, xs in ((ops.lstm_cell, args), (_unfused, twins)):
        h2, c2 = fn(*xs)
        (h2 * h2 + c2).sum().backward(create_graph=True, retain_graph=True)
        gx = xs[0].grad
        for x in xs:
            x.grad = None
        (gx * gx).sum().backward()
        results.append([x.grad.numpy() for x in xs])
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


# ---- the whole-sequence layer (ops.lstm_layer) -----------------------------------------

def _layer_operands(rng, steps, batch, inp, hidden, bias_shapes, device, dtype):
    shapes = [(steps, batch, inp), (batch, hidden), (batch, hidden), (inp, 4 * hidden),
              (hidden, 4 * hidden)] + list(bias_shapes)
    return [T(rng.standard_normal(s) * (1.5 if k < 3 else 0.5), device, dtype)
            for k, s in enumerate(shapes)]


def _per_step(x, h, c, w_ih, w_hh, *biases):
    """The layer as T fused cells (what nn.LSTM ran before the layer op)."""
    outs = []
    for x_t in ops.split(x, axis=0).tuple():
        h, c = ops.lstm_cell(x_t, h, c, w_ih, w_hh, *biases)
        outs.append(h)
    return ops.stack(outs, 0), h, c


def _layer_loss(outputs, weights, device, dtype):
    return sum((o * T(w, device, dtype, False)).sum()
               for o, w in zip(outputs, weights, strict=True))


@pytest.mark.parametrize("bias_shapes", [[], [(32,)], [(32,), (1, 32)]],
                         ids=["no-bias", "one-bias", "two-biases"])
def test_lstm_layer_matches_per_step_cells(device, bias_shapes):
    """Forward bit for bit on the CPU devices (float32: the same kernels on the same rows);
    on cuda within float32 rounding, since cuBLAS picks its algorithm by shape and the layer
    projects all steps in one product. Gradients of every input, the weights' summed over
    time in another order, within rounding (float64)."""
    rng = np.random.default_rng(10)
    args = _layer_operands(rng, 6, 5, 3, 8, bias_shapes, device, "float32")
    twins = [T(a.numpy(), device, "float32") for a in args]
    for got, want in zip(ops.lstm_layer(*args), _per_step(*twins), strict=True):
        if device.name == "cuda":
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
        else:
            assert np.array_equal(got.numpy(), want.numpy())
    args = _layer_operands(rng, 6, 5, 3, 8, bias_shapes, device, "float64")
    twins = [T(a.numpy(), device, "float64") for a in args]
    weights = [rng.standard_normal(s) for s in ((6, 5, 8), (5, 8), (5, 8))]
    _layer_loss(ops.lstm_layer(*args), weights, device, "float64").backward()
    _layer_loss(_per_step(*twins), weights, device, "float64").backward()
    for a, b in zip(args, twins, strict=True):
        assert a.grad.shape == a.shape
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pick", [0, 1, 2], ids=["out", "h_T", "c_T"])
def test_lstm_layer_one_output_used(device, pick):
    """A gradient reaching only one of the three outputs (the others' are zero)."""
    rng = np.random.default_rng(11)
    args = _layer_operands(rng, 4, 3, 2, 5, [(20,)], device, "float64")
    _one_output_grads_match(ops.lstm_layer, _per_step, args, device, pick)


def test_lstm_layer_numerical_gradient(device):
    rng = np.random.default_rng(12)
    args = _layer_operands(rng, 3, 2, 2, 3, [(12,), (12,)], device, "float64")

    def f(*xs):
        out, h_n, c_n = ops.lstm_layer(*xs)
        return ops.summation(out, (0,)) * 0.5 + h_n * 0.7 + c_n

    assert gradcheck(f, *[a.detach() for a in args])


def test_lstm_layer_second_order_matches_per_step_cells(device):
    """With create_graph the layer's gradient is differentiable like the cells' chain."""
    rng = np.random.default_rng(13)
    args = _layer_operands(rng, 3, 2, 3, 2, [(8,)], device, "float64")
    twins = [T(a.numpy(), device, "float64") for a in args]
    results = []
    for fn, xs in ((ops.lstm_layer, args), (_per_step, twins)):
        out, h_n, c_n = fn(*xs)
        (out * out).sum().backward(create_graph=True, retain_graph=True)
        gx, gw = xs[0].grad, xs[4].grad
        for x in xs:
            x.grad = None
        ((gx * gx).sum() + (gw * gw).sum()).backward()
        results.append([x.grad.numpy() for x in xs])
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_lstm_layer_on_emulated_cuda_matches_cpu(emulated_cuda):
    """cuda() has no gate kernel: the layer composes array ops there, with the same values
    and gradients as on cpu_numpy (two layers of nn.LSTM, default zero state)."""
    from needle.backend_ndarray import cpu_numpy

    rng = np.random.default_rng(14)
    x = rng.standard_normal((3, 2, 3))
    results = []
    for dev in (emulated_cuda, cpu_numpy()):
        np.random.seed(0)
        model = nn.LSTM(3, 4, num_layers=2, device=dev)
        out, (h_n, c_n) = model(T(x, dev))
        (out.sum() + (h_n * c_n).sum()).backward()
        results.append([out.numpy(), h_n.numpy()]
                       + [p.grad.numpy() for p in model.parameters()])
    for got, want in zip(*results, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_lstm_layer_shape_errors():
    h, c = Tensor(np.zeros((2, 4))), Tensor(np.zeros((2, 4)))
    w_ih, w_hh = Tensor(np.zeros((3, 16))), Tensor(np.zeros((4, 16)))
    with pytest.raises(ShapeError, match=r"lstm_layer: expected X of shape \(T, B, I\), got "
                                         r"shape \(2, 3\)"):
        ops.lstm_layer(Tensor(np.zeros((2, 3))), h, c, w_ih, w_hh)
    with pytest.raises(ShapeError, match=r"lstm_layer: expected a sequence of at least one "
                                         r"step, got T = 0"):
        ops.lstm_layer(Tensor(np.zeros((0, 2, 3))), h, c, w_ih, w_hh)
    with pytest.raises(ShapeError, match=r"lstm_layer: W_ih has the wrong shape, expected "
                                         r"\(3, 16\), got \(5, 16\)"):
        ops.lstm_layer(Tensor(np.zeros((4, 2, 3))), h, c, Tensor(np.zeros((5, 16))), w_hh)
    with pytest.raises(ShapeError, match=r"lstm_layer: h has the wrong shape"):
        ops.lstm_layer(Tensor(np.zeros((4, 3, 3))), h, c, w_ih, w_hh)
    with pytest.raises(ShapeError, match=r"LSTM: expected input \(seq_len, batch, 3\), got "
                                         r"shape \(4, 2, 5\)"):
        nn.LSTM(3, 4)(Tensor(np.zeros((4, 2, 5))))


def test_lstm_records_one_node_per_layer(device):
    """nn.LSTM runs a whole layer as one graph node (it ran one per step)."""
    model = nn.LSTM(3, 4, num_layers=2, device=device)
    out, (h_n, c_n) = model(T(np.ones((5, 2, 3)), device, requires_grad=False))
    layers, seen, stack = [], set(), [out, h_n, c_n]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node.op, ops.FusedLSTMLayer):
            layers.append(node)
        if isinstance(node.op, ops.FusedLSTMCell):
            raise AssertionError("a per-step cell node was recorded")
        stack.extend(node.inputs)
    assert len(layers) == 2


def test_lstm_cell_shape_errors():
    x, h, c = Tensor(np.zeros((2, 3))), Tensor(np.zeros((2, 4))), Tensor(np.zeros((2, 4)))
    w_ih, w_hh = Tensor(np.zeros((3, 16))), Tensor(np.zeros((4, 16)))
    with pytest.raises(ShapeError, match=r"lstm_cell: W_ih has the wrong shape, expected "
                                         r"\(3, 16\), got \(3, 12\)"):
        ops.lstm_cell(x, h, c, Tensor(np.zeros((3, 12))), w_hh)
    with pytest.raises(ShapeError, match=r"lstm_cell: c has the wrong shape"):
        ops.lstm_cell(x, h, Tensor(np.zeros((3, 4))), w_ih, w_hh)
    with pytest.raises(ShapeError, match=r"lstm_cell: bias has the wrong size, expected 16"):
        ops.lstm_cell(x, h, c, w_ih, w_hh, Tensor(np.zeros(15)))


def test_lstm_cell_module_keeps_the_course_contract(device):
    """Attributes replaced by plain Tensors get .grad; the gate order is i, f, g, o."""
    np.random.seed(4)
    cell = nn.LSTMCell(3, 2, device=device)
    w_ih = Tensor(np.random.randn(3, 8), device=device, dtype="float32")
    cell.W_ih = w_ih
    cell.bias_hh = Tensor(np.random.randn(8), device=device, dtype="float32")
    x = Tensor(np.random.randn(4, 3), device=device, dtype="float32")
    h, c = cell(x)
    (h.sum() + c.sum()).backward()
    assert w_ih.grad is not None and w_ih.grad.shape == (3, 8)
    assert cell.bias_hh.grad is not None and cell.W_hh.grad.shape == (2, 8)


@pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")
def test_lstm_matches_torch(device):
    """nn.LSTM (2 layers, fused cells) against torch.nn.LSTM with the same weights."""
    rng = np.random.default_rng(5)
    seq, batch, inp, hidden = 4, 3, 5, 6
    model = nn.LSTM(inp, hidden, num_layers=2, device=device)
    reference = torch.nn.LSTM(inp, hidden, num_layers=2)
    with torch.no_grad():
        for k, cell in enumerate(model.lstm_cells):
            getattr(reference, f"weight_ih_l{k}").copy_(torch.tensor(cell.W_ih.numpy().T))
            getattr(reference, f"weight_hh_l{k}").copy_(torch.tensor(cell.W_hh.numpy().T))
            getattr(reference, f"bias_ih_l{k}").copy_(torch.tensor(cell.bias_ih.numpy()))
            getattr(reference, f"bias_hh_l{k}").copy_(torch.tensor(cell.bias_hh.numpy()))
    x_np = rng.standard_normal((seq, batch, inp)).astype(np.float32)
    out, (hn, cn) = model(Tensor(x_np, device=device))
    ref_out, (ref_h, ref_c) = reference(torch.tensor(x_np))
    for a, b in ((out, ref_out), (hn, ref_h), (cn, ref_c)):
        np.testing.assert_allclose(a.numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-5)
    (out.sum() + cn.sum()).backward()
    (ref_out.sum() + ref_c.sum()).backward()
    for k, cell in enumerate(model.lstm_cells):
        np.testing.assert_allclose(cell.W_ih.grad.numpy(),
                                   getattr(reference, f"weight_ih_l{k}").grad.numpy().T,
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(cell.bias_hh.grad.numpy(),
                                   getattr(reference, f"bias_hh_l{k}").grad.numpy(),
                                   rtol=1e-4, atol=1e-5)


# ---- convolution: taps that only meet padding ----------------------------------------------

@pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")
@pytest.mark.parametrize("n, h, cin, cout, k, stride, padding", [
    (3, 1, 5, 4, 3, 1, 1),   # ResNet9's last block: 1 live tap of 9
    (3, 2, 4, 6, 3, 2, 1),   # 2x2 -> 1x1: 2x2 live taps
    (2, 1, 3, 2, 5, 1, 2),   # 5x5 on 1x1
    (2, 3, 2, 3, 5, 2, 2)])  # asymmetric live range: not pruned, still right
def test_conv_pruned_taps_match_torch(device, n, h, cin, cout, k, stride, padding):
    rng = np.random.default_rng(6)
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
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w.grad.numpy(), wt.grad.numpy().transpose(2, 3, 1, 0),
                               rtol=1e-4, atol=1e-4)


def test_conv_kernel_path_matches_im2col_path(device):
    """The fused conv kernels (where the device has them) give what im2col + matmul gives."""
    from needle.ops import _conv_kernels, ops_conv

    rng = np.random.default_rng(7)
    x = ndl.Tensor(rng.standard_normal((2, 9, 9, 3)), device=device, dtype="float64")
    w = ndl.Tensor(rng.standard_normal((3, 3, 3, 5)), device=device, dtype="float64")
    g = ndl.Tensor(rng.standard_normal((2, 4, 4, 5)), device=device, dtype="float64")
    fused = ops_conv._conv_gradient_arrays(g.cached_data, x.cached_data, w.cached_data, 2, 0,
                                           True, True)
    out = ops_conv._conv_compute(x.cached_data, w.cached_data, 2, 0)
    saved = (_conv_kernels.forward, _conv_kernels.weight_grad, _conv_kernels.input_grad)
    try:  # force the fallback
        _conv_kernels.forward = _conv_kernels.weight_grad = _conv_kernels.input_grad = (
            lambda *args: None)
        plain = ops_conv._conv_gradient_arrays(g.cached_data, x.cached_data, w.cached_data, 2,
                                               0, True, True)
        out_plain = ops_conv._conv_compute(x.cached_data, w.cached_data, 2, 0)
    finally:
        _conv_kernels.forward, _conv_kernels.weight_grad, _conv_kernels.input_grad = saved
    np.testing.assert_allclose(np.asarray(out.numpy() if hasattr(out, "numpy") else out),
                               np.asarray(out_plain.numpy() if hasattr(out_plain, "numpy")
                                          else out_plain), rtol=1e-12, atol=1e-12)
    for a, b in zip(fused, plain, strict=True):
        a = a.numpy() if hasattr(a, "numpy") else a
        b = b.numpy() if hasattr(b, "numpy") else b
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")
def test_conv_layers_on_emulated_cuda_match_cpu(emulated_cuda, monkeypatch):
    """cuda() runs nn.Conv through its own im2col / col2im kernels around cuBLAS products:
    the values and every gradient of a 3x3 stride-2 layer and a 1x1 layer (no im2col) are
    cpu_numpy's, float64."""
    from needle.backend_ndarray import cpu_numpy
    from needle.backend_ndarray._cuda import runtime

    launched, real_launch = [], runtime.launch

    def counting(spec, *args, **kwargs):
        launched.append(spec.base)
        return real_launch(spec, *args, **kwargs)

    monkeypatch.setattr(runtime, "launch", counting)
    x = np.random.default_rng(15).standard_normal((2, 3, 7, 6))
    results = []
    for dev in (emulated_cuda, cpu_numpy()):
        np.random.seed(0)
        layers = [nn.Conv(3, 4, 3, stride=2, device=dev, dtype="float64"),
                  nn.Conv(4, 5, 1, device=dev, dtype="float64")]
        xt = T(x, dev, "float64", True)
        y = layers[1](layers[0](xt))
        (y * y).sum().backward()
        results.append([y.numpy(), xt.grad.numpy()]
                       + [p.grad.numpy() for layer in layers for p in layer.parameters()])
    assert launched.count("im2col") == 2 and launched.count("col2im") == 1, launched
    for got, want in zip(*results, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
