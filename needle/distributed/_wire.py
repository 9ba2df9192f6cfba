"""The one message format of needle.distributed: a fixed-size header, then the payload.

A point-to-point message with user tag ``t`` is two transport messages, on tags ``2t`` and
``2t + 1`` of the group's point-to-point channel:

* the header, ``HEADER_BYTES`` bytes, little-endian: the magic ``b"NDL2"``, the *kind*
  (``ARRAY``, ``OBJECT`` or ``ABORT``), the dtype code (an index into ``DTYPES``), the number
  of dimensions and ``MAX_NDIM`` int64 dimensions (unused ones 0);
* the payload: an array's bytes in C order; for an object its encoding (below) as a 1-D
  uint8 array; for an abort the sender's reason in UTF-8.

``send``/``recv``, ``send_array``/``recv_array``, ``send_object``/``recv_object``, the
pipeline's activations and the parameter server's requests and shards all travel so. A
receiver that knows what to expect (``recv`` into a buffer) compares the header before any
payload byte lands; one that does not (``recv_array``) allocates from the header after
checking its size against a limit, so a hostile header cannot make it allocate without bound.

Objects are encoded without pickle, as JSON text of a tagged tree, and decoding never calls
code a message names. The types allowed, exactly (subclasses are refused):

* ``None``, ``bool``, ``int``, ``float`` (NaN and infinities included), ``str``, ``bytes``;
* ``list``, ``tuple`` and ``dict`` with ``str`` or ``int`` keys, of allowed values, nested at
  most ``MAX_DEPTH`` deep;
* NumPy bool, integer and floating scalars, which arrive as ``bool``, ``int`` and ``float``.

Anything else raises :class:`ObjectTypeError` naming the op, where the value sits and its type.
Arrays go as arrays (``send_array``), not inside objects.

Example:
    >>> blob = encode_object({"step": 3, "shape": (2, 3)}, "demo")
    >>> blob.tobytes().decode()
    '{"dict":[["step",3],["shape",{"tuple":[2,3]}]]}'
    >>> unpack_header(pack_header(blob, "demo", OBJECT), "demo").describe()
    'an object of 47 bytes'
    >>> decode_object(encode_object({7: [None, float("-inf"), b"\\x00"]}, "demo"), "demo")
    {7: [None, -inf, b'\\x00']}
"""
from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any, NamedTuple

import numpy as np

from needle._core.dtypes import bfloat16_dtype

from ._errors import CommError, DTypeError, MessageError, ObjectTypeError

# Codes carried in headers; the order is part of the format.
DTYPES = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "bool",
          "bfloat16")
_CODE = {name: i for i, name in enumerate(DTYPES)}
ARRAY, OBJECT, ABORT = 0, 1, 2
KINDS = ("array", "object", "abort")
MAX_NDIM = 8
MAX_DEPTH = 64
MAX_REASON_BYTES = 4096  # an abort's text is cut to this many bytes
_MAGIC = b"NDL2"
_HEADER = struct.Struct("<4sBBB" + "q" * MAX_NDIM)
HEADER_BYTES = _HEADER.size


def dtype_name(arr: np.ndarray) -> str:
    """The needle dtype string of a NumPy array ("float32", ...)."""
    return np.dtype(arr.dtype).name


def check_dtype(op: str, arr: np.ndarray) -> None:
    if dtype_name(arr) not in _CODE:
        raise DTypeError(f"{op}: unsupported dtype, expected one of {list(DTYPES)}, got "
                         f"{arr.dtype}")


class Header(NamedTuple):
    """A decoded header: the message's kind, dtype and shape."""

    kind: int
    dtype: str
    shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        if self.kind == ARRAY:
            return f"{self.dtype} {tuple(self.shape)}"
        return f"an {KINDS[self.kind]} of {self.nbytes} bytes"


def pack_header(arr: np.ndarray, op: str, kind: int = ARRAY) -> np.ndarray:
    """The header of a message carrying ``arr``, as a uint8 buffer of ``HEADER_BYTES``."""
    check_dtype(op, arr)
    if arr.ndim > MAX_NDIM:
        raise CommError(f"{op}: at most {MAX_NDIM} dimensions can be sent, got {arr.ndim}")
    dims = list(arr.shape) + [0] * (MAX_NDIM - arr.ndim)
    raw = _HEADER.pack(_MAGIC, kind, _CODE[dtype_name(arr)], arr.ndim, *dims)
    return np.frombuffer(bytearray(raw), dtype=np.uint8)


def unpack_header(buf: np.ndarray, op: str) -> Header:
    """Decode and check a header; :class:`MessageError` when it is not one."""
    magic, kind, code, ndim, *dims = _HEADER.unpack(buf.tobytes())
    if (magic != _MAGIC or kind >= len(KINDS) or code >= len(DTYPES) or ndim > MAX_NDIM
            or any(d < 0 for d in dims[:ndim])
            or (kind != ARRAY and (code != _CODE["uint8"] or ndim != 1))):
        raise MessageError(f"{op}: received a malformed message header, expected one sent by "
                           f"needle's point-to-point calls, got {buf.tobytes()[:16]!r}...")
    if DTYPES[code] == "bfloat16":
        bfloat16_dtype()  # a process's first bfloat16 may arrive here: np.dtype knows it after
    return Header(kind, DTYPES[code], tuple(dims[:ndim]))


def check_size(header: Header, op: str, limit: int, where: str) -> None:
    """Refuse a header announcing more than ``limit`` payload bytes (before allocating)."""
    if header.nbytes > limit:
        raise MessageError(f"{op}: {where} announces a payload of {header.nbytes} bytes "
                           f"({header.describe()}), expected at most {limit} bytes (max_bytes)")


# ---- objects ------------------------------------------------------------------------------
_ALLOWED = ("None, bool, int, float, str, bytes, list, tuple, dict with str or int keys, "
            "NumPy bool/integer/floating scalars")


def encode_object(obj: Any, op: str) -> np.ndarray:
    """``obj`` as the payload of an object message (a 1-D uint8 array)."""
    tree = _encode(obj, op, "obj", 0)
    try:
        text = json.dumps(tree, allow_nan=False, separators=(",", ":"))
    except ValueError as exc:  # an int beyond what the interpreter turns into text
        raise ObjectTypeError(f"{op}: cannot encode the object, got {exc}") from None
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8).copy()


def _encode(obj: Any, op: str, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ObjectTypeError(f"{op}: {where} is nested deeper than {MAX_DEPTH} levels, "
                              "expected a shallower object (or one that does not contain itself)")
    kind = type(obj)
    if obj is None or kind in (bool, str):
        return obj
    if kind is int:
        return obj
    if kind is float:
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, (np.bool_, np.integer, np.floating)):
        return _encode(obj.item(), op, where, depth)
    if kind is bytes:
        return {"bytes": base64.b64encode(obj).decode("ascii")}
    if kind is list:
        return [_encode(v, op, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if kind is tuple:
        return {"tuple": [_encode(v, op, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]}
    if kind is dict:
        items = []
        for key, value in obj.items():
            if type(key) not in (str, int):
                raise ObjectTypeError(f"{op}: a key of {where} has type {type(key).__name__}, "
                                      "expected str or int")
            items.append([key, _encode(value, op, f"{where}[{key!r}]", depth + 1)])
        return {"dict": items}
    raise ObjectTypeError(f"{op}: {where} has type {kind.__module__}.{kind.__qualname__}, "
                          f"expected one of {_ALLOWED}")


def decode_object(payload: np.ndarray, op: str) -> Any:
    """The object an object message's payload encodes; :class:`MessageError` when it does not
    hold one (nothing in it is ever called or imported)."""

    def refuse(what: str) -> MessageError:
        return MessageError(f"{op}: the object message does not decode, expected needle's object "
                            f"encoding, got {what}")

    def constant(name: str) -> Any:
        raise refuse(f"the JSON constant {name}")

    try:
        tree = json.loads(payload.tobytes().decode("ascii"), parse_constant=constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise refuse(f"{type(exc).__name__}: {exc}") from None

    def decode(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH + 1:
            raise refuse(f"nesting deeper than {MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [decode(v, depth + 1) for v in node]
        if not isinstance(node, dict) or len(node) != 1:
            raise refuse(f"a JSON object with keys {sorted(node)[:4]}")
        (tag, value), = node.items()
        if tag == "tuple" and isinstance(value, list):
            return tuple(decode(v, depth + 1) for v in value)
        if tag == "dict" and isinstance(value, list):
            out = {}
            for item in value:
                if (not isinstance(item, list) or len(item) != 2
                        or type(item[0]) not in (str, int)):
                    raise refuse(f"a dict item {str(item)[:40]}")
                out[item[0]] = decode(item[1], depth + 1)
            return out
        if tag == "float" and value in ("nan", "inf", "-inf"):
            return float(value)
        if tag == "bytes" and isinstance(value, str):
            try:
                return base64.b64decode(value.encode("ascii"), validate=True)
            except ValueError:
                raise refuse("bytes that are not base64") from None
        raise refuse(f"the tag {tag!r}")

    return decode(tree, 0)
