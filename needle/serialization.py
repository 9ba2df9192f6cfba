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

import contextlib
import hashlib
import io
import json
import math
import os
import secrets
import stat
import zipfile
from typing import Any

import numpy as np

from ._core.dtypes import numpy_dtype
from ._core.errors import SerializationError
from .autograd import Tensor
from .backend_ndarray import NDArray, device_by_name
from .safetensors_io import is_safetensors_path, load_safetensors, save_safetensors

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
        # .npy has no bfloat16 (it would read back as raw 'V2'): its bits go as uint16, and
        # the index's dtype says how to view them
        np.lib.format.write_array(buf, a.view(np.uint16) if a.dtype.name == "bfloat16" else a,
                                  allow_pickle=False)
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
    """Write ``payload`` to ``path``: a reader sees the old file or the new one, never half.

    The bytes go to a temporary file beside ``path`` with a random name, created exclusively
    and without following links (``O_EXCL | O_NOFOLLOW``), so a file or symlink planted
    there is never written through; it is fsync'ed and renamed over ``path`` (a symlink at
    ``path`` is replaced, not followed), then the folder is fsync'ed.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "note.txt")
        >>> atomic_write_bytes(path, b"hi"); open(path, "rb").read()
        b'hi'
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = _create_temporary(directory, os.path.basename(path))
    renamed = False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        renamed = True
    finally:
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def _create_temporary(directory: str, name: str) -> tuple[int, str]:
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))
    for _ in range(16):  # a clash of 64 random bits is someone planting names: give up soon
        tmp = os.path.join(directory, f".{name}.tmp.{secrets.token_hex(8)}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise SerializationError(f"save: {directory}: no free temporary name for {name}, expected "
                             f"one of 16 random names to be free, got every one taken")


def save(obj: Any, path: str) -> None:
    """Save ``obj`` (tensors, arrays, numbers, strings and containers of them) to ``path``;
    a path ending in ``.safetensors`` gets that format instead (a flat dict of arrays, see
    :mod:`needle.safetensors_io`).

    A model (anything with ``state_dict()``) is refused, not pickled as PyTorch would: the
    format never runs code, so it could not rebuild the object. Save
    ``model.state_dict()`` and load it back with ``model.load_state_dict(ndl.load(path))``.

    Raises:
        SerializationError: for a value of a type the format does not hold (named by path).
    """
    if is_safetensors_path(path):
        return save_safetensors(obj, path)
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        raise SerializationError(
            f"save: got a {type(obj).__name__} object, expected its state: save "
            f"{type(obj).__name__}.state_dict() with ndl.save(obj.state_dict(), path) and "
            f"restore it with obj.load_state_dict(ndl.load(path))")
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
# A file is untrusted: every size is checked against what the central directory declares
# before a byte is inflated, and no entry is read past its declared size.
INFLATE_ALLOWANCE = 256 << 20  # bytes that compressed entries may add to the file's own size
_MAX_INDEX_BYTES = 64 << 20
_NPY_HEADER_MAX = 1 << 16  # NumPy writes headers well under this; read_array caps them too
_MAX_DEPTH = 100  # nesting of the tree; a state dict is a handful of levels deep
_COMPRESSIONS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)  # DEFLATE inflates in bounded steps


class _Reader:
    def __init__(self, path: str, zf: zipfile.ZipFile, meta: dict, device):
        self.path, self.zf, self.meta, self.device = path, zf, meta, device
        self.decoded: dict[str, tuple[dict, Any]] = {}  # entry -> (first node, its value)

    def fail(self, what: str) -> SerializationError:
        return SerializationError(f"load: {self.path}: {what}")

    def array(self, name: str) -> np.ndarray:
        info = self.meta[name]
        try:
            with self.zf.open(name) as f:
                payload = f.read(self.zf.getinfo(name).file_size)  # declared, checked: bounded
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise self.fail(f"array entry {name} is unreadable ({exc})") from None
        digest = hashlib.sha256(payload).hexdigest()
        if digest != info["sha256"]:
            raise self.fail(f"checksum mismatch for {name}, expected {info['sha256']}, got "
                            f"{digest} (the file is corrupted)")
        try:
            array = np.lib.format.read_array(io.BytesIO(payload), allow_pickle=False)
        except ValueError as exc:
            raise self.fail(f"array entry {name} is not a plain .npy array ({exc})") from None
        if info["dtype"] == "bfloat16" and array.dtype == np.uint16:
            array = array.view(numpy_dtype("bfloat16"))
        if str(array.dtype) != info["dtype"] or list(array.shape) != info["shape"]:
            raise self.fail(f"array entry {name} differs from its index, expected "
                            f"{info['dtype']} {info['shape']}, got {array.dtype} "
                            f"{list(array.shape)}")
        return array

    def shared(self, node: dict, key: str, make) -> Any:
        """The value of an array-backed ``node``, decoded once per entry: every node naming
        the same entry gets the same object (and its memory once)."""
        name = node[key]
        if not isinstance(name, str) or name not in self.meta:
            raise self.fail(f"the index names array {name!r}, which it does not describe")
        seen = self.decoded.get(name)
        if seen is not None:
            if seen[0] != node:
                raise self.fail(f"array entry {name} is named by two different entries, "
                                f"expected {seen[0]}, got {node}")
            return seen[1]
        value = make(self.array(name))
        self.decoded[name] = (node, value)
        return value

    def _device_for(self, saved: Any):
        if self.device is not None:
            return self.device
        if isinstance(saved, str) and saved:
            try:
                device = device_by_name(saved.rstrip("()"))
                if device.enabled():
                    return device
            except Exception:  # noqa: BLE001 - an unknown saved device: use the default
                pass
        return None

    def decode(self, node: Any, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise self.fail(f"the index nests deeper than {_MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            raise self.fail(f"unexpected entry of type {type(node).__name__} in the index")
        if "__float__" in node:
            if node["__float__"] not in ("nan", "inf", "-inf"):
                raise self.fail(f"a float entry holds {node['__float__']!r}, expected 'nan', "
                                f"'inf' or '-inf'")
            return float(node["__float__"])
        if "__scalar__" in node:
            return self.shared(node, "__scalar__", lambda a: a[()])
        if "__array__" in node:
            return self.shared(node, "__array__", lambda a: a)
        if "__tensor__" in node:
            return self.shared(node, "__tensor__", lambda a: self._tensor(node, a))
        if "__ndarray__" in node:
            return self.shared(node, "__ndarray__", lambda a: NDArray(
                a, device=self._device_for(node.get("device"))))
        if "__tuple__" in node:
            return tuple(self.decode(v, depth + 1) for v in self._list(node["__tuple__"]))
        if "__dict__" in node:
            return self._dict(node, depth)
        raise self.fail(f"unknown entry {sorted(node)[:3]} in the index")

    def _list(self, value: Any) -> list:
        if not isinstance(value, list):
            raise self.fail(f"a container entry holds {type(value).__name__}, expected a list")
        return value

    def _tensor(self, node: dict, data: np.ndarray):
        tensor = Tensor(data, device=self._device_for(node.get("device")), dtype=str(data.dtype),
                        requires_grad=bool(node.get("requires_grad", False)))
        if node.get("parameter"):
            from .nn import Parameter

            tensor = Parameter(tensor)
        return tensor

    def _dict(self, node: dict, depth: int) -> dict:
        items = {}
        for pair in self._list(node["__dict__"]):
            if (not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], (str, int))):
                raise self.fail(f"a dict entry of the index is {str(pair)[:60]}, expected a "
                                f"[key, value] pair with a str or int key")
            items[pair[0]] = self.decode(pair[1], depth + 1)
        if node.get("kind") == "rng_state":
            from .random import RNGState

            return RNGState(items)
        return items


def _open_regular(path: str):
    """``path`` opened for reading, refused unless it is a regular file: a FIFO would block
    and a device (``/dev/zero``) never ends. O_NONBLOCK makes opening a FIFO return at once."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise SerializationError(f"load: {path}: no such file") from None
    except OSError as exc:
        raise SerializationError(f"load: {path}: cannot open ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = {stat.S_IFDIR: "directory", stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character "
                "device", stat.S_IFBLK: "block device"}.get(stat.S_IFMT(mode), "special file")
        raise SerializationError(f"load: {path}: not a regular file, expected a file written "
                                 f"by ndl.save, got a {kind}")
    return os.fdopen(fd, "rb")


def _entries(path: str, zf: zipfile.ZipFile, size: int) -> dict[str, zipfile.ZipInfo]:
    """The archive's entries by name; duplicates, overlapping entries (their compressed
    bytes add up to more than the file) and unknown compressions are refused."""
    entries: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        if info.filename in entries:
            raise SerializationError(f"load: {path}: entry {info.filename} appears twice, "
                                     f"expected every entry once")
        if info.compress_type not in _COMPRESSIONS:
            raise SerializationError(f"load: {path}: entry {info.filename} has compression "
                                     f"{info.compress_type}, expected stored (0) or deflated (8)")
        entries[info.filename] = info
    packed = sum(info.compress_size for info in entries.values())
    if packed > size:
        raise SerializationError(f"load: {path}: entries overlap, expected their compressed "
                                 f"sizes to fit in the file's {size} bytes, got {packed}")
    return entries


def _checked_meta(path: str, meta: Any, entries: dict, total: int, budget: int) -> dict:
    """The index's array table, every entry present with a declared size that fits its
    dtype and shape, and all of them together with the ``total`` bytes of the index within
    ``budget`` bytes."""
    def fail(what: str) -> SerializationError:
        return SerializationError(f"load: {path}: {what}")

    if not isinstance(meta, dict):
        raise fail(f"the index's arrays table is a {type(meta).__name__}, expected an object")
    for name, info in meta.items():
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
                and isinstance(info.get("sha256"), str) and isinstance(info.get("shape"), list)
                and all(type(d) is int and d >= 0 for d in info["shape"])):
            raise fail(f"array {name} is described as {str(info)[:80]}, expected "
                       f"{{dtype: str, shape: [int >= 0], sha256: str}}")
        if name not in entries:
            raise fail(f"array entry {name} is missing (truncated file?)")
        try:
            nbytes = numpy_dtype(info["dtype"]).itemsize * math.prod(info["shape"])
        except TypeError:
            raise fail(f"array {name} has dtype {info['dtype']!r}, expected a NumPy "
                       f"dtype") from None
        declared = entries[name].file_size
        if not nbytes <= declared <= nbytes + _NPY_HEADER_MAX:
            raise fail(f"array entry {name} declares {declared} bytes, expected "
                       f"{info['dtype']} {info['shape']}: {nbytes} bytes plus a .npy header")
        total += declared
    if total > budget:
        raise fail(f"the index and arrays declare {total} bytes in all, expected at most "
                   f"{budget} (pass max_bytes= to load a larger file)")
    return meta


def _read_index(path: str, zf: zipfile.ZipFile, entries: dict, budget: int) -> tuple[dict, int]:
    info = entries.get(_INDEX)
    if info is None:
        raise SerializationError(f"load: {path}: no {_INDEX} inside, expected a file "
                                 f"written by ndl.save")
    limit = min(_MAX_INDEX_BYTES, budget)
    if info.file_size > limit:
        raise SerializationError(f"load: {path}: {_INDEX} declares {info.file_size} bytes, "
                                 f"expected at most {limit}")
    try:
        with zf.open(info) as f:
            index = json.loads(f.read(info.file_size))
    except RecursionError:
        raise SerializationError(f"load: {path}: {_INDEX} nests too deeply, expected at most "
                                 f"{_MAX_DEPTH} levels") from None
    except (ValueError, zipfile.BadZipFile, OSError, EOFError) as exc:
        raise SerializationError(f"load: {path}: unreadable index ({exc})") from None
    if not isinstance(index, dict):
        raise SerializationError(f"load: {path}: the index is not a JSON object")
    if index.get("format") != "needle":
        raise SerializationError(f"load: {path}: not a needle file, expected format "
                                 f"'needle', got {index.get('format')!r}")
    version = index.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise SerializationError(
            f"load: {path}: format version {version!r} is newer than this needle reads, "
            f"expected <= {FORMAT_VERSION}, got {version!r} (upgrade needle)")
    return index, info.file_size


def load(path: str, device=None, *, max_bytes: int | None = None) -> Any:
    """Load what :func:`save` wrote; Tensors go to ``device`` (default: their saved device).
    A ``.safetensors`` path gives its arrays by name (NumPy; Tensors on ``device`` if given).

    Only a regular file is read. Before anything is inflated, every entry's declared size is
    checked against the dtype and shape the index gives it, and their total against
    ``max_bytes`` (default: the file's own size plus ``INFLATE_ALLOWANCE``, 256 MiB, for
    compressed entries). An array named several times by the index is decoded once, and
    every name gets the same object.

    Raises:
        SerializationError: for a missing, truncated, corrupted, oversized or foreign file,
            one that is not a regular file, or one written by a newer format version.
    """
    if is_safetensors_path(path):
        return load_safetensors(path, device)
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise SerializationError(
                f"load: {path}: not a needle file or truncated ({exc})") from None
        budget = size + INFLATE_ALLOWANCE if max_bytes is None else int(max_bytes)
        with zf:
            entries = _entries(path, zf, size)
            index, index_bytes = _read_index(path, zf, entries, budget)
            meta = _checked_meta(path, index.get("arrays", {}), entries, index_bytes, budget)
            return _Reader(path, zf, meta, device).decode(index.get("root"))
