"""Ops on TensorTuples: ``make_tuple``, ``tuple_get_item``, ``stack``, ``split``,
``fused_add_scalars``.

Example:
    >>> import needle as ndl
    >>> a, b = ndl.Tensor([1.0, 2.0]), ndl.Tensor([3.0, 4.0])
    >>> s = ndl.stack([a, b], axis=0); s.shape, len(ndl.split(s, 0))
    ((2, 2), 2)
"""
from __future__ import annotations

from .._core.errors import IndexOutOfRange, ShapeError
from ..autograd import SparseTupleGrad, Tensor, TensorOp, TensorTuple, TensorTupleOp
from . import _array as A
from .ops_mathematic import as_scalar


class MakeTensorTuple(TensorTupleOp):
    save_inputs = ()

    def compute(self, *args):
        return tuple(args)

    def gradient(self, out_grad, node):
        return tuple(out_grad[i] for i in range(len(out_grad)))


def make_tuple(*args):
    return MakeTensorTuple()(*args)


class TupleGetItem(TensorOp):
    save_inputs = ()

    def __init__(self, index):
        self.index = index

    def __call__(self, a, fold_const=True):
        if not isinstance(a, TensorTuple):
            raise ShapeError(
                f"tuple_get_item: expected a TensorTuple, got {type(a).__name__}")
        n = len(a)
        if not -n <= self.index < n:
            raise IndexOutOfRange(
                f"tuple_get_item: index out of range, expected [{-n}, {n}), got {self.index}")
        self.index %= n
        # make_tuple(...)[i] is just its i-th input: no node needed
        if fold_const and isinstance(a.op, MakeTensorTuple) and a.inputs:
            return a.inputs[self.index]
        return Tensor.make_from_op(self, [a])

    def compute(self, a):
        return a[self.index]

    def gradient(self, out_grad, node):
        parts = node.inputs[0].realize_cached_data()
        grads = [out_grad if i == self.index else Tensor.make_const(A.zeros(p.shape, p))
                 for i, p in enumerate(parts)]
        return make_tuple(*grads)

    def plain_gradient(self, out_grad, node):
        # plain backward: only this entry is non-zero
        parts = node.inputs[0].realize_cached_data()
        return SparseTupleGrad.make({self.index: out_grad.cached_data}, parts)


def tuple_get_item(value, index):
    return TupleGetItem(index)(value)


class FusedAddScalars(TensorTupleOp):
    """``(a + c0, a + c1)`` in one op."""

    save_inputs = ()

    def __init__(self, c0: float, c1: float):
        self.c0 = as_scalar(c0, "fused_add_scalars")
        self.c1 = as_scalar(c1, "fused_add_scalars")

    def compute(self, a):
        return a + self.c0, a + self.c1

    def gradient(self, out_grad, node):
        return out_grad[0] + out_grad[1]


def fused_add_scalars(x, c0, c1):
    return FusedAddScalars(c0, c1)(x)


class Stack(TensorOp):
    """Join same-shape tensors (one TensorTuple input) along a new axis."""

    save_inputs = ()

    def __init__(self, axis: int):
        self.axis = axis

    def compute(self, args):
        if not args:
            raise ShapeError("stack: expected at least one tensor, got 0")
        shape = args[0].shape
        for i, arr in enumerate(args):
            if arr.shape != shape:
                raise ShapeError(
                    f"stack: shapes differ, expected {tuple(shape)}, got {tuple(arr.shape)} at "
                    f"position {i}")
        return A.stack(list(args), self.axis)

    def gradient(self, out_grad, node):
        return split(out_grad, self.axis)


def stack(args, axis):
    return Stack(axis)(make_tuple(*args))


class Split(TensorTupleOp):
    """Tuple of the ``shape[axis]`` slices along ``axis`` (axis removed)."""

    save_inputs = ()

    def __init__(self, axis: int):
        self.axis = axis

    def compute(self, a):
        A.normalize_axes(self.axis, len(a.shape), "split")
        return A.split(a, self.axis)

    def gradient(self, out_grad, node):
        return Stack(self.axis)(out_grad)


def split(a, axis):
    return Split(axis)(a)
