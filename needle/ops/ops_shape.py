"""Shape ops: reshape, broadcast, transpose/permute, reductions, slicing, flip, dilate, casts.

Example:
    >>> import needle as ndl
    >>> x = ndl.Tensor([[1.0, 5.0], [7.0, 2.0]])
    >>> ndl.max(x, axes=1).numpy().tolist(), x[1].numpy().tolist()
    ([5.0, 7.0], [7.0, 2.0])
"""
from __future__ import annotations

import builtins

from .._core.errors import IndexOutOfRange, ShapeError
from ..autograd import Tensor, TensorOp
from . import _array as A


def sum_to_shape(grad, shape):
    """Sum ``grad`` over broadcast axes so it has ``shape`` (identity when it already has)."""
    shape = tuple(shape)
    have = tuple(grad.realize_cached_data().shape)
    if have == shape:
        return grad
    axes, target = A.sum_to_shape_axes(have, shape)
    if axes:
        grad = Summation(axes)(grad)
    return Reshape(target)(grad) if tuple(grad.shape) != target else grad


class Reshape(TensorOp):
    """Reshape; one dimension may be -1."""

    save_inputs = ()

    def __init__(self, shape):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)

    def compute(self, a):
        if -1 not in self.shape and A.size_of(self.shape) != A.size_of(a.shape):
            raise ShapeError(
                f"reshape: size differs, expected {A.size_of(a.shape)} elements "
                f"({tuple(a.shape)}), got {A.size_of(self.shape)} ({self.shape})")
        return A.reshape(A.compact(a), self.shape)

    def gradient(self, out_grad, node):
        return Reshape(node.inputs[0].shape)(out_grad)

    def plain_gradient(self, out_grad, node):
        data = A.reshape(A.compact(out_grad.cached_data), node.inputs[0].shape)
        return Tensor.make_const(data)


def reshape(a, shape):
    return Reshape(shape)(a)


class BroadcastTo(TensorOp):
    """NumPy broadcasting to ``shape``; the gradient sums back over broadcast axes."""

    save_inputs = ()

    def __init__(self, shape):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)

    def compute(self, a):
        if tuple(a.shape) == self.shape:
            return a
        if A.broadcast_shape("broadcast_to", a.shape, self.shape) != self.shape:
            raise ShapeError(
                f"broadcast_to: cannot broadcast, expected a shape that broadcasts to "
                f"{self.shape}, got {tuple(a.shape)}")
        return A.broadcast_to(a, self.shape)

    def gradient(self, out_grad, node):
        return sum_to_shape(out_grad, node.inputs[0].shape)

    def plain_gradient(self, out_grad, node):
        return Tensor.make_const(A.sum_to_shape(out_grad.cached_data, node.inputs[0].shape))


def broadcast_to(a, shape):
    return BroadcastTo(shape)(a)


class Permute(TensorOp):
    """Reorder axes: output axis ``i`` is input axis ``axes[i]``."""

    save_inputs = ()

    def __init__(self, axes):
        self.axes = tuple(axes)

    def compute(self, a):
        if sorted(x % builtins.max(len(a.shape), 1) for x in self.axes) != list(
                range(len(a.shape))):
            raise ShapeError(
                f"permute: expected a permutation of {tuple(range(len(a.shape)))}, got "
                f"{self.axes}")
        return A.permute(a, self.axes)

    def gradient(self, out_grad, node):
        ndim = len(self.axes)
        inverse = [0] * ndim
        for i, axis in enumerate(self.axes):
            inverse[axis % ndim] = i
        return Permute(inverse)(out_grad)


def permute(a, axes):
    return Permute(axes)(a)


class Transpose(TensorOp):
    """Swap two axes: ``axes=(i, j)``; ``None`` swaps the last two (course semantics)."""

    save_inputs = ()

    def __init__(self, axes=None):
        self.axes = None if axes is None else tuple(axes)

    def _perm(self, ndim: int) -> list:
        i, j = (-2, -1) if self.axes is None else self.axes
        if ndim < 2 or not (-ndim <= i < ndim and -ndim <= j < ndim):
            raise ShapeError(
                f"transpose: axes out of range, expected two axes of a tensor with ndim >= 2, "
                f"got axes {self.axes} for ndim {ndim}")
        perm = list(range(ndim))
        perm[i], perm[j] = perm[j], perm[i]
        return perm

    def compute(self, a):
        if self.axes is not None and len(self.axes) != 2:
            raise ShapeError(f"transpose: expected two axes to swap, got {self.axes}")
        return A.permute(a, self._perm(len(a.shape)))

    def gradient(self, out_grad, node):
        return Transpose(self.axes)(out_grad)


def transpose(a, axes=None):
    return Transpose(axes)(a)


def _kept_shape(shape: tuple, axes: tuple) -> tuple:
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


class Summation(TensorOp):
    """Sum over ``axes`` (None = all, int or tuple); reduced axes are removed."""

    save_inputs = ()

    def __init__(self, axes=None):
        self.axes = axes

    def compute(self, a):
        axes = A.normalize_axes(self.axes, len(a.shape), "summation")
        if not axes:
            return a
        return A.reduce_sum(a, axes)

    def gradient(self, out_grad, node):
        shape = node.inputs[0].shape
        axes = A.normalize_axes(self.axes, len(shape), "summation")
        return BroadcastTo(shape)(Reshape(_kept_shape(shape, axes))(out_grad))

    def plain_gradient(self, out_grad, node):
        shape = node.inputs[0].shape
        axes = A.normalize_axes(self.axes, len(shape), "summation")
        kept = A.reshape(A.compact(out_grad.cached_data), _kept_shape(shape, axes))
        return Tensor.make_const(A.broadcast_to(kept, shape))


def summation(a, axes=None, keepdims=False):
    """Sum over ``axes`` (None: all); ``keepdims`` keeps each summed axis with length 1."""
    out = Summation(axes)(a)
    if not keepdims:
        return out
    shape = a.shape
    return Reshape(_kept_shape(shape, A.normalize_axes(axes, len(shape), "summation")))(out)


def mean(a, axes=None, keepdims=False):
    """Mean over ``axes`` (composite of summation and a scalar divide)."""
    shape = a.shape
    norm = A.normalize_axes(axes, len(shape), "mean")
    count = A.size_of([shape[i] for i in norm])
    out = Summation(norm)(a) / count
    return Reshape(_kept_shape(shape, norm))(out) if keepdims else out


class Max(TensorOp):
    """Maximum over ``axes``; the gradient is shared evenly among tied maxima."""

    save_output = True

    def __init__(self, axes=None, keepdims=False):
        self.axes, self.keepdims = axes, keepdims

    def compute(self, a):
        axes = A.normalize_axes(self.axes, len(a.shape), "max")
        if not axes:
            return a
        return A.reduce_max(a, axes, self.keepdims)

    def gradient(self, out_grad, node):
        a, out = node.saved_tensors
        shape = a.shape
        kept = _kept_shape(shape, A.normalize_axes(self.axes, len(shape), "max"))
        x = a.realize_cached_data()
        m = A.broadcast_to(A.reshape(A.compact(out.realize_cached_data()), kept), shape)
        mask = A.as_float(x == m, x)
        axes = A.normalize_axes(self.axes, len(shape), "max")
        count = A.broadcast_to(A.reduce_sum(mask, axes, keepdims=True), shape)
        weight = Tensor.make_const(mask / count)
        return BroadcastTo(shape)(Reshape(kept)(out_grad)) * weight


def max(a, axes=None, keepdims=False):  # noqa: A001 - the name users expect (ndl.max)
    return Max(axes, keepdims)(a)


def _parse_index(key, shape: tuple):
    """Basic indexing → (per-dim slices, result shape); ints drop their dimension."""
    key = key if isinstance(key, tuple) else (key,)
    if builtins.sum(k is Ellipsis for k in key) > 1:
        raise IndexOutOfRange(f"getitem: expected at most one '...', got {key}")
    if Ellipsis in key:
        at = key.index(Ellipsis)
        fill = len(shape) - (len(key) - 1)
        key = key[:at] + (slice(None),) * fill + key[at + 1:]
    if len(key) > len(shape):
        raise IndexOutOfRange(
            f"getitem: too many indices, expected at most {len(shape)}, got {len(key)}")
    key = key + (slice(None),) * (len(shape) - len(key))
    slices, out_shape = [], []
    for dim, (k, n) in enumerate(zip(key, shape, strict=True)):
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            if step < 0:
                raise IndexOutOfRange(
                    f"getitem: negative steps unsupported, expected step > 0, got {step} on "
                    f"axis {dim} (use ndl.flip)")
            slices.append(slice(start, stop, step))
            out_shape.append(len(range(start, stop, step)))
        elif (isinstance(k, int) or hasattr(k, "__index__") and not hasattr(k, "shape")) and (
                not isinstance(k, bool)):  # True is not "index 1"
            k = int(k)
            if not -n <= k < n:
                raise IndexOutOfRange(
                    f"getitem: index out of range on axis {dim}, expected [{-n}, {n}), got {k}")
            k %= n
            slices.append(slice(k, k + 1, 1))
        else:
            raise IndexOutOfRange(
                f"getitem: unsupported index, expected int, slice or '...', got "
                f"{type(k).__name__}")
    return tuple(slices), tuple(out_shape)


def _view_shape(slices) -> tuple:
    return tuple(len(range(s.start, s.stop, s.step)) for s in slices)


class GetItem(TensorOp):
    """Basic slicing (``slices``: one explicit slice per dim) reshaped to ``shape``."""

    save_inputs = ()

    def __init__(self, slices, shape):
        self.slices, self.shape = tuple(slices), tuple(shape)

    def compute(self, a):
        return A.reshape(A.compact(A.slice_view(a, self.slices)), self.shape)

    def gradient(self, out_grad, node):
        grad = Reshape(_view_shape(self.slices))(out_grad)
        return SliceScatter(self.slices, node.inputs[0].shape)(grad)


def get_item(a, key):
    """``a[key]`` for ints, slices (step > 0) and ``...``; differentiable."""
    slices, shape = _parse_index(key, a.shape)
    return GetItem(slices, shape)(a)


class SliceScatter(TensorOp):
    """Zeros of ``shape`` with the input written into the ``slices`` region (GetItem's grad)."""

    save_inputs = ()

    def __init__(self, slices, shape):
        self.slices, self.shape = tuple(slices), tuple(shape)

    def compute(self, a):
        out = A.zeros(self.shape, a)
        out[self.slices] = A.compact(a)
        return out

    def gradient(self, out_grad, node):
        return GetItem(self.slices, _view_shape(self.slices))(out_grad)


class Flip(TensorOp):
    save_inputs = ()

    def __init__(self, axes):
        self.axes = (axes,) if isinstance(axes, int) else tuple(axes)

    def compute(self, a):
        A.normalize_axes(self.axes, len(a.shape), "flip")
        return A.flip(a, self.axes)

    def gradient(self, out_grad, node):
        return Flip(self.axes)(out_grad)


def flip(a, axes):
    return Flip(axes)(a)


def _dilate_slices(shape, axes, dilation):
    axes = {ax % len(shape) for ax in axes if -len(shape) <= ax < len(shape)}
    return tuple(slice(0, n * (dilation + 1), dilation + 1) if i in axes else slice(0, n, 1)
                 for i, n in enumerate(shape))


class Dilate(TensorOp):
    """Insert ``dilation`` zeros after every element along each of ``axes`` (n → n·(1+d))."""

    save_inputs = ()

    def __init__(self, axes, dilation):
        self.axes = (axes,) if isinstance(axes, int) else tuple(axes)
        self.dilation = int(dilation)

    def compute(self, a):
        if self.dilation == 0:
            return a
        slices = _dilate_slices(a.shape, self.axes, self.dilation)
        shape = tuple(s.stop for s in slices)
        out = A.zeros(shape, a)
        out[slices] = A.compact(a)
        return out

    def gradient(self, out_grad, node):
        return UnDilate(self.axes, self.dilation)(out_grad)


def dilate(a, axes, dilation):
    return Dilate(axes, dilation)(a)


class UnDilate(TensorOp):
    """Keep every ``(dilation+1)``-th element along each of ``axes`` (inverse of Dilate)."""

    save_inputs = ()

    def __init__(self, axes, dilation):
        self.axes = (axes,) if isinstance(axes, int) else tuple(axes)
        self.dilation = int(dilation)

    def _slices(self, shape):
        step = self.dilation + 1
        axes = {ax % len(shape) for ax in self.axes if -len(shape) <= ax < len(shape)}
        return tuple(slice(0, n, step) if i in axes else slice(0, n, 1)
                     for i, n in enumerate(shape))

    def compute(self, a):
        if self.dilation == 0:
            return a
        return A.compact(A.slice_view(a, self._slices(a.shape)))

    def gradient(self, out_grad, node):
        if self.dilation == 0:
            return out_grad
        return SliceScatter(self._slices(node.inputs[0].shape), node.inputs[0].shape)(out_grad)


def undilate(a, axes, dilation):
    return UnDilate(axes, dilation)(a)


class Cast(TensorOp):
    """Convert to ``dtype``; the gradient converts back to the input's dtype."""

    save_inputs = ()

    def __init__(self, dtype):
        self.dtype = dtype

    def compute(self, a):
        return A.astype(a, self.dtype)

    def gradient(self, out_grad, node):
        return Cast(node.inputs[0].dtype)(out_grad)


def astype(a, dtype):
    if a.dtype == dtype:
        return a
    return Cast(dtype)(a)


class ToDevice(TensorOp):
    """Move to ``device``; the gradient moves back."""

    save_inputs = ()

    def __init__(self, device):
        self.device = device

    def compute(self, a):
        return A.to_device(a, self.device)

    def gradient(self, out_grad, node):
        return ToDevice(node.inputs[0].device)(out_grad)


def to_device(a, device):
    return ToDevice(device)(a)
