"""``logsoftmax`` and ``logsumexp``, max-shifted so forward and backward stay finite.

Example:
    >>> import needle as ndl
    >>> x = ndl.Tensor([[1e10, 1e10]], dtype="float64")
    >>> round(float(ndl.logsumexp(x, axes=1).numpy()[0]) - 1e10, 4)  # 1e10 + log(2)
    0.6931
"""
from __future__ import annotations

import numpy

from ..autograd import Tensor, TensorOp
from . import _array as A
from .ops_mathematic import exp
from .ops_shape import BroadcastTo, Reshape, Summation


def _kept(shape, axes):
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


def _lse_keepdims(z, axes):
    """log Σ exp(z) over ``axes`` with kept dims, shifted by the max for stability."""
    m = A.reduce_max(z, axes, keepdims=True)
    # an infinite max would shift by inf - inf = NaN: clamp it to the largest finite value,
    # so all -inf gives -inf and any +inf gives +inf (as NumPy and PyTorch do)
    big = float(numpy.finfo(str(m.dtype)).max)
    m = -A.maximum(-A.maximum(m, -big), -big)
    shifted = z - A.broadcast_to(m, z.shape)
    return A.log(A.reduce_sum(A.exp(shifted), axes, keepdims=True)) + m


class LogSoftmax(TensorOp):
    """``z − logsumexp(z)`` over the last axis (axis 1 of the course's 2-D inputs)."""

    save_inputs = ()
    save_output = True

    def compute(self, z):
        axes = (len(z.shape) - 1,)
        return z - A.broadcast_to(_lse_keepdims(z, axes), z.shape)

    def gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        shape = out.shape
        kept = shape[:-1] + (1,)
        total = BroadcastTo(shape)(Reshape(kept)(Summation((len(shape) - 1,))(out_grad)))
        return out_grad - exp(out) * total


def logsoftmax(a):
    return LogSoftmax()(a)


class LogSumExp(TensorOp):
    """``log Σ exp`` over ``axes`` (None / int / tuple); output shape as ``summation``."""

    def __init__(self, axes=None):
        self.axes = axes

    def compute(self, z):
        axes = A.normalize_axes(self.axes, len(z.shape), "logsumexp")
        out = _lse_keepdims(z, axes)
        return A.reshape(out, tuple(n for i, n in enumerate(z.shape) if i not in axes))

    def gradient(self, out_grad, node):
        (z,) = node.saved_tensors
        shape = z.shape
        axes = A.normalize_axes(self.axes, len(shape), "logsumexp")
        kept = _kept(shape, axes)
        # softmax as exp(z - max) / sum: exact weights even where lse itself rounds (1e10 in
        # float32); the shift is a constant, so the expression stays differentiable in z
        data = z.realize_cached_data()
        shift = Tensor.make_const(A.broadcast_to(A.reduce_max(data, axes, keepdims=True), shape))
        e = exp(z - shift)
        total = BroadcastTo(shape)(Reshape(kept)(Summation(axes)(e)))
        return BroadcastTo(shape)(Reshape(kept)(out_grad)) * e / total


def logsumexp(a, axes=None):
    return LogSumExp(axes=axes)(a)
