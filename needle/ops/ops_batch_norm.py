"""Batch normalisation in training mode as one graph node: ``batch_norm``.

``BatchNorm1d``/``BatchNorm2d`` composed from ops record ~12 nodes per call (two reductions,
broadcasts, a subtraction, a power, products) and, for an NCHW input, two transposes that copy
the activation each way; their backward runs ~20 kernels more. ``batch_norm`` records one node:
the C++ backend's ``batch_norm_forward`` computes the per-channel batch mean, biased variance
and ``1/sqrt(var + eps)`` and writes ``y = w (x - mean) / sqrt(var + eps) + b`` in two reads
of ``x``; the plain backward is one ``batch_norm_backward`` kernel. Channels are axis 1: ``x``
is ``(N, C)`` or ``(N, C, d1, ...)`` (NCHW), statistics are over every other axis.

Devices without the kernels (CUDA), float16 and NumPy mode compute the same formulas with
array ops. With ``create_graph`` the gradient is built from differentiable ops that recompute
the statistics from ``x``, so gradients of gradients are exact.

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import ops
    >>> x = ndl.Tensor(np.array([[1.0, 10.0], [3.0, 30.0]]))
    >>> w, b = ndl.Tensor(np.ones(2)), ndl.Tensor(np.zeros(2))
    >>> y, mean, var = ops.batch_norm(x, w, b, eps=0.0)
    >>> y.numpy().tolist(), mean.numpy().tolist(), var.numpy().tolist()
    ([[-1.0, -1.0], [1.0, 1.0]], [2.0, 20.0], [1.0, 100.0])
"""
from __future__ import annotations

import math

from .._core.errors import ShapeError
from ..autograd import TensorOp
from ..autograd.tensor import const as _leaf
from ..backend_ndarray.ndarray import NDArray, _alloc, _view
from ..backend_selection import BACKEND
from . import _array as A
from .ops_shape import broadcast_to, reshape, summation

__all__ = ["FusedBatchNorm", "batch_norm", "batch_norm_arrays", "batch_norm_has_kernel"]

_ND = BACKEND == "nd"


def _layout(op: str, shape, channels: int) -> tuple:
    """(N, C, S) of an input of ``shape`` with channels on axis 1, validated."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ShapeError(f"{op}: expected an input of at least 2 dims (batch, channels, ...), "
                         f"got shape {shape}")
    n, c, s = shape[0], shape[1], math.prod(shape[2:])
    if c != channels:
        raise ShapeError(f"{op}: weight and bias must have one value per channel, expected "
                         f"{c} (axis 1 of the input), got {channels}")
    if n * s == 0:
        raise ShapeError(f"{op}: expected at least one value per channel, got input shape "
                         f"{shape}")
    return n, c, s


def _kernel_module(x):
    """The backend module when it has the batch-norm kernels for ``x``'s dtype, else None."""
    if not _ND:
        return None
    if type(x) is NDArray:  # read from the fields: this runs three times per layer and step
        device, dtype = x._device, x._handle.dtype
    else:
        device, dtype = x.device, x.dtype
    mod = getattr(device, "mod", None)
    if mod is None or not hasattr(mod, "batch_norm_forward"):
        return None
    return mod if dtype in ("float32", "float64") else None


def batch_norm_has_kernel(x) -> bool:
    """True when ``x`` (a Tensor) would run the fused kernels, not the composed array ops."""
    return _kernel_module(x.realize_cached_data()) is not None


def _channels_last(x) -> tuple | None:
    """The axes listing ``x`` (N, C, d1, ...) as (N, d1, ..., C) when that is how its buffer
    is laid out (the NCHW view of an NHWC convolution output), else None."""
    if len(x.shape) < 3 or x.is_compact() or not x.is_dense():
        return None
    axes = (0,) + tuple(range(2, len(x.shape))) + (1,)
    return axes if x.permute(axes).is_compact() else None


def _like(flat, x):
    """``flat`` (a fresh buffer holding values in ``x``'s memory order) viewed as ``x`` is.

    ``x`` is dense (compact, or channels-last), so its strides reach exactly ``flat``'s
    elements: the view needs no bounds check (kernel paths only, nd mode)."""
    return _view(tuple(x.shape), tuple(x.strides), 0, x.device, flat._handle)


def _empty(shape: tuple, like):
    """A fresh compact array of ``like``'s device and dtype for a kernel to write (kernel
    paths only: ``like`` is an NDArray, the shape a tuple of ints already validated)."""
    return _alloc(shape, like._device, like._handle.dtype, "batch_norm")


def _forward_arrays(x, w, b, n, c, s, eps, relu: bool = False):
    """(y, mean, var, invstd) as arrays, by the kernel or composed from array ops; with
    ``relu``, ``y`` is ``max(y, 0)`` (in the kernel where the backend fuses it)."""
    mod = _kernel_module(x)
    if relu:
        if mod is not None and getattr(mod, "batch_norm_fuses_relu", False):
            return _forward_kernel(mod, x, w, b, n, c, s, eps, True)
        y, mean, var, invstd = _forward_arrays(x, w, b, n, c, s, eps)
        return A.maximum(y, 0), mean, var, invstd  # what nn.ReLU computes
    if mod is not None:
        return _forward_kernel(mod, x, w, b, n, c, s, eps, False)
    count = n * s
    xs = A.reshape(A.compact(x), (n, c, s))
    mean = A.reduce_sum(xs, (0, 2)) / count
    xc = xs - A.broadcast_to(A.reshape(mean, (1, c, 1)), (n, c, s))
    var = A.reduce_sum(xc * xc, (0, 2)) / count
    invstd = 1 / A.sqrt(var + eps)
    scale = A.reshape(A.reshape(A.compact(w), (c,)) * invstd, (1, c, 1))
    shift = A.reshape(A.compact(b), (1, c, 1))
    y = xc * A.broadcast_to(scale, (n, c, s)) + A.broadcast_to(shift, (n, c, s))
    return A.reshape(y, tuple(x.shape)), mean, var, invstd


def _forward_kernel(mod, x, w, b, n, c, s, eps, relu: bool):
    """:func:`_forward_arrays` through the backend's ``batch_norm_forward``."""
    # A channels-last buffer is (N*d1*..., C) rows: the kernel's S = 1 case, no copy, and y
    # keeps that layout (the next convolution reads it without a transpose).
    last = _channels_last(x)
    rows = (n * s, c, 1) if last is not None else (n, c, s)
    if last is None:  # row-major: y is a compact array of x's shape, no view needed
        x = x.compact()
        y = _empty(x._shape, x)
    else:
        y = _empty((n * c * s,), x)
    mean, var, invstd = _empty((c,), x), _empty((c,), x), _empty((c,), x)
    extra = {"relu": True} if relu else {}
    mod.batch_norm_forward(x._handle, A.compact(w)._handle, A.compact(b)._handle, y._handle,
                           mean._handle, var._handle, invstd._handle, *rows, float(eps),
                           **extra)
    return (y if last is None else _like(y, x)), mean, var, invstd


def _backward_arrays(dy, x, w, mean, invstd, n, c, s, out=None):
    """(dx, dw, db) as arrays, by the kernel or composed from array ops; dx has ``x``'s
    layout. ``out``: the output of a batch norm fused with a ReLU, whose mask ``dy`` takes
    first (as ``nn.ReLU``'s backward does)."""
    mod = _kernel_module(x)
    if out is not None and (mod is None or not getattr(mod, "batch_norm_fuses_relu", False)):
        dy, out = A.relu_grad(dy, out), None
    if mod is not None:
        extra = ()  # the ReLU's output, positional: a buffer (needle.compile records it)
        last = _channels_last(x)
        if last is not None:
            rows = (n * s, c, 1)
            dy = dy.permute(last).compact()  # no copy when dy has x's layout
            if out is not None:
                extra = (out.permute(last).compact()._handle,)
            dx = _empty((n * c * s,), x)
        else:
            rows = (n, c, s)
            x, dy = x.compact(), dy.compact()
            if out is not None:
                extra = (out.compact()._handle,)
            dx = _empty(x._shape, x)  # compact in x's shape: no view needed
        dw, db = _empty((c,), x), _empty((c,), x)
        mod.batch_norm_backward(dy._handle, x._handle, A.compact(w)._handle, mean._handle,
                                invstd._handle, dx._handle, dw._handle, db._handle, *rows,
                                *extra)
        return (dx if last is None else _like(dx, x)), dw, db
    full, per = (n, c, s), (1, c, 1)
    count = n * s
    g = A.reshape(A.compact(dy), full)
    xhat = (A.reshape(A.compact(x), full) - A.broadcast_to(A.reshape(mean, per), full)) \
        * A.broadcast_to(A.reshape(invstd, per), full)
    db = A.reduce_sum(g, (0, 2))
    dw = A.reduce_sum(g * xhat, (0, 2))
    k1 = A.broadcast_to(A.reshape(A.reshape(A.compact(w), (c,)) * invstd, per), full)
    dx = k1 * (g - A.broadcast_to(A.reshape(db / count, per), full)
               - xhat * A.broadcast_to(A.reshape(dw / count, per), full))
    return A.reshape(dx, tuple(x.shape)), dw, db


class FusedBatchNorm(TensorOp):
    """``y`` of training-mode batch norm from ``x, weight, bias`` (module docstring).

    The batch statistics of the last call are kept on the op (``mean``, ``var``, ``invstd``,
    arrays of C values; :func:`batch_norm` hands ``var`` to its caller and drops it): the
    plain backward reads ``mean`` and ``invstd`` instead of reducing ``x`` again, and the
    module updates its running statistics from ``mean`` and ``var``.

    ``relu=True``: ``y = max(batch_norm(x), 0)`` in the same node, bit for bit
    ``nn.ReLU`` after the batch norm (the ReLU's node, kernels and buffers saved where the
    backend fuses it into its batch-norm kernels); the output is saved for the ReLU's mask.
    """

    save_inputs = (0, 1)

    def __init__(self, eps: float = 1e-5, relu: bool = False):
        self.eps = float(eps)
        self.relu = bool(relu)
        if self.relu:
            self.save_output = True  # the mask of the ReLU's backward is read from y
        self.mean = self.var = self.invstd = None

    def compute(self, x, w, b):
        n, c, s = _layout("batch_norm", x.shape, A.size_of(w.shape))
        if A.size_of(b.shape) != c:
            raise ShapeError(f"batch_norm: bias must have one value per channel, expected {c}, "
                             f"got shape {tuple(b.shape)}")
        y, self.mean, self.var, self.invstd = _forward_arrays(x, w, b, n, c, s, self.eps,
                                                              self.relu)
        return y

    def held_arrays(self) -> tuple:
        return tuple(a for a in (self.mean, self.var, self.invstd) if a is not None)

    def release_held(self) -> None:
        self.mean = self.var = self.invstd = None

    def plain_gradient(self, out_grad, node):
        x, w, *out = node.saved_tensors
        xd = x.cached_data
        n, c, s = _layout("batch_norm", xd.shape, A.size_of(w.shape))
        dx, dw, db = _backward_arrays(out_grad.cached_data, xd, w.cached_data, self.mean,
                                      self.invstd, n, c, s,
                                      out[0].realize_cached_data() if out else None)
        need = [t.requires_grad for t in node.inputs]
        b_shape = tuple(node.inputs[2].shape)
        return (_leaf(dx) if need[0] else None,
                _leaf(A.reshape(dw, tuple(w.shape))) if need[1] else None,
                _leaf(A.reshape(db, b_shape)) if need[2] else None)

    def gradient(self, out_grad, node):
        # create_graph: differentiable ops, the statistics recomputed from x
        x, w, b = node.inputs
        if self.relu:  # nn.ReLU's gradient: out >= 0, so sign(out) is the mask x > 0
            out = node.saved_tensors[2]
            out_grad = out_grad * _leaf(A.sign(out.realize_cached_data()))
        shape = tuple(x.shape)
        n, c, s = _layout("batch_norm", shape, A.size_of(w.shape))
        count = n * s
        per = (1, c) + (1,) * (len(shape) - 2)
        axes = (0,) + tuple(range(2, len(shape)))

        def spread(v):
            return broadcast_to(reshape(v, per), shape)

        mean = summation(x, axes) / count
        xc = x - spread(mean)
        invstd = (summation(xc * xc, axes) / count + self.eps) ** -0.5
        xhat = xc * spread(invstd)
        db = summation(out_grad, axes)
        dw = summation(out_grad * xhat, axes)
        dx = spread(reshape(w, (c,)) * invstd / count) * (
            out_grad * count - spread(db) - xhat * spread(dw))
        return dx, reshape(dw, tuple(w.shape)), reshape(db, tuple(b.shape))


def batch_norm(x, weight, bias, eps: float = 1e-5, relu: bool = False):
    """Training-mode batch norm over axis 1: ``(y, batch_mean, batch_var)``.

    ``x`` is ``(N, C)`` or ``(N, C, ...)``; ``weight`` and ``bias`` hold C values. The
    statistics are over every axis but 1, the variance biased (divided by the count), and
    come back as constant Tensors of shape ``(C,)`` (for running averages). ``relu``:
    ``y = max(y, 0)`` in the same node (see :class:`FusedBatchNorm`).

    Raises:
        ShapeError: fewer than 2 dims, no values per channel, or weight/bias sizes that are
            not C.
    """
    y, mean, var = batch_norm_arrays(x, weight, bias, eps, relu)
    return y, _leaf(mean), _leaf(var)


def batch_norm_arrays(x, weight, bias, eps: float = 1e-5, relu: bool = False):
    """:func:`batch_norm` with the statistics as arrays, not Tensors: ``(y, mean, var)``
    (what ``BatchNorm1d``/``2d`` read for their running averages, two Tensors fewer per
    call)."""
    op = FusedBatchNorm(eps, relu)
    y = op(x, weight, bias)
    var, op.var = op.var, None  # backward needs mean and invstd only: the caller owns var
    return y, op.mean, var
