"""Input checks shared by NDArray's methods: axes, scalars, operand pairs, reshape targets.

Public NDArray methods call these before any kernel runs (kernels assume valid input).

Example:
    >>> normalize_axes(-1, 3, "sum"), resolve_reshape((2, 6), (3, -1))
    ((2,), (3, 4))
"""
from __future__ import annotations

import builtins
import math

import numpy as np

from .._core.errors import AxisError, DeviceError, DTypeError, IndexOutOfRange, ShapeError
from .ndarray_limits import check_dim_sizes


def is_scalar(x) -> bool:
    return isinstance(x, (int, float, np.number))


def normalize_axis(axis: int, ndim: int, op: str) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise AxisError(f"{op}: axis must be an int, expected int in [{-ndim}, {ndim}), "
                        f"got {axis!r}")
    if not -ndim <= axis < builtins.max(ndim, 1):
        raise AxisError(f"{op}: axis out of range, expected an axis in [{-ndim}, {ndim}), "
                        f"got {axis}")
    return int(axis) % builtins.max(ndim, 1)


def normalize_axes(axis, ndim: int, op: str) -> tuple:
    """``None`` → all axes; int or sequence → sorted tuple of distinct non-negative axes."""
    if axis is None:
        return tuple(range(ndim))
    # one axis already in range (a bias gradient's (0,)): nothing to sort or check
    if type(axis) is tuple and len(axis) == 1:
        if type(axis[0]) is int and 0 <= axis[0] < ndim:
            return axis
    elif type(axis) is int and 0 <= axis < ndim:
        return (axis,)
    if isinstance(axis, (int, np.integer)):
        axes = (axis,)
    elif isinstance(axis, (tuple, list, range)):
        axes = tuple(axis)
    else:  # a float or a string would otherwise fail deep inside with a TypeError
        raise AxisError(f"{op}: axes must be None, an int or a tuple of ints, expected e.g. 1 "
                        f"or (0, 1), got {axis!r}")
    out = tuple(sorted(normalize_axis(a, ndim, op) for a in axes))
    if len(set(out)) != len(out):
        raise AxisError(f"{op}: repeated axis, expected distinct axes, got {axis}")
    return out


# stored mantissa bits per float dtype: integers up to 2 ** (bits + 1) are held exactly
_MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}


def numpy_data(value, dtype: np.dtype, op: str) -> np.ndarray:
    """``value`` as a C-ordered NumPy array of ``dtype``, refused where the conversion would
    invent or change a value: ``None`` (NumPy makes it NaN) and integers that ``dtype``
    cannot hold exactly (16777217 in float32 would become 16777216). Integers it holds
    exactly, bools and floats convert as the course does."""
    if value is None:
        raise DTypeError(f"{op}: expected numbers, a list or an array, got None")
    src = np.asarray(value)
    if src.dtype.hasobject and any(x is None for x in src.flat):
        raise DTypeError(f"{op}: expected numbers, got None inside the data")
    out = np.asarray(src, dtype=dtype, order="C")
    if src.dtype.kind in "iu" and out.dtype.name in _MANTISSA_BITS and src.size:
        exact = 2 ** (_MANTISSA_BITS[out.dtype.name] + 1)  # every integer up to this is exact
        big = (src > exact) | (src < -exact) if src.dtype.kind == "i" else src > exact
        if big.any():
            for was, now in zip(src[big].tolist(), out[big].tolist(), strict=True):
                if was != now:
                    raise DTypeError(
                        f"{op}: integer {was} cannot be held exactly in {out.dtype}, expected "
                        f"integers within +-{exact} or exactly representable, got {was} -> "
                        f"{int(now) if math.isfinite(now) else now} (convert explicitly)")
    return out


def scalar_value(value, op: str) -> float:
    if isinstance(value, (int, float, np.number)):
        return float(value)
    if isinstance(value, np.ndarray) and value.size == 1:
        return float(value.reshape(-1)[0])
    raise DTypeError(f"{op}: expected an NDArray or a scalar, got {type(value).__name__}"
                     + (f" of shape {value.shape}" if hasattr(value, "shape") else ""))


def check_pair(op: str, a, b) -> None:
    if a._device is not b._device and a._device != b._device:
        raise DeviceError(f"{op}: operands on different devices, expected {a.device}, "
                          f"got {b.device}")
    if a._handle.dtype != b._handle.dtype:
        raise DTypeError(f"{op}: mixed dtypes, expected {a.dtype}, got {b.dtype} "
                         f"(convert one with .astype)")


def check_same_shape(op: str, a, b) -> None:
    """Elementwise operands must agree exactly: nothing is broadcast implicitly."""
    if a._shape != b._shape:
        raise ShapeError(f"{op}: shapes differ, expected {a._shape}, got {b._shape} "
                         f"(broadcast explicitly)")


def index_view(shape: tuple, strides: tuple, offset: int, idxs, op: str) -> tuple:
    """``(shape, strides, offset)`` of the view that ints and slices ``idxs`` pick.

    An int index keeps its dimension with size 1 (course semantics).
    """
    ndim = len(shape)
    if not isinstance(idxs, tuple):
        idxs = (idxs,)
    if len(idxs) > ndim:
        raise IndexOutOfRange(f"{op}: too many indices, expected at most {ndim}, "
                              f"got {len(idxs)}")
    idxs = idxs + (slice(None),) * (ndim - len(idxs))
    out_shape, out_strides = [], []
    for dim, idx in enumerate(idxs):
        n = shape[dim]
        if isinstance(idx, slice):
            if idx.step == 0:
                raise IndexOutOfRange(f"{op}: slice step must be nonzero, got 0 on axis {dim}")
            start, stop, step = idx.indices(n)
            length = len(range(start, stop, step))
        elif isinstance(idx, (int, np.integer)) and not isinstance(idx, bool):
            if not -n <= idx < n:
                raise IndexOutOfRange(f"{op}: index out of range on axis {dim}, "
                                      f"expected [{-n}, {n}), got {idx}")
            start, step, length = int(idx) % n, 1, 1
        else:
            raise IndexOutOfRange(f"{op}: unsupported index, expected int or slice, "
                                  f"got {type(idx).__name__}")
        offset += start * strides[dim] if length else 0
        out_shape.append(length)
        out_strides.append(strides[dim] * step)
    return tuple(out_shape), tuple(out_strides), offset


def resolve_reshape(shape: tuple, new_shape) -> tuple:
    if isinstance(new_shape, (int, np.integer)):
        new_shape = (new_shape,)
    new_shape = tuple(int(d) for d in new_shape)
    size = math.prod(shape)
    if new_shape.count(-1) > 1 or any(d < -1 for d in new_shape):
        raise ShapeError(f"reshape: invalid shape, expected non-negative dims and at most "
                         f"one -1, got {new_shape}")
    if -1 in new_shape:
        known = math.prod(d for d in new_shape if d != -1)
        if known == 0 or size % known:
            raise ShapeError(f"reshape: cannot infer -1, expected size {size} divisible by "
                             f"{known}, got {new_shape} for {shape}")
        new_shape = tuple(size // known if d == -1 else d for d in new_shape)
    if math.prod(new_shape) != size:
        raise ShapeError(f"reshape: size differs, expected {size} elements ({shape}), "
                         f"got {math.prod(new_shape)} ({new_shape})")
    if not size:  # only an empty shape can hide a dimension past the limit
        check_dim_sizes("reshape", new_shape)
    return new_shape


def check_class_ids(values: np.ndarray, k: int, what: str) -> np.ndarray:
    """``values`` (class labels or embedding ids, any float dtype) as int64, each checked to
    be an integer in ``[0, k)``; else an IndexError "<what> <i>, expected ..." naming the
    first bad position. The host check of the NumPy reference's and the CUDA backend's
    label and id kernels (the C++ kernels check the same in C++).

    Example:
        >>> check_class_ids(np.array([0.0, 2.0]), 3, "row").tolist()
        [0, 2]
    """
    bad = ~((values >= 0) & (values < k) & (values == np.floor(values)))
    if bad.any():
        i = int(np.argmax(bad))
        raise IndexError(f"{what} {i}, expected an integer in [0, {k}), got {float(values[i])}")
    return values.astype(np.int64)
