"""``ndl.save`` / ``ndl.load``: tensors and nested containers in a file that runs no code.

The format is a plain zip archive (readable with any zip tool and NumPy):

* ``needle.json`` — ``{"format": "needle", "version": 1, "root": <tree>, "arrays": {...}}``:
  the object as a JSON tree, and for every array entry its dtype, shape and SHA-256;
* ``arrays/<k>.npy`` — one ``.npy`` file per array (NumPy's format, read with
  ``allow_pickle=False``).

The tree holds ``None``, booleans, integers, floats (NaN and infinities included), strings,
lists, tuples, dicts (keys: strings or integers), NumPy arrays and scalars, needle Tensors
(``requires_grad`` and the device name kept) and NDArrays. Anything else is refused on save
with the path of the offending entry, so loading never meets an object it would have to
construct by calling code. Loading checks the format tag and version, that every array entry
exists, and each array's checksum, dtype and shape; any failure is a
:class:`~needle._core.errors.SerializationError` naming the file and what is wrong.

Writes are atomic: the archive goes to a temporary file beside ``path``, is flushed and
fsync'ed, then renamed over ``path``, so a reader sees the old file or the new one, never half.

Example:
    >>> import os, tempfile, numpy as np, needle as ndl
    >>> path = os.path.join(tempfile.mkdtemp(), "state.ndl")
    >>> ndl.save({"w": ndl.Tensor([1.0, 2.0]), "step": 3, "lr": 0.1}, path)
    >>> back = ndl.load(path)
    >>> back["w"].numpy().tolist(), back["step"], back["lr"]
    ([1.0, 2.0], 3, 0.1)
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import zipfile
from typing import Any

import numpy as np

from ._core.errors import SerializationError
from .autograd import Tensor
from .backend_ndarray import NDArray, device_by_name

__all__ = ["save", "load", "FORMAT_VERSION", "atomic_write_bytes"]

FORMAT_VERSION = 1
_INDEX = "needle.json"


# ---- saving ---------------------------------------------------------------------------------
class _Writer:
    """Turns an object into a JSON tree, collecting arrays as ``.npy`` payloads."""

    def __init__(self):
        self.arrays: dict[str, bytes] = {}
        self.meta: dict[str, dict] = {}

    def array(self, a: np.ndarray) -> str:
        name = f"arrays/{len(self.arrays)}.npy"
        buf = io.BytesIO()
        a = a if a.flags.c_contiguous else a.copy(order="C")  # keeps 0-d arrays 0-d
        np.lib.format.write_array(buf, a, allow_pickle=False)
        payload = buf.getvalue()
        self.arrays[name] = payload
        self.meta[name] = {"dtype": str(a.dtype), "shape": list(a.shape),
                           "sha256": hashlib.sha256(payload).hexdigest()}
        return name

    def encode(self, obj: Any, where: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, (int, np.integer)) and not isinstance(obj, np.bool_):
            return int(obj)
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, (np.generic,)):
            return {"__scalar__": self.array(np.asarray(obj))}
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise SerializationError(
                    f"save: {where} is an object array, expected numeric or bool data, got "
                    f"dtype {obj.dtype}")
            return {"__array__": self.array(obj)}
        if isinstance(obj, Tensor):
            return {"__tensor__": self.array(obj.numpy()), "requires_grad": obj.requires_grad,
                    "device": str(obj.device), "parameter": type(obj).__name__ == "Parameter"}
        if isinstance(obj, NDArray):
            return {"__ndarray__": self.array(obj.numpy()), "device": str(obj.device)}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            return {"__dict__": [self._item(k, v, where) for k, v in obj.items()],
                    "kind": _dict_kind(obj)}
        raise SerializationError(
            f"save: {where} has type {type(obj).__name__}, expected None, bool, int, float, str, "
            f"list, tuple, dict, NumPy array or scalar, Tensor or NDArray")

    def _item(self, key, value, where: str) -> list:
        if isinstance(key, bool) or not isinstance(key, (str, int, np.integer)):
            raise SerializationError(
                f"save: a key of {where} has type {type(key).__name__}, expected str or int")
        key = key if isinstance(key, str) else int(key)
        return [key, self.encode(value, f"{where}[{key!r}]")]


def _dict_kind(obj: dict) -> str:
    # RNG states are dict subclasses that needle.random accepts back as a whole.
    return "rng_state" if type(obj).__name__ == "RNGState" else "dict"


def atomic_write_bytes(path: str, payload: bytes) -> None:
    """Write ``payload`` to ``path`` through a fsync'ed temporary file and a rename."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def save(obj: Any, path: str) -> None:
    """Save ``obj`` (tensors, arrays, numbers, strings and containers of them) to ``path``.

    Raises:
        SerializationError: for a value of a type the format does not hold (named by path).
    """
    writer = _Writer()
    root = writer.encode(obj, "obj")
    index = {"format": "needle", "version": FORMAT_VERSION, "root": root, "arrays": writer.meta}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, payload in writer.arrays.items():
            zf.writestr(name, payload)
        zf.writestr(_INDEX, json.dumps(index))
    atomic_write_bytes(path, buf.getvalue())


# ---- loading --------------------------------------------------------------------------------
class _Reader:
    def __init__(self, path: str, zf: zipfile.ZipFile, meta: dict, device):
        self.path, self.zf, self.meta, self.device = path, zf, meta, device

    def fail(self, what: str) -> SerializationError:
        return SerializationError(f"load: {self.path}: {what}")

    def array(self, name: str) -> np.ndarray:
        info = self.meta.get(name)
        if not isinstance(name, str) or info is None:
            raise self.fail(f"the index names array {name!r}, which it does not describe")
        try:
            payload = self.zf.read(name)
        except KeyError:
            raise self.fail(f"array entry {name} is missing (truncated file?)") from None
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise self.fail(f"array entry {name} is unreadable ({exc})") from None
        digest = hashlib.sha256(payload).hexdigest()
        if digest != info.get("sha256"):
            raise self.fail(f"checksum mismatch for {name}, expected {info.get('sha256')}, got "
                            f"{digest} (the file is corrupted)")
        try:
            array = np.lib.format.read_array(io.BytesIO(payload), allow_pickle=False)
        except ValueError as exc:
            raise self.fail(f"array entry {name} is not a plain .npy array ({exc})") from None
        if str(array.dtype) != info["dtype"] or list(array.shape) != info["shape"]:
            raise self.fail(f"array entry {name} differs from its index, expected "
                            f"{info['dtype']} {info['shape']}, got {array.dtype} "
                            f"{list(array.shape)}")
        return array

    def _device_for(self, saved: str | None):
        if self.device is not None:
            return self.device
        if saved:
            try:
                device = device_by_name(saved.rstrip("()"))
                if device.enabled():
                    return device
            except Exception:  # noqa: BLE001 - an unknown saved device: use the default
                pass
        return None

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if not isinstance(node, dict):
            raise self.fail(f"unexpected entry of type {type(node).__name__} in the index")
        if "__float__" in node:
            return float(node["__float__"])
        if "__scalar__" in node:
            return self.array(node["__scalar__"])[()]
        if "__array__" in node:
            return self.array(node["__array__"])
        if "__tensor__" in node:
            return self._tensor(node)
        if "__ndarray__" in node:
            data = self.array(node["__ndarray__"])
            return NDArray(data, device=self._device_for(node.get("device")))
        if "__tuple__" in node:
            return tuple(self.decode(v) for v in node["__tuple__"])
        if "__dict__" in node:
            return self._dict(node)
        raise self.fail(f"unknown entry {sorted(node)[:3]} in the index")

    def _tensor(self, node: dict):
        data = self.array(node["__tensor__"])
        tensor = Tensor(data, device=self._device_for(node.get("device")), dtype=str(data.dtype),
                        requires_grad=bool(node.get("requires_grad", False)))
        if node.get("parameter"):
            from .nn import Parameter

            tensor = Parameter(tensor)
        return tensor

    def _dict(self, node: dict) -> dict:
        items = {}
        for pair in node["__dict__"]:
            if not isinstance(pair, list) or len(pair) != 2:
                raise self.fail("a dict entry of the index is not a [key, value] pair")
            items[pair[0]] = self.decode(pair[1])
        if node.get("kind") == "rng_state":
            from .random import RNGState

            return RNGState(items)
        return items


def load(path: str, device=None) -> Any:
    """Load what :func:`save` wrote; Tensors go to ``device`` (default: their saved device).

    Raises:
        SerializationError: for a missing, truncated, corrupted or foreign file, or one
            written by a newer format version.
    """
    if not os.path.exists(path):
        raise SerializationError(f"load: {path}: no such file")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise SerializationError(
            f"load: {path}: not a needle file or truncated ({exc})") from None
    with zf:
        try:
            index = json.loads(zf.read(_INDEX))
        except KeyError:
            raise SerializationError(f"load: {path}: no {_INDEX} inside, expected a file "
                                     f"written by ndl.save") from None
        except (ValueError, zipfile.BadZipFile, OSError, EOFError) as exc:
            raise SerializationError(f"load: {path}: unreadable index ({exc})") from None
        if not isinstance(index, dict) or index.get("format") != "needle":
            raise SerializationError(f"load: {path}: not a needle file, expected format "
                                     f"'needle', got {index.get('format')!r}"
                                     if isinstance(index, dict) else
                                     f"load: {path}: the index is not a JSON object")
        version = index.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise SerializationError(
                f"load: {path}: format version {version!r} is newer than this needle reads, "
                f"expected <= {FORMAT_VERSION}, got {version!r} (upgrade needle)")
        return _Reader(path, zf, index.get("arrays", {}), device).decode(index.get("root"))
