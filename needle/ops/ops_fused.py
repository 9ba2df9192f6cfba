"""Fused ops: one LSTM step (``lstm_cell``) as a single graph node with one gate kernel.

The unfused cell (two matmuls, bias adds, a split, three sigmoids, two tanhs, three products
and a sum) records ~15 nodes per step and runs ~20 kernels; ``lstm_cell`` records one node
and runs the two matmuls plus one kernel that computes all four gates, the new cell state and
the output (the C++ backend's ``lstm_cell_forward``). Its plain backward is one kernel for
the gate gradients plus the matmuls of the weight and input gradients. Devices without the
kernel (CUDA), float16 and NumPy mode compute the same formulas with array ops. With
``create_graph`` the gradient is built from differentiable ops, so gradients of gradients
work as for the unfused cell.

Gate order is i, f, g, o (the course's and PyTorch's): ``z = x W_ih + h W_hh + b_ih + b_hh``
split into four blocks of H columns; ``c' = σ(f)·c + σ(i)·tanh(g)``, ``h' = σ(o)·tanh(c')``.

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import ops
    >>> x, h, c = (ndl.Tensor(np.zeros((2, n))) for n in (3, 4, 4))
    >>> w_ih, w_hh = ndl.Tensor(np.zeros((3, 16))), ndl.Tensor(np.zeros((4, 16)))
    >>> h2, c2 = ops.lstm_cell(x, h, c, w_ih, w_hh)
    >>> h2.shape, float(c2.numpy().sum())
    ((2, 4), 0.0)
"""
from __future__ import annotations

from .._core.errors import ShapeError
from ..autograd import TensorTupleOp
from ..autograd.tensor import const as _leaf
from ..backend_selection import BACKEND
from . import _array as A
from .ops_mathematic import matmul, sigmoid, tanh
from .ops_shape import broadcast_to, reshape, summation, transpose
from .ops_tuple import split, stack

__all__ = ["FusedLSTMCell", "lstm_cell"]

_ND = BACKEND == "nd"


def _check(x, h, c, w_ih, w_hh, biases) -> int:
    """Validates the operand shapes; returns the hidden size H."""
    if len(x.shape) != 2 or len(w_ih.shape) != 2 or len(w_hh.shape) != 2:
        raise ShapeError(f"lstm_cell: expected 2-D x, W_ih, W_hh, got shapes {tuple(x.shape)}, "
                         f"{tuple(w_ih.shape)}, {tuple(w_hh.shape)}")
    batch, hidden = x.shape[0], w_hh.shape[0]
    expected = {"W_ih": (x.shape[1], 4 * hidden), "W_hh": (hidden, 4 * hidden),
                "h": (batch, hidden), "c": (batch, hidden)}
    for name, arr in (("W_ih", w_ih), ("W_hh", w_hh), ("h", h), ("c", c)):
        if tuple(arr.shape) != expected[name]:
            raise ShapeError(f"lstm_cell: {name} has the wrong shape, expected "
                             f"{expected[name]}, got {tuple(arr.shape)}")
    for b in biases:
        if A.size_of(b.shape) != 4 * hidden:
            raise ShapeError(f"lstm_cell: bias has the wrong size, expected {4 * hidden} "
                             f"elements, got shape {tuple(b.shape)}")
    return hidden


def _kernel_module(*arrays):
    """The backend module when it has the fused gate kernels for these arrays, else None."""
    if not _ND:
        return None
    first = arrays[0]
    mod = getattr(first.device, "mod", None)
    if mod is None or not hasattr(mod, "lstm_cell_forward"):
        return None
    if first.dtype not in ("float32", "float64"):
        return None
    return mod


def _gates_forward(z, bias, c):
    """(h', c', gates, tanh(c')) from the preactivation z (B, 4H) without bias."""
    batch, width = z.shape
    hidden = width // 4
    mod = _kernel_module(z)
    if mod is not None:
        from ..backend_ndarray.ndarray import NDArray

        z, c = z.compact(), c.compact()
        make = NDArray.make
        dev, dt = z.device, z.dtype
        h2, c2 = make((batch, hidden), device=dev, dtype=dt), make((batch, hidden), device=dev,
                                                                    dtype=dt)
        gates, tc = make((batch, width), device=dev, dtype=dt), make((batch, hidden), device=dev,
                                                                      dtype=dt)
        mod.lstm_cell_forward(z._handle, None if bias is None else bias.compact()._handle,
                              c._handle, h2._handle, c2._handle, gates._handle, tc._handle,
                              batch, hidden)
        return h2, c2, gates, tc
    pre = z if bias is None else z + A.broadcast_to(A.reshape(bias, (1, width)), z.shape)
    blocks = [A.compact(A.slice_view(pre, (slice(0, batch), slice(q * hidden, (q + 1) * hidden))))
              for q in range(4)]
    i, f, o = A.sigmoid(blocks[0]), A.sigmoid(blocks[1]), A.sigmoid(blocks[3])
    g = A.tanh(blocks[2])
    c2 = f * A.compact(c) + i * g
    tc = A.tanh(c2)
    gates = A.compact(A.reshape(A.stack([i, f, g, o], 1), (batch, width)))
    return o * tc, c2, gates, tc


def _gates_backward(gates, tc, c, dh, dc):
    """(dz (B, 4H), dc_prev (B, H)) from the saved gates, tanh(c') and c and dh', dc'."""
    batch, width = gates.shape
    hidden = width // 4
    mod = _kernel_module(gates)
    if mod is not None:
        from ..backend_ndarray.ndarray import NDArray

        dz = NDArray.make((batch, width), device=gates.device, dtype=gates.dtype)
        dc_prev = NDArray.make((batch, hidden), device=gates.device, dtype=gates.dtype)
        mod.lstm_cell_backward(gates._handle, tc._handle, A.compact(c)._handle,
                               A.compact(dh)._handle, A.compact(dc)._handle, dz._handle,
                               dc_prev._handle, batch, hidden)
        return dz, dc_prev
    i, f, g, o = (A.compact(A.slice_view(gates, (slice(0, batch),
                                                 slice(q * hidden, (q + 1) * hidden))))
                  for q in range(4))
    dct = dc + dh * o * (1 - tc * tc)
    parts = [dct * g * i * (1 - i), dct * A.compact(c) * f * (1 - f), dct * i * (1 - g * g),
             dh * tc * o * (1 - o)]
    return A.compact(A.reshape(A.stack(parts, 1), (batch, width))), dct * f


class FusedLSTMCell(TensorTupleOp):
    """``(h', c')`` of one LSTM step from ``x, h, c, W_ih, W_hh`` and 0-2 bias tensors.

    Besides its inputs (x, h, c and the weights, for the matmul gradients) the node keeps the
    four gate activations and ``tanh(c')`` on the op, computed by the forward kernel, so the
    plain backward runs no activation function again. They are not saved tensors:
    ``saved_tensors_hooks`` (offloading) do not see them.
    """

    save_inputs = (0, 1, 2, 3, 4)

    def __init__(self):
        self.gates = self.tanh_c = None

    def held_arrays(self) -> tuple:
        return tuple(a for a in (self.gates, self.tanh_c) if a is not None)

    def compute(self, x, h, c, w_ih, w_hh, *biases):
        _check(x, h, c, w_ih, w_hh, biases)
        z = A.matmul(x, w_ih) + A.matmul(h, w_hh)
        bias = None
        for b in biases:
            flat = A.reshape(A.compact(b), (A.size_of(b.shape),))
            bias = flat if bias is None else bias + flat
        h2, c2, self.gates, self.tanh_c = _gates_forward(z, bias, c)
        return h2, c2

    def gradient(self, out_grad, node):
        # create_graph: a differentiable composition of Tensor ops
        return _composed_gradient(out_grad, node)

    def plain_gradient(self, out_grad, node):
        # a backward that records no graph: one gate kernel on the kept activations
        x, h, c, w_ih, w_hh = node.saved_tensors
        dh, dc = out_grad.cached_data[0], out_grad.cached_data[1]
        dz, dc_prev = _gates_backward(self.gates, self.tanh_c, c.cached_data, dh, dc)
        need = [t.requires_grad for t in node.inputs]
        grads = [
            _leaf(A.matmul(dz, A.swap_last(w_ih.cached_data))) if need[0] else None,
            _leaf(A.matmul(dz, A.swap_last(w_hh.cached_data))) if need[1] else None,
            _leaf(dc_prev) if need[2] else None,
            _leaf(A.matmul(A.swap_last(x.cached_data), dz)) if need[3] else None,
            _leaf(A.matmul(A.swap_last(h.cached_data), dz)) if need[4] else None,
        ]
        if len(node.inputs) > 5:
            db = A.reduce_sum(dz, (0,))
            for b, wanted in zip(node.inputs[5:], need[5:], strict=True):
                grads.append(_leaf(A.reshape(db, tuple(b.shape))) if wanted else None)
        return tuple(grads)


def _composed_gradient(out_grad, node):
    """The same gradients as Tensor ops (recomputing the gates), so they stay differentiable."""
    x, h, c, w_ih, w_hh = node.inputs[:5]
    biases = node.inputs[5:]
    batch, hidden = h.shape
    z = matmul(x, w_ih) + matmul(h, w_hh)
    for b in biases:
        z = z + broadcast_to(reshape(b, (1, 4 * hidden)), z.shape)
    zi, zf, zg, zo = split(reshape(z, (batch, 4, hidden)), axis=1).tuple()
    i, f, g, o = sigmoid(zi), sigmoid(zf), tanh(zg), sigmoid(zo)
    tc = tanh(f * c + i * g)
    dh, dc = out_grad[0], out_grad[1]
    dct = dc + dh * o * (1 - tc * tc)
    dz = reshape(stack([dct * g * i * (1 - i), dct * c * f * (1 - f), dct * i * (1 - g * g),
                        dh * tc * o * (1 - o)], 1), (batch, 4 * hidden))
    grads = [matmul(dz, transpose(w_ih)), matmul(dz, transpose(w_hh)), dct * f,
             matmul(transpose(x), dz), matmul(transpose(h), dz)]
    db = summation(dz, (0,))
    grads += [reshape(db, tuple(b.shape)) for b in biases]
    return tuple(grads)


def lstm_cell(x, h, c, w_ih, w_hh, *biases):
    """One LSTM step: ``(h', c')`` for input ``x`` (B, I) and state ``h, c`` (B, H).

    ``w_ih`` is (I, 4H), ``w_hh`` (H, 4H), each bias has 4H elements (any shape, e.g. (4H,)
    or (1, 4H)); gate order i, f, g, o.
    """
    out = FusedLSTMCell()(x, h, c, w_ih, w_hh, *biases)
    return out[0], out[1]
