"""Array helpers the ops need, written once per backend (NumPy in np mode, NDArray in nd).

Op ``compute`` methods call only these and the operators common to both array types, so
the op files stay free of ``if BACKEND`` branches (``NEEDLE_BACKEND=np`` computes on
``numpy.ndarray``, ``nd`` on :class:`needle.backend_ndarray.NDArray`).

Example:
    >>> from needle.ops import _array as A
    >>> import numpy as np
    >>> A.sum_to_shape_axes((2, 3, 4), (3, 1))
    ((0, 2), (3, 1))
"""
from __future__ import annotations

import math

import numpy

from .._core.errors import ShapeError
from ..backend_ndarray.ndarray import NDArray as _NDArrayClass
from ..backend_ndarray.ndarray_checks import normalize_axes  # noqa: F401 - the ops' axis check
from ..backend_ndarray.ndarray_functions import broadcast_shapes
from ..backend_selection import BACKEND, NDArray, array_api

ND = BACKEND == "nd"


def broadcast_shape(op: str, a: tuple, b: tuple) -> tuple:
    """NumPy broadcast of two shapes, or :class:`ShapeError` naming ``op`` and both shapes."""
    return broadcast_shapes(tuple(a), tuple(b), op=op)


def sum_to_shape_axes(shape: tuple, target: tuple) -> tuple:
    """Axes of ``shape`` to sum so that the result reshapes to ``target`` (broadcast undo)."""
    lead = len(shape) - len(target)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(target) if n == 1 and shape[lead + i] != 1)
    return axes, tuple(target)


def row_shape(shape) -> tuple:
    """``(1, ..., 1, n)``: a row of ``shape``'s last axis with as many axes (a bias's shape
    against an output, or its gradient's target)."""
    return (1,) * (len(shape) - 1) + (shape[-1],)


def size_of(shape) -> int:
    return math.prod(shape)


def check_row(op: str, what: str, shape, n: int, out_ndim: int) -> None:
    """Raise ``ShapeError`` unless ``shape`` holds ``n`` values along its last axis with at most
    ``out_ndim`` axes: a bias added as a row to every row of an ``out_ndim``-axis output."""
    shape = tuple(shape)
    if size_of(shape) != n or not shape or shape[-1] != n or len(shape) > out_ndim:
        raise ShapeError(f"{op}: bias must hold one value per {what} along its last axis, "
                         f"expected shape ({n},) or (1, {n}), got {shape}")


def row_gradient(g, shape):
    """The gradient of a row of ``shape`` added to every row of an output with gradient
    ``g``: ``g`` summed over every axis but the last, in the row's shape (the composed
    broadcast's gradient, then the reshape's)."""
    return reshape(sum_to_shape(g, row_shape(g.shape)), tuple(shape))


def sum_to_shape(a, shape):
    """Array version of undoing a broadcast: sum ``a`` down to ``shape``."""
    shape, have = tuple(shape), tuple(a.shape)
    if have == shape:
        return a
    axes, target = sum_to_shape_axes(have, shape)
    if axes:
        if len(have) == len(target):  # each summed axis is a 1 of the target: keepdims
            return reduce_sum(a, axes, keepdims=True)
        a = reduce_sum(a, axes)
    return reshape(a, target)


if ND:
    def broadcast_to(a, shape):
        return a.broadcast_to(tuple(shape))

    def reshape(a, shape):
        return a.reshape(tuple(shape))

    def permute(a, axes):
        return a.permute(tuple(axes))

    def swap_last(a):
        """View with the last two axes swapped (ndim >= 2 is known): the same elements,
        so the view needs no bounds check (every matmul backward makes two)."""
        return a.swap_last_axes()

    def reduce_sum(a, axes, keepdims=False):
        return a.sum(axis=axes, keepdims=keepdims)

    def reduce_max(a, axes, keepdims=False):
        return a.max(axis=axes, keepdims=keepdims)

    def as_float(mask, like):
        # NDArray comparisons already give 1.0/0.0 in the operands' dtype
        return mask

    def exp(a):
        return a.exp()

    def log(a):
        return a.log()

    def tanh(a):
        return a.tanh()

    def sqrt(a):
        return a.sqrt()

    def sigmoid(a):
        return a.sigmoid()

    def sign(a):
        return a.sign()

    def tanh_grad(g, t):
        return g.tanh_grad(t)

    def relu_grad(g, r):
        return g.relu_grad(r)

    def maximum(a, b):
        return a.maximum(b)

    def matmul(a, b):
        return array_api.matmul(a, b)

    def add_to_fresh(y, b):
        """``y + b`` written into ``y``, an array the calling op just made (no one else
        holds it); ``b`` of ``y``'s shape, any layout (a broadcast row is read in place,
        see ``NDArray._add_in_place``). Saves the op one output-sized buffer."""
        if type(y) is not _NDArrayClass or type(b) is not _NDArrayClass \
                or not y.is_compact():
            return y + b  # (a product returned as a view: the plain sum)
        y._add_in_place(b)
        return y

    def add_row_to_fresh(y, row):
        """``y + row`` with ``row`` (``y.shape[-1]`` values, shaped ``(n,)`` or ``(1, ..., n)``)
        added to every row of ``y``, written into ``y``, an array the calling op just made:
        a linear layer's bias, read from its row without a broadcast view."""
        if type(y) is not _NDArrayClass or type(row) is not _NDArrayClass \
                or not y.is_compact():
            return add_to_fresh(y, broadcast_to(reshape(row, row_shape(y.shape)), y.shape))
        y._add_row_in_place(row)
        return y

    def zeros(shape, like):
        return like.device.full(tuple(shape), 0.0, like.dtype)

    def astype(a, dtype):
        return a.astype(dtype)

    def flip(a, axes):
        return a.flip(axes)

    def pad(a, pads):
        return a.pad(pads)

    def stack(arrays, axis):
        return array_api.stack(arrays, axis)

    def split(a, axis):
        return array_api.split(a, axis)

    def strided_view(a, shape, strides):
        """A view with ``strides`` in elements over the compact ``a``."""
        return a.compact().as_strided(shape, strides)

    def compact(a):
        return a.compact()

    def slice_view(a, index):
        return a[index]

    def to_device(a, device):
        return a.to(device)

    def take_rows(a, rows):
        """``a[rows]`` for a 2-D array and an integer NumPy index array of any shape."""
        host = a.numpy()[rows]
        return NDArray(host, device=a.device, dtype=a.dtype)

    def to_numpy(a):
        return a.numpy()

    def from_numpy_like(host, like):
        return NDArray(host, device=like.device, dtype=like.dtype)

    def col2im_add(target, cols, stride: int) -> None:
        """Scatter-add im2col columns (N, H', W', K, K, C) into ``target`` (N, Hp, Wp, C)."""
        n, ho, wo, kh, kw, c = cols.shape
        for i in range(kh):
            for j in range(kw):
                index = (slice(None), slice(i, i + stride * (ho - 1) + 1, stride),
                         slice(j, j + stride * (wo - 1) + 1, stride), slice(None))
                part = cols[:, :, :, i, j, :].compact().reshape((n, ho, wo, c))
                target[index] = target[index] + part
else:
    def broadcast_to(a, shape):
        return numpy.broadcast_to(a, tuple(shape))

    def reshape(a, shape):
        return numpy.reshape(a, tuple(shape))

    def permute(a, axes):
        return numpy.transpose(a, tuple(axes))

    def swap_last(a):
        return numpy.swapaxes(a, -1, -2)

    def reduce_sum(a, axes, keepdims=False):
        return numpy.sum(a, axis=axes, keepdims=keepdims)

    def reduce_max(a, axes, keepdims=False):
        return numpy.max(a, axis=axes, keepdims=keepdims)

    def as_float(mask, like):
        return mask.astype(like.dtype)

    exp, log, tanh, sqrt = numpy.exp, numpy.log, numpy.tanh, numpy.sqrt
    maximum, matmul = numpy.maximum, numpy.matmul

    def add_to_fresh(y, b):
        # NumPy mode: a new array, as the composed ops give (np mode lets dtypes promote)
        return y + b

    def add_row_to_fresh(y, row):
        return y + numpy.reshape(row, row_shape(y.shape))

    def sign(a):
        return numpy.sign(a)

    def tanh_grad(g, t):
        return g * (1 - t * t)

    def relu_grad(g, r):
        return g * numpy.sign(r)

    def sigmoid(a):
        # split by sign so exp never overflows
        e = numpy.exp(-numpy.abs(a))
        return numpy.where(a >= 0, 1 / (1 + e), e / (1 + e)).astype(a.dtype)

    def zeros(shape, like):
        return numpy.zeros(tuple(shape), dtype=like.dtype)

    def astype(a, dtype):
        return a.astype(dtype)

    def flip(a, axes):
        return numpy.ascontiguousarray(numpy.flip(a, axes))

    def pad(a, pads):
        return numpy.pad(a, pads)

    def stack(arrays, axis):
        return numpy.stack(arrays, axis)

    def split(a, axis):
        return tuple(numpy.ascontiguousarray(x) for x in numpy.moveaxis(a, axis, 0))

    def strided_view(a, shape, strides):
        a = numpy.ascontiguousarray(a)
        item = a.itemsize
        return numpy.lib.stride_tricks.as_strided(
            a, shape=tuple(shape), strides=tuple(s * item for s in strides), writeable=False)

    def compact(a):
        # ascontiguousarray would turn a 0-d array into shape (1,)
        return numpy.ascontiguousarray(a) if a.ndim else a

    def slice_view(a, index):
        return a[index]

    def to_device(a, device):
        return a

    def take_rows(a, rows):
        return a[rows]

    def to_numpy(a):
        return a

    def from_numpy_like(host, like):
        return host.astype(like.dtype, copy=False)

    def col2im_add(target, cols, stride: int) -> None:
        n, ho, wo, kh, kw, c = cols.shape
        for i in range(kh):
            for j in range(kw):
                target[:, i:i + stride * (ho - 1) + 1:stride,
                       j:j + stride * (wo - 1) + 1:stride, :] += cols[:, :, :, i, j, :]


compact_strides = _NDArrayClass.compact_strides  # row-major strides (pure; both modes)
