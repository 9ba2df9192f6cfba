"""``.safetensors`` files: the weights format PyTorch and Hugging Face tools share.

``ndl.save(state, "m.safetensors")`` and ``ndl.load("m.safetensors")`` come here by the
file's extension. A safetensors file holds a *flat* dict of name → array, nothing else, so
that is what is written: a model's ``state_dict()`` (NumPy arrays), or any flat dict of
arrays, Tensors or NDArrays. Training state (an optimizer's, a ``TrainState``'s: nested
dicts, numbers) stays in needle's own format and is refused here with that advice.

Loading gives NumPy arrays, ready for ``model.load_state_dict``; with ``device`` it gives
Tensors (``requires_grad=False``) on that device. Layouts are as stored: a PyTorch
``Linear.weight`` is (out, in) where needle's is (in, out); :func:`needle.nn.from_torch` and
:func:`needle.nn.to_torch` convert a whole state dict.

Reading and writing go through the ``safetensors`` package (``pip install
'needle[safetensors]'``); without it both raise :class:`SerializationError` saying so.
Writes are atomic, as for needle's own format.

Example:
    >>> import os, tempfile, numpy as np, needle as ndl
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> ndl.save({"w": np.ones((2, 3), np.float32)}, path)
    >>> {k: v.shape for k, v in ndl.load(path).items()}
    {'w': (2, 3)}
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._core.dtypes import bfloat16_dtype
from ._core.errors import SerializationError
from .autograd import Tensor
from .backend_ndarray import NDArray

__all__ = ["is_safetensors_path", "save_safetensors", "load_safetensors"]

SUFFIX = ".safetensors"


def is_safetensors_path(path) -> bool:
    """Whether ``path`` names a ``.safetensors`` file (by its extension, any case)."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(SUFFIX)


def _package(op: str, path):
    try:
        import safetensors.numpy as st
    except ImportError:
        raise SerializationError(
            f"{op}: {path}: reading and writing .safetensors needs the safetensors package, "
            f"expected it installed (pip install 'needle[safetensors]'), got ImportError"
        ) from None
    return st


def _flat_arrays(obj: Any, path) -> dict[str, np.ndarray]:
    """The flat name → C-contiguous NumPy array dict to write, or a SerializationError."""
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        raise SerializationError(
            f"save: {path}: got a {type(obj).__name__} object, expected a flat dict of "
            f"name -> array; save its weights with ndl.save(model.state_dict(), path)")
    if not isinstance(obj, dict):
        raise SerializationError(f"save: {path}: a .safetensors file holds a flat dict of "
                                 f"name -> array, got {type(obj).__name__}")
    out = {}
    for name, value in obj.items():
        if not isinstance(name, str):
            raise SerializationError(f"save: {path}: names must be strings, expected str, "
                                     f"got {type(name).__name__} {name!r}")
        if isinstance(value, (Tensor, NDArray)):
            value = value.numpy()
        if not isinstance(value, np.ndarray) or value.dtype.hasobject:
            raise SerializationError(
                f"save: {path}: {name!r} is a {type(value).__name__}, expected an array "
                f"(a .safetensors file holds weights only: save nested training state such "
                f"as an optimizer's or a TrainState's to needle's own format, e.g. state.ndl)")
        out[name] = np.ascontiguousarray(value)
    return out


def save_safetensors(obj: Any, path) -> None:
    """Write a flat dict of name → array (NumPy, Tensor, NDArray) to a ``.safetensors`` file.

    Raises:
        SerializationError: anything but a flat dict of arrays with string names (a Module
            itself: save its ``state_dict()``), or the safetensors package missing.
    """
    from .serialization import atomic_write_bytes

    arrays = _flat_arrays(obj, path)
    st = _package("save", path)
    atomic_write_bytes(os.fspath(path), st.save(arrays))


def _know_bfloat16_if_stored(path) -> None:
    """Make ``np.dtype("bfloat16")`` known before the package reads a file that holds BF16
    (it asks NumPy by that name; needle imports ml_dtypes only when a bfloat16 shows up).
    The file's header is 8 bytes of length, then JSON; anything unreadable is left for the
    package to report."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = f.read(min(size, 1 << 27))
    except OSError:
        return
    if b'"BF16"' in header:
        bfloat16_dtype()


def load_safetensors(path, device=None) -> dict:
    """Read a ``.safetensors`` file: NumPy arrays by name, or Tensors on ``device``.

    Raises:
        SerializationError: a missing or malformed file, or the safetensors package missing.
    """
    st = _package("load", path)
    _know_bfloat16_if_stored(path)
    try:
        arrays = st.load_file(os.fspath(path))
    except FileNotFoundError:
        raise SerializationError(f"load: {path}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - the package raises its own error types
        raise SerializationError(
            f"load: {path}: not a readable .safetensors file ({type(exc).__name__}: {exc})"
        ) from None
    if device is None:
        return arrays
    return {name: Tensor(a, device=device, dtype=str(a.dtype), requires_grad=False)
            for name, a in arrays.items()}
