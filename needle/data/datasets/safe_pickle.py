"""Read the CIFAR-10 python batches as data, never as code.

``pickle.load`` calls whatever a file names (``os.system``, ``eval``, ...), so a crafted
``test_batch`` would run code on load. The real batches hold one dict with ``bytes`` keys:
``b"data"`` a uint8 ndarray (N, 3072), ``b"labels"`` a list of ints, ``b"batch_label"``
bytes, ``b"filenames"`` a list of bytes. Of everything a pickle can name, such a file needs
only how NumPy rebuilds an ndarray: its reconstruct function, the ``ndarray`` class and the
``dtype`` class (written as ``numpy.core.multiarray._reconstruct`` by the NumPy of the original
files, ``numpy._core.multiarray._reconstruct`` by NumPy 2). :class:`RestrictedUnpickler`
resolves exactly those names and refuses every other one before anything is called;
:func:`load_cifar_batch` then checks that the content has the shape of a batch.

Example:
    >>> import io, pickle
    >>> import numpy as np
    >>> raw = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [7]})
    >>> RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()[b"labels"]
    [7]
    >>> try:
    ...     RestrictedUnpickler(io.BytesIO(pickle.dumps(print))).load()
    ... except DataError as exc:
    ...     print(str(exc)[:49])
    unpickle: refused global builtins.print, expected
"""
from __future__ import annotations

import io
import os
import pickle
import pickletools

import numpy as np

from ..._core.errors import DataError

__all__ = ["RestrictedUnpickler", "load_cifar_batch"]

# The function NumPy pickles arrays through, whatever module it lives in on this version.
_RECONSTRUCT = np.zeros(1).__reduce__()[0]
ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of :data:`ALLOWED_GLOBALS`.

    Raises:
        DataError: for any other global (checked before the object is looked up or called)
            and for persistent ids.
    """

    def find_class(self, module: str, name: str):
        found = ALLOWED_GLOBALS.get((module, name))
        if found is None:
            allowed = ", ".join(f"{m}.{n}" for m, n in ALLOWED_GLOBALS)
            raise DataError(f"unpickle: refused global {module}.{name}, expected one of "
                            f"{allowed}")
        return found

    def persistent_load(self, pid):
        raise DataError(f"unpickle: refused persistent id {pid!r}, expected none")


def load_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``(data (N, 3072) uint8, labels (N,) uint8)`` of one CIFAR-10 python batch file.

    Raises:
        DataError: the file is not a well-formed batch (names anything but plain data, is
            truncated, or holds content of the wrong kind or shape).
    """
    if not os.path.isfile(path):
        raise DataError(f"CIFAR10Dataset: {path!r} is not a regular file, expected a CIFAR-10 "
                        f"batch")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        # every length an opcode declares must fit in the file before the unpickler, which
        # allocates a declared length up front (2**50 bytes: a bare MemoryError), reads it
        for _ in pickletools.genops(io.BytesIO(raw)):
            pass
        batch = RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except DataError as exc:
        raise DataError(f"CIFAR10Dataset: {path!r}: {exc}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, MemoryError) as exc:
        raise DataError(f"CIFAR10Dataset: {path!r} is not a CIFAR-10 batch, expected a "
                        f"pickled dict, got {type(exc).__name__}: {exc}") from None
    return _check_batch(path, batch)


def _check_batch(path: str, batch) -> tuple[np.ndarray, np.ndarray]:
    def bad(what: str, got) -> DataError:
        return DataError(f"CIFAR10Dataset: {path!r}: {what}, got {got}")

    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise bad("expected a dict with b'data' and b'labels'", keys)
    data, labels = batch[b"data"], batch[b"labels"]
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.shape[1] == 3072):
        got = (f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray)
               else type(data).__name__)
        raise bad("expected b'data' a uint8 array of shape (N, 3072)", got)
    if not isinstance(labels, list) or len(labels) != data.shape[0] or not all(
            type(v) is int and 0 <= v < 10 for v in labels):
        got = (f"a list of {len(labels)}" if isinstance(labels, list)
               else type(labels).__name__)
        raise bad(f"expected b'labels' a list of {data.shape[0]} ints in [0, 10)", got)
    return data, np.asarray(labels, dtype=np.uint8)
