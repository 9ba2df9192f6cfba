"""The one place where needle objects meet NumPy buffers.

Transports, process groups and collectives work on contiguous NumPy arrays only. This adapter
turns a Tensor, an NDArray or a NumPy array into such a buffer and writes the result back in
place on the caller's object, so the lower layers never import the autograd or the backends.
"""
from __future__ import annotations

import struct
from typing import Any, Callable

import numpy as np

from ._errors import CommError, DTypeError

# Codes carried in message headers; the order is part of the wire format.
_DTYPES = ["float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "bool"]
_CODE = {name: i for i, name in enumerate(_DTYPES)}
MAX_NDIM = 8
_HEADER = struct.Struct("<4sBB" + "q" * MAX_NDIM)
HEADER_BYTES = _HEADER.size


def dtype_name(arr: np.ndarray) -> str:
    """The needle dtype string of a NumPy array ("float32", ...)."""
    return np.dtype(arr.dtype).name


def check_dtype(op: str, arr: np.ndarray) -> None:
    if dtype_name(arr) not in _CODE:
        raise DTypeError(f"{op}: unsupported dtype, expected one of {_DTYPES}, got {arr.dtype}")


def pack_header(arr: np.ndarray, op: str) -> np.ndarray:
    """Encode dtype and shape of ``arr`` into a fixed-size uint8 buffer."""
    check_dtype(op, arr)
    if arr.ndim > MAX_NDIM:
        raise CommError(f"{op}: at most {MAX_NDIM} dimensions can be sent, got {arr.ndim}")
    dims = list(arr.shape) + [0] * (MAX_NDIM - arr.ndim)
    raw = _HEADER.pack(b"NDL1", _CODE[dtype_name(arr)], arr.ndim, *dims)
    return np.frombuffer(bytearray(raw), dtype=np.uint8)


def unpack_header(buf: np.ndarray, op: str) -> tuple[str, tuple[int, ...]]:
    magic, code, ndim, *dims = _HEADER.unpack(buf.tobytes())
    if magic != b"NDL1" or code >= len(_DTYPES) or ndim > MAX_NDIM:
        raise CommError(f"{op}: received a malformed message header (not sent by needle send?)")
    return _DTYPES[code], tuple(dims[:ndim])


class Borrowed:
    """A contiguous NumPy view of a caller's object, plus how to write results back.

    ``arr`` is the object's own memory when that is possible (a contiguous NumPy array), otherwise
    a copy; ``commit()`` then copies ``arr`` back into the caller's object in place.
    """

    def __init__(self, arr: np.ndarray, commit: Callable[[np.ndarray], None] | None):
        self.arr = arr
        self._commit = commit

    def commit(self) -> None:
        if self._commit is not None:
            self._commit(self.arr)


def _ndarray_of(obj: Any) -> Any:
    """The NDArray behind a Tensor (anything with ``realize_cached_data``), else ``obj``."""
    if hasattr(obj, "realize_cached_data"):
        return obj.realize_cached_data()
    return obj


def _setter_for(nd: Any) -> Callable[[np.ndarray], None]:
    def commit(arr: np.ndarray) -> None:
        # Write through __setitem__ so the caller's buffer (and its allocator accounting) stays.
        from needle.backend_ndarray import array

        value = array(arr, dtype=dtype_name(arr), device=nd.device)
        nd[tuple(slice(None) for _ in arr.shape)] = value

    return commit


def borrow(obj: Any, op: str, readonly: bool = False) -> Borrowed:
    """Return a contiguous NumPy buffer for ``obj`` (np.ndarray, NDArray or Tensor).

    Example:
        >>> import numpy as np
        >>> b = borrow(np.arange(3.0), "demo")
        >>> b.arr.tolist()
        [0.0, 1.0, 2.0]
    """
    if isinstance(obj, np.ndarray):
        check_dtype(op, obj)
        if obj.flags.c_contiguous and (readonly or obj.flags.writeable):
            return Borrowed(obj, None)
        copy = np.ascontiguousarray(obj)

        def commit(arr: np.ndarray) -> None:
            obj[...] = arr

        return Borrowed(copy, None if readonly else commit)
    nd = _ndarray_of(obj)
    if not hasattr(nd, "numpy"):
        raise DTypeError(
            f"{op}: expected a Tensor, NDArray or numpy.ndarray, got {type(obj).__name__}"
        )
    arr = np.ascontiguousarray(nd.numpy())
    if not arr.flags.writeable:
        arr = arr.copy()
    check_dtype(op, arr)
    return Borrowed(arr, None if readonly else _setter_for(nd))
