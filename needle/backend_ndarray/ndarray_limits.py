"""Size limits of the NDArray layer, checked before anything is allocated or read.

Every buffer, view and byte count needle computes must stay exact in the signed 64-bit
arithmetic of the kernels (C++ ``int64_t``/``size_t``, CUDA ``long long``). Python integers
never overflow, so the checks are done here, on the exact values, before a backend sees them:

* a buffer holds at most :data:`MAX_BUFFER_BYTES` bytes (2**62);
* a view (broadcast, strided) has at most :data:`MAX_VIEW_ELEMENTS` elements (2**62);
* every stride and offset fits in int64, and every element of a non-empty view lies inside
  its buffer: ``0 <= offset + sum(i_k * stride_k) < buffer size`` for all indices.

A request beyond a limit raises :class:`SizeLimitError`, a view reaching outside its buffer
:class:`IndexOutOfRange`; both name the op, the shape and the limit. The compiled backends
check the same things again at their entry points (docs/limits.md).

Example:
    >>> check_view("as_strided", (3,), (4,), 0, 12)
    3
    >>> try:
    ...     check_alloc("zeros", (2**31, 2**31), 4, "float32")
    ... except SizeLimitError as exc:
    ...     print(str(exc)[:60])
    zeros: array too large, expected at most 4611686018427387904
"""
from __future__ import annotations

import math
import operator
from functools import lru_cache

import numpy as np

from .._core.errors import (
    IndexOutOfRange,
    NeedleError,
    OutOfMemoryError,
    ShapeError,
    SizeLimitError,
)

MAX_BUFFER_BYTES = 2**62
MAX_VIEW_ELEMENTS = 2**62
INT64_MAX = 2**63 - 1
# No dtype is wider than 8 bytes, so below this many elements no buffer can pass
# MAX_BUFFER_BYTES: the per-op allocation path compares once and skips the exact check.
FAST_ALLOC_ELEMENTS = MAX_BUFFER_BYTES // 8
_index = operator.index


def check_dims(op: str, shape) -> tuple:
    """``shape`` as a tuple of non-negative Python ints (an int alone is a 1-D shape).

    Raises:
        ShapeError: a dimension that is not an integer or is negative.
        SizeLimitError: a dimension past 2**62 (kernels take dims as int64).
    """
    # map/min/max run in C: this is on the path of every view and constructor.
    try:
        dims = tuple(map(_index, shape))
    except TypeError:
        dims = _odd_dims(op, shape)
    if dims and (min(dims) < 0 or max(dims) > MAX_VIEW_ELEMENTS):
        if min(dims) < 0:
            raise ShapeError(f"{op}: negative dimension, expected dims >= 0, got {dims}")
        check_dim_sizes(op, dims)
    return dims


def _odd_dims(op: str, shape) -> tuple:
    """A lone int as a 1-D shape, or the error for non-integer dimensions."""
    try:
        return (operator.index(shape),)
    except TypeError:
        pass
    try:
        got = tuple(shape)
    except TypeError:
        got = shape
    raise ShapeError(f"{op}: dimensions must be integers, expected a tuple of ints, "
                     f"got {got!r}") from None


def check_dim_sizes(op: str, dims: tuple) -> None:
    """:class:`SizeLimitError` for a dimension past 2**62, even in an empty shape."""
    if dims and max(dims) > MAX_VIEW_ELEMENTS:
        raise SizeLimitError(f"{op}: dimension too large, expected every dim <= "
                             f"{MAX_VIEW_ELEMENTS} (2**62), got {dims}")


def check_strides(op: str, strides, ndim: int) -> tuple:
    """``strides`` as Python ints, one per dimension (their range: :func:`check_view`)."""
    try:
        strides = tuple(map(_index, strides))
    except TypeError:
        raise ShapeError(f"{op}: strides must be integers, expected a tuple of ints, "
                         f"got {strides!r}") from None
    if len(strides) != ndim:
        raise ShapeError(f"{op}: expected one stride per dimension ({ndim}), "
                         f"got {len(strides)}: {strides}")
    return strides


def check_alloc(op: str, shape: tuple, itemsize: int, dtype) -> int:
    """Element count of a new buffer of ``shape``; :class:`SizeLimitError` past the limit."""
    count = math.prod(shape)
    nbytes = count * itemsize
    if nbytes > MAX_BUFFER_BYTES:
        raise SizeLimitError(
            f"{op}: array too large, expected at most {MAX_BUFFER_BYTES} bytes (2**62) per "
            f"buffer, got shape {shape} of {dtype} = {nbytes} bytes")
    return count


def check_view_size(op: str, shape: tuple) -> int:
    """Element count of a view of ``shape``; :class:`SizeLimitError` past the limit."""
    count = math.prod(shape)
    if count > MAX_VIEW_ELEMENTS:
        raise SizeLimitError(
            f"{op}: view too large, expected at most {MAX_VIEW_ELEMENTS} elements (2**62), "
            f"got shape {shape} = {count} elements")
    if not count:  # an empty shape may still hold a dim that no kernel could take
        check_dim_sizes(op, shape)
    return count


def view_span(shape: tuple, strides: tuple, offset: int) -> tuple:
    """Lowest and highest element offset a non-empty view touches (exact Python ints)."""
    lo = hi = offset
    for n, s in zip(shape, strides, strict=True):
        if s > 0:
            hi += (n - 1) * s
        elif s < 0:
            lo += (n - 1) * s
    return lo, hi


def check_view(op: str, shape: tuple, strides: tuple, offset: int, buffer_size: int) -> int:
    """Element count of a valid view of a ``buffer_size``-element buffer.

    ``shape`` and ``strides`` must already be tuples of ints (:func:`check_dims`,
    :func:`check_strides`).

    Raises:
        SizeLimitError: more than :data:`MAX_VIEW_ELEMENTS` elements.
        IndexOutOfRange: a stride or the offset outside int64, or an element outside the buffer.
    """
    count = check_view_size(op, shape)
    offset = operator.index(offset)
    if not 0 <= offset <= INT64_MAX or (
            strides and (min(strides) < -INT64_MAX or max(strides) > INT64_MAX)):
        raise IndexOutOfRange(
            f"{op}: stride or offset out of range, expected strides in [-(2**63-1), 2**63-1] "
            f"and 0 <= offset <= 2**63-1, got strides {strides}, offset {offset}")
    if count:
        lo, hi = view_span(shape, strides, offset)
        if lo < 0 or hi >= buffer_size:
            raise IndexOutOfRange(
                f"{op}: view reaches outside its buffer, expected element offsets in "
                f"[0, {buffer_size}), got [{lo}, {hi}] for shape {shape}, strides {strides}, "
                f"offset {offset}")
    return count


def checked_view(op: str, shape, strides, offset, buffer_size: int) -> tuple:
    """``(shape, strides)`` as int tuples, after the checks of :func:`check_dims`,
    :func:`check_strides` and :func:`check_view`.

    Views recur (the same transpose every step, the same im2col window every layer), so the
    verdict is cached: a repeated view costs a dict look-up. Only plain ints reach the cache
    (a float equal to an int would share its entry): the sum of a tuple is an ``int`` only
    when every element is one (a single float, NumPy integer or other type changes its type
    or raises), which costs far less than converting each element.
    """
    try:
        if type(sum(shape)) is int and type(sum(strides)) is int and type(offset) is int:
            fitted = _fitted_view(tuple(shape), tuple(strides), offset, buffer_size)
            if fitted is not None:
                return fitted
    except TypeError:
        pass
    shape = check_dims(op, shape)
    strides = check_strides(op, strides, len(shape))
    check_view(op, shape, strides, _index(offset), buffer_size)
    return shape, strides


@lru_cache(maxsize=4096)
def _fitted_view(shape: tuple, strides: tuple, offset: int, buffer_size: int):
    """The int tuples of a valid view (bools become ints), None for an invalid one."""
    try:
        shape = check_dims("", shape)
        strides = check_strides("", strides, len(shape))
        check_view("", shape, strides, offset, buffer_size)
    except NeedleError:
        return None
    return shape, strides


def host_copy(device, handle, shape: tuple, strides: tuple, offset: int) -> np.ndarray:
    """``device.to_numpy`` of a valid view, with its failures as needle errors."""
    if math.prod(shape) > FAST_ALLOC_ELEMENTS:
        check_alloc("numpy", shape, handle.itemsize, handle.dtype)
    try:
        return device.to_numpy(handle, shape, strides, offset)
    except MemoryError as exc:
        raise out_of_memory("numpy", shape, handle.dtype, "the host", exc) from exc
    except ValueError as exc:
        if isinstance(exc, NeedleError):
            raise
        # NumPy refuses shapes whose non-zero dims multiply past 2**63 bytes, even empty ones
        # such as (0, 2**61) that needle holds as a view.
        raise SizeLimitError(f"numpy: NumPy cannot hold shape {shape} of {handle.dtype}, "
                             f"got {exc}") from exc


def out_of_memory(op: str, shape: tuple, dtype, device, exc: BaseException) -> OutOfMemoryError:
    """The error for a buffer within the limits that ``device`` could not provide."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    return OutOfMemoryError(
        f"{op}: out of memory on {device}, expected a buffer of {nbytes} bytes for shape "
        f"{shape} of {dtype}, got {type(exc).__name__}: {exc}")
