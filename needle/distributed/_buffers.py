"""The one place where needle objects meet NumPy buffers.

Transports, process groups and collectives work on contiguous NumPy arrays only. ``borrow``
turns a Tensor, an NDArray or a NumPy array into such a buffer and writes the result back in
place on the caller's object. ``to_host`` and ``to_device`` are the staging path of everything
that sends device data through host memory (pipeline cut edges, tensor-parallel ops, ZeRO's
shards): a host copy out, a new backend array back in. The autograd and the backends are
imported inside the functions only, so the lower layers never import them.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ._errors import DTypeError
from ._wire import HEADER_BYTES, MAX_NDIM, check_dtype, dtype_name, pack_header, unpack_header

# (the message format lives in _wire; its names stay importable from here)
__all__ = ["Borrowed", "borrow", "to_host", "to_device", "HEADER_BYTES", "MAX_NDIM",
           "check_dtype", "dtype_name", "pack_header", "unpack_header"]


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
        nd[tuple(slice(None) for _ in arr.shape)] = to_device(arr, nd.device)

    return commit


def to_host(data: Any, flat: bool = False) -> np.ndarray:
    """A C-contiguous, writeable host copy of a Tensor, NDArray or array (``flat``: 1-D), which
    the caller owns: sending it, or changing ``data`` later, cannot affect the other.

    Example:
        >>> import needle as ndl
        >>> to_host(ndl.Tensor([[1.0, 2.0]]), flat=True).tolist()
        [1.0, 2.0]
    """
    if hasattr(data, "numpy") and not isinstance(data, np.ndarray):
        out = np.asarray(data.numpy(), order="C")  # Tensor/NDArray.numpy() return new copies
        if not out.flags.writeable:
            out = out.copy()
    else:
        out = np.array(data, copy=True, order="C")
    return out.reshape(-1) if flat else out


def to_device(array: Any, device: Any = None, dtype: str | None = None, shape: Any = None,
              like: Any = None) -> Any:
    """A new backend array holding ``array`` (reshaped to ``shape``): an NDArray on ``device``
    with the nd backend, a NumPy array with the np backend. ``like`` (a Tensor, an NDArray or
    anything with ``device`` and ``dtype``) supplies whichever of ``device`` and ``dtype`` is
    not given; the dtype defaults to ``array``'s own.

    Example:
        >>> import numpy as np, needle as ndl
        >>> out = to_device(np.arange(4), ndl.cpu(), "float32", shape=(2, 2))
        >>> out.shape, out.dtype, out.device == ndl.cpu()
        ((2, 2), 'float32', True)
    """
    from needle.backend_selection import BACKEND, array_api

    if like is not None:
        device = getattr(like, "device", None) if device is None else device
        dtype = str(like.dtype) if dtype is None and hasattr(like, "dtype") else dtype
    values = np.asarray(array, order="C")  # (np.ascontiguousarray would make 0-d 1-d)
    if shape is not None:
        values = values.reshape(shape)
    dtype = dtype_name(values) if dtype is None else str(dtype)
    if BACKEND == "nd":
        return array_api.array(values, dtype=dtype, device=device)
    return np.array(values, dtype=dtype)


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
        copy = np.array(obj, order="C")

        def commit(arr: np.ndarray) -> None:
            obj[...] = arr

        return Borrowed(copy, None if readonly else commit)
    nd = _ndarray_of(obj)
    if not hasattr(nd, "numpy"):
        raise DTypeError(
            f"{op}: expected a Tensor, NDArray or numpy.ndarray, got {type(obj).__name__}"
        )
    arr = np.asarray(nd.numpy(), order="C")
    if not arr.flags.writeable:
        arr = arr.copy()
    check_dtype(op, arr)
    return Borrowed(arr, None if readonly else _setter_for(nd))
