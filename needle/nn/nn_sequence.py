"""Recurrent layers (RNN, LSTM) and Embedding over (T, B, ...) sequences.

Weights are drawn W_ih → W_hh → bias_ih → bias_hh, each U(±1/√H) (the course's order); the LSTM
gate order is i, f, g, o.

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import nn
    >>> np.random.seed(0); lstm = nn.LSTM(4, 5, num_layers=2)
    >>> out, (h, c) = lstm(ndl.Tensor(np.ones((3, 2, 4))))
    >>> out.shape, h.shape, c.shape
    ((3, 2, 5), (2, 2, 5), (2, 2, 5))
"""
from __future__ import annotations

import math

from .. import init, ops
from .._core.errors import NeedleError, ShapeError
from ..autograd import Tensor
from .nn_module import Module, Parameter

__all__ = ["RNNCell", "RNN", "LSTMCell", "LSTM", "Embedding"]


def _uniform(shape: tuple, hidden_size: int, device, dtype) -> Parameter:
    bound = 1.0 / math.sqrt(hidden_size)
    return Parameter(init.rand(*shape, low=-bound, high=bound, device=device, dtype=dtype),
                     requires_grad=True)


class _CellBase(Module):
    """Shared weights of RNNCell/LSTMCell: ``gates`` = 1 (RNN) or 4 (LSTM) blocks of H."""

    def __init__(self, input_size, hidden_size, gates, bias, device, dtype):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        width = gates * hidden_size
        self.W_ih = _uniform((input_size, width), hidden_size, device, dtype)
        self.W_hh = _uniform((hidden_size, width), hidden_size, device, dtype)
        self.bias_ih = _uniform((width,), hidden_size, device, dtype) if bias else None
        self.bias_hh = _uniform((width,), hidden_size, device, dtype) if bias else None

    def _zeros(self, batch: int, like: Tensor) -> Tensor:
        """A zero state (batch, hidden) on ``like``'s device, in its dtype."""
        return init.zeros(batch, self.hidden_size, device=like.device, dtype=like.dtype)

    def _preactivation(self, X: Tensor, h: Tensor) -> Tensor:
        if X.ndim != 2 or X.shape[1] != self.input_size:
            raise ShapeError(f"{type(self).__name__}: expected input (batch, "
                             f"{self.input_size}), got shape {X.shape}")
        z = X @ self.W_ih + h @ self.W_hh
        if self.bias_ih is not None:
            width = z.shape[1]
            # Biases may be (W,) or replaced by callers; reshape to a row before broadcasting.
            bias = ops.reshape(self.bias_ih + self.bias_hh, (1, width))
            z = z + ops.broadcast_to(bias, z.shape)
        return z


class RNNCell(_CellBase):
    """h' = act(x W_ih + b_ih + h W_hh + b_hh), act ``tanh`` or ``relu``."""

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", device=None,
                 dtype="float32"):
        if nonlinearity not in ("tanh", "relu"):
            raise NeedleError(f"RNNCell: unknown nonlinearity, expected 'tanh' or 'relu', got "
                              f"{nonlinearity!r}")
        super().__init__(input_size, hidden_size, 1, bias, device, dtype)
        self.nonlinearity = nonlinearity

    def forward(self, X: Tensor, h: Tensor | None = None) -> Tensor:
        h = self._zeros(X.shape[0], X) if h is None else h
        z = self._preactivation(X, h)
        return ops.tanh(z) if self.nonlinearity == "tanh" else ops.relu(z)


class LSTMCell(_CellBase):
    """One LSTM step; ``forward(X, (h, c))`` → ``(h', c')``."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype="float32"):
        super().__init__(input_size, hidden_size, 4, bias, device, dtype)

    def forward(self, X: Tensor, h=None) -> tuple[Tensor, Tensor]:
        if h is None:
            h0, c0 = self._zeros(X.shape[0], X), self._zeros(X.shape[0], X)
        else:
            h0, c0 = h
        if X.ndim != 2 or X.shape[1] != self.input_size:
            raise ShapeError(f"{type(self).__name__}: expected input (batch, "
                             f"{self.input_size}), got shape {X.shape}")
        # One fused node per step (ops.lstm_cell): the attributes are read at every call, so
        # weights replaced by plain Tensors get their gradients as before.
        biases = [b for b in (self.bias_ih, self.bias_hh) if b is not None]
        return ops.lstm_cell(X, h0, c0, self.W_ih, self.W_hh, *biases)


def _layer_states(h, num_layers: int) -> list:
    return [None] * num_layers if h is None else list(ops.split(h, axis=0).tuple())


class RNN(Module):
    """Multi-layer Elman RNN: ``forward(X (T,B,in), h0 (L,B,H))`` → ``(out (T,B,H), h_n)``."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, nonlinearity="tanh",
                 device=None, dtype="float32"):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.rnn_cells = [
            RNNCell(input_size if k == 0 else hidden_size, hidden_size, bias, nonlinearity,
                    device, dtype) for k in range(num_layers)]

    def forward(self, X: Tensor, h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        inputs = ops.split(X, axis=0).tuple()
        finals = []
        for cell, h in zip(self.rnn_cells, _layer_states(h0, self.num_layers), strict=False):
            outputs = []
            for x_t in inputs:
                h = cell(x_t, h)
                outputs.append(h)
            inputs = outputs
            finals.append(h)
        return ops.stack(inputs, 0), ops.stack(finals, 0)


class LSTM(Module):
    """Multi-layer LSTM: ``forward(X, (h0, c0) or None)`` → ``(out, (h_n, c_n))``."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, device=None,
                 dtype="float32"):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.lstm_cells = [
            LSTMCell(input_size if k == 0 else hidden_size, hidden_size, bias, device, dtype)
            for k in range(num_layers)]

    def forward(self, X: Tensor, h=None):
        if X.ndim != 3 or X.shape[2] != self.lstm_cells[0].input_size:
            raise ShapeError(f"LSTM: expected input (seq_len, batch, "
                             f"{self.lstm_cells[0].input_size}), got shape {X.shape}")
        hs = _layer_states(None if h is None else h[0], self.num_layers)
        cs = _layer_states(None if h is None else h[1], self.num_layers)
        finals_h, finals_c = [], []
        out = X
        for cell, h_l, c_l in zip(self.lstm_cells, hs, cs, strict=False):
            if h_l is None:
                h_l, c_l = cell._zeros(X.shape[1], X), cell._zeros(X.shape[1], X)
            # One node per layer and sequence (ops.lstm_layer), the cells' own weights read
            # at every call, as LSTMCell does.
            biases = [b for b in (cell.bias_ih, cell.bias_hh) if b is not None]
            out, h_n, c_n = ops.lstm_layer(out, h_l, c_l, cell.W_ih, cell.W_hh, *biases)
            finals_h.append(h_n)
            finals_c.append(c_n)
        return out, (ops.stack(finals_h, 0), ops.stack(finals_c, 0))


class Embedding(Module):
    """Lookup table ``weight`` (num_embeddings, dim) ~ N(0, 1): (T, B) ids → (T, B, dim)."""

    def __init__(self, num_embeddings, embedding_dim, device=None, dtype="float32"):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = Parameter(init.randn(num_embeddings, embedding_dim, device=device,
                                           dtype=dtype), requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        # Same values as the course's one_hot(x) @ weight, gathered instead of multiplied.
        return ops.embedding(self.weight, x)
