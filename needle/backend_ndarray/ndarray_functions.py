"""Module-level NDArray functions of the course API: constructors, math, stacking, matmul.

Example:
    >>> from needle.backend_ndarray import array, stack, cpu_numpy
    >>> a = array([1.0, 2.0], device=cpu_numpy())
    >>> stack([a, a], axis=0).shape
    (2, 2)
"""
from __future__ import annotations

import builtins
import math

from .._core.errors import AxisError, ShapeError
from .devices import default_device

__all__ = ["array", "empty", "full", "zeros", "ones", "broadcast_to", "reshape", "maximum",
           "minimum", "log", "exp", "tanh", "sqrt", "sum", "max", "min", "flip", "pad",
           "stack", "split", "concatenate", "matmul", "transpose", "swapaxes",
           "broadcast_shapes"]


def _nd():
    from .ndarray import NDArray
    return NDArray


def array(a, dtype="float32", device=None):
    """An NDArray copy of ``a`` (dtype coerced per the course rules) on ``device``."""
    return _nd()(a, device=device, dtype=dtype)


def empty(shape, dtype="float32", device=None):
    return (device or default_device()).empty(shape, dtype)


def full(shape, fill_value, dtype="float32", device=None):
    return (device or default_device()).full(shape, fill_value, dtype)


def zeros(shape, dtype="float32", device=None):
    return full(shape, 0.0, dtype, device)


def ones(shape, dtype="float32", device=None):
    return full(shape, 1.0, dtype, device)


def broadcast_to(a, shape):
    return a.broadcast_to(shape)


def reshape(a, shape):
    return a.reshape(shape)


def maximum(a, b):
    return a.maximum(b)


def minimum(a, b):
    return a.minimum(b)


def log(a):
    return a.log()


def exp(a):
    return a.exp()


def tanh(a):
    return a.tanh()


def sqrt(a):
    return a.sqrt()


def sum(a, axis=None, keepdims=False):  # noqa: A001 - NumPy's name, part of array_api
    return a.sum(axis=axis, keepdims=keepdims)


def max(a, axis=None, keepdims=False):  # noqa: A001
    return a.max(axis=axis, keepdims=keepdims)


def min(a, axis=None, keepdims=False):  # noqa: A001
    return a.min(axis=axis, keepdims=keepdims)


def flip(a, axes):
    return a.flip(axes)


def pad(a, axes):
    return a.pad(axes)


def transpose(a, axes=None):
    """Permute axes (``None`` reverses them, as NumPy)."""
    return a.permute(tuple(range(a.ndim))[::-1] if axes is None else axes)


def swapaxes(a, i: int, j: int):
    axes = list(range(a.ndim))
    axes[i], axes[j] = axes[j], axes[i]
    return a.permute(tuple(axes))


def stack(arrays, axis: int = 0):
    """Join same-shape arrays along a new axis."""
    arrays = list(arrays)
    if not arrays:
        raise ShapeError("stack: expected at least one array, got 0")
    shape = arrays[0].shape
    for i, arr in enumerate(arrays):
        if arr.shape != shape:
            raise ShapeError(f"stack: shapes differ, expected {shape}, got {arr.shape} "
                             f"at position {i}")
    ndim = len(shape) + 1
    axis = axis % ndim if -ndim <= axis < ndim else _bad_axis("stack", axis, ndim)
    out_shape = shape[:axis] + (len(arrays),) + shape[axis:]
    out = arrays[0].device.empty(out_shape, arrays[0].dtype)
    index = [slice(None)] * ndim
    for i, arr in enumerate(arrays):
        index[axis] = slice(i, i + 1)
        out._setitem(tuple(index), arr)  # a fresh array: no version bump
    return out


def concatenate(arrays, axis: int = 0):
    """Join arrays along an existing axis."""
    arrays = list(arrays)
    first = arrays[0]
    axis = axis % first.ndim if -first.ndim <= axis < first.ndim else _bad_axis(
        "concatenate", axis, first.ndim)
    for arr in arrays:
        if arr.ndim != first.ndim or any(
                arr.shape[d] != first.shape[d] for d in range(first.ndim) if d != axis):
            raise ShapeError(f"concatenate: shapes differ off axis {axis}, expected "
                             f"{first.shape}, got {arr.shape}")
    total = builtins.sum(arr.shape[axis] for arr in arrays)
    out_shape = first.shape[:axis] + (total,) + first.shape[axis + 1:]
    out = first.device.empty(out_shape, first.dtype)
    index, start = [slice(None)] * first.ndim, 0
    for arr in arrays:
        index[axis] = slice(start, start + arr.shape[axis])
        out._setitem(tuple(index), arr)  # a fresh array: no version bump
        start += arr.shape[axis]
    return out


def split(a, axis: int = 0):
    """Tuple of compact arrays, one per index along ``axis``, with that axis removed."""
    axis = axis % a.ndim if -a.ndim <= axis < a.ndim else _bad_axis("split", axis, a.ndim)
    rest = a.shape[:axis] + a.shape[axis + 1:]
    index = [slice(None)] * a.ndim
    parts = []
    for i in range(a.shape[axis]):
        index[axis] = i
        parts.append(a[tuple(index)].compact().reshape(rest))
    return tuple(parts)


def broadcast_shapes(*shapes, op: str = "broadcast") -> tuple:
    """The NumPy broadcast of several shapes; :class:`ShapeError` naming ``op`` if they clash.

    Example:
        >>> broadcast_shapes((3, 1), (4,))
        (3, 4)
    """
    ndim = builtins.max(len(s) for s in shapes)
    out = []
    for d in range(ndim):
        dims = {s[d - ndim + len(s)] for s in shapes if d - ndim + len(s) >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ShapeError(f"{op}: shapes do not broadcast, expected equal dims or 1, "
                             f"got {' and '.join(str(tuple(s)) for s in shapes)}")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def matmul(a, b):
    """NumPy ``matmul``: 2-D products, batched and broadcast over leading dims (N-D ≥ 2)."""
    da, db = len(a.shape), len(b.shape)
    if da == 2 and db == 2:  # the common case first: NDArray.__matmul__ checks the rest
        return a @ b
    if da < 2 or db < 2:
        raise ShapeError(f"matmul: expected arrays with at least 2 dims, got {a.shape} @ "
                         f"{b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: inner dimensions differ, expected a.shape[-1] == "
                         f"b.shape[-2], got {a.shape} @ {b.shape}")
    m, n, p = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.ndim == 2:
        # Fold the batch into rows: one kernel call instead of one per batch element.
        lead = a.shape[:-2]
        return (a.compact().reshape((math.prod(lead) * m, n)) @ b).reshape(lead + (m, p))
    lead = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.broadcast_to(lead + (m, n)).compact().reshape((-1, m, n))
    b3 = b.broadcast_to(lead + (n, p)).compact().reshape((-1, n, p))
    out = a.device.empty((a3.shape[0], m, p), a.dtype)
    for i in range(a3.shape[0]):
        out[i] = a3[i].compact().reshape((m, n)) @ b3[i].compact().reshape((n, p))
    return out.reshape(lead + (m, p))


def _bad_axis(op: str, axis, ndim):
    raise AxisError(f"{op}: axis out of range, expected [{-ndim}, {ndim}), got {axis}")
