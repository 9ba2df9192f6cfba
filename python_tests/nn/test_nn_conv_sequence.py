"""Conv, RNN/LSTM, Embedding, attention: NumPy re-derivations and gradient checks."""
from __future__ import annotations

import math

import numpy as np
import pytest

from needle import nn, ops
from needle._core.errors import NeedleError, ShapeError
from needle.autograd import Tensor, gradcheck


def T(a, device, dtype="float32"):
    return Tensor(np.asarray(a), device=device, dtype=dtype, requires_grad=False)


def _uniform(shape, bound):
    return np.random.rand(*shape) * 2 * bound - bound


def _conv_ref(x, w, b, stride, pad):
    """Direct-loop NCHW convolution with weight (K, K, Cin, Cout)."""
    n, c, h, wd = x.shape
    k, cout = w.shape[0], w.shape[3]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    out = np.zeros((n, cout, ho, wo))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, :, i * stride:i * stride + k, j * stride:j * stride + k]
            out[:, :, i, j] = np.einsum("ncab,abco->no", patch, w)
    return out + b.reshape(1, cout, 1, 1)


@pytest.mark.parametrize("k,stride", [(3, 1), (3, 2), (1, 1), (5, 2)])
def test_conv_init_and_forward(device, k, stride):
    np.random.seed(0)
    conv = nn.Conv(3, 4, k, stride=stride, device=device)
    np.random.seed(0)
    w = _uniform((k, k, 3, 4), math.sqrt(6 / (3 * k * k)))
    b = _uniform((4,), 1 / math.sqrt(3 * k * k))
    np.testing.assert_allclose(conv.weight.numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(conv.bias.numpy(), b, rtol=1e-5, atol=1e-6)
    x = np.random.randn(2, 3, 7, 7)
    np.testing.assert_allclose(conv(T(x, device)).numpy(), _conv_ref(x, w, b, stride, k // 2),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ShapeError, match="Conv"):
        conv(T(np.ones((1, 2, 5, 5)), device))
    # the op's own bias check: one value per output channel
    nhwc = T(np.ones((1, 7, 7, 3)), device)
    with pytest.raises(ShapeError,
                       match=r"conv: bias .* expected shape \(4,\) or \(1, 4\), got \(3,\)"):
        ops.conv(nhwc, conv.weight, stride=stride, padding=k // 2, bias=T(np.ones(3), device))
    with pytest.raises(ShapeError, match=r"conv: bias .* got \(1, 1, 1, 1, 4\)"):
        ops.conv(nhwc, conv.weight, stride=stride, padding=k // 2,
                 bias=T(np.ones((1, 1, 1, 1, 4)), device))  # more axes than the output


def test_conv_gradients(device):
    np.random.seed(1)
    conv = nn.Conv(2, 3, 3, stride=2, device=device, dtype="float64")

    def f(x, w, b):
        conv.weight, conv.bias = w, b
        return conv(x)

    assert gradcheck(f, T(np.random.randn(1, 2, 5, 5), device, "float64"),
                     conv.weight.detach(), conv.bias.detach())


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _cell_weights(in_size, hidden, gates):
    bound = 1 / math.sqrt(hidden)
    return (_uniform((in_size, gates * hidden), bound), _uniform((hidden, gates * hidden), bound),
            _uniform((gates * hidden,), bound), _uniform((gates * hidden,), bound))


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_cell_and_rnn(device, nonlinearity):
    np.random.seed(2)
    rnn = nn.RNN(3, 4, num_layers=2, nonlinearity=nonlinearity, device=device)
    np.random.seed(2)
    layers = [_cell_weights(3, 4, 1), _cell_weights(4, 4, 1)]
    act = np.tanh if nonlinearity == "tanh" else (lambda z: np.maximum(z, 0))
    X, h0 = np.random.randn(5, 2, 3), np.random.randn(2, 2, 4)
    out, hn = rnn(T(X, device), T(h0, device))
    inputs, finals = list(X), []
    for (wi, wh, bi, bh), h in zip(layers, h0, strict=False):
        outs = []
        for x in inputs:
            h = act(x @ wi + bi + h @ wh + bh)
            outs.append(h)
        inputs, finals = outs, finals + [h]
    np.testing.assert_allclose(out.numpy(), np.stack(inputs), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(hn.numpy(), np.stack(finals), rtol=1e-4, atol=1e-5)
    cell_out = rnn.rnn_cells[0](T(X[0], device))  # h = None means zeros
    np.testing.assert_allclose(cell_out.numpy(), act(X[0] @ layers[0][0] + layers[0][2]
                                                     + layers[0][3]), rtol=1e-4, atol=1e-5)
    with pytest.raises(NeedleError, match="nonlinearity"):
        nn.RNNCell(2, 2, nonlinearity="gelu")


def _lstm_step(x, h, c, wi, wh, bi, bh):
    z = x @ wi + bi + h @ wh + bh
    i, f, g, o = np.split(z, 4, axis=1)  # gate order i, f, g, o
    c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
    return _sigmoid(o) * np.tanh(c), c


def test_lstm(device):
    np.random.seed(3)
    lstm = nn.LSTM(3, 4, num_layers=2, device=device)
    np.random.seed(3)
    layers = [_cell_weights(3, 4, 4), _cell_weights(4, 4, 4)]
    X = np.random.randn(4, 2, 3)
    h0, c0 = np.random.randn(2, 2, 4), np.random.randn(2, 2, 4)
    out, (hn, cn) = lstm(T(X, device), (T(h0, device), T(c0, device)))
    inputs, hs, cs = list(X), [], []
    for weights, h, c in zip(layers, h0, c0, strict=False):
        outs = []
        for x in inputs:
            h, c = _lstm_step(x, h, c, *weights)
            outs.append(h)
        inputs, hs, cs = outs, hs + [h], cs + [c]
    np.testing.assert_allclose(out.numpy(), np.stack(inputs), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(hn.numpy(), np.stack(hs), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cn.numpy(), np.stack(cs), rtol=1e-4, atol=1e-5)
    out2, _ = lstm(T(X, device))  # no state: zeros
    assert out2.shape == (4, 2, 4)


def test_lstm_cell_gradients(device):
    np.random.seed(4)
    cell = nn.LSTMCell(3, 2, device=device, dtype="float64")

    def f(x, h, c, w_ih):
        cell.W_ih = w_ih
        h2, c2 = cell(x, (h, c))
        return h2 + c2

    args = [T(np.random.randn(2, 3), device, "float64"), T(np.random.randn(2, 2), device,
                                                           "float64"),
            T(np.random.randn(2, 2), device, "float64"), cell.W_ih.detach()]
    assert gradcheck(f, *args)


def test_embedding(device):
    np.random.seed(5)
    emb = nn.Embedding(10, 3, device=device)
    np.random.seed(5)
    w = np.random.randn(10, 3)
    ids = np.array([[1, 9], [0, 1], [4, 4]])
    out = emb(T(ids, device))
    np.testing.assert_allclose(out.numpy(), w[ids], rtol=1e-6)
    emb.weight.grad = None
    out.sum().backward()
    counts = np.bincount(ids.ravel(), minlength=10)[:, None] * np.ones((1, 3))
    np.testing.assert_allclose(emb.weight.grad.numpy(), counts)


def _mha_ref(x, mha, causal):
    def lin(m, a):
        return a @ m.weight.numpy() + m.bias.numpy()

    b, t, d = x.shape
    h, dh = mha.num_heads, mha.head_dim

    def heads(a):
        return a.reshape(b, t, h, dh).transpose(0, 2, 1, 3)

    q, k, v = heads(lin(mha.q_proj, x)), heads(lin(mha.k_proj, x)), heads(lin(mha.v_proj, x))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
    if causal:
        s = np.where(np.triu(np.ones((t, t)), 1) > 0, -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return lin(mha.out_proj, (p @ v).transpose(0, 2, 1, 3).reshape(b, t, d))


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_attention(device, causal):
    np.random.seed(6)
    mha = nn.MultiHeadAttention(8, 2, causal=causal, device=device)
    x = np.random.randn(2, 5, 8)
    np.testing.assert_allclose(mha(T(x, device)).numpy(), _mha_ref(x, mha, causal),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(NeedleError, match="heads"):
        nn.MultiHeadAttention(6, 4)


def test_transformer_block_causality_and_gradients(device):
    np.random.seed(7)
    block = nn.TransformerBlock(8, 2, hidden_dim=16, causal=True, device=device,
                                dtype="float64")
    x = np.random.randn(1, 6, 8)
    y = x.copy()
    y[:, 4:] += 5.0  # change only the future of position 3
    a, b = block(T(x, device, "float64")).numpy(), block(T(y, device, "float64")).numpy()
    np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=1e-9, atol=1e-9)
    assert not np.allclose(a[:, 4:], b[:, 4:])
    assert gradcheck(lambda t: block(t), T(x[:, :3], device, "float64"))
    assert len(block.parameters()) == 2 + 8 + 2 + 4
