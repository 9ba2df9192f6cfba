"""Why out of memory: a per-device limit and an error that says what filled the device.

:func:`set_limit` makes a device's allocator refuse a new segment that would take its
*reserved* bytes (the segments it holds, free or not) past a budget, after returning its wholly
free cached segments, as a real device does. So an out-of-memory can be studied on any
machine, fragmentation included: a request fails when no cached free block fits it and a new
segment would pass the limit, even if the cache holds enough free bytes in pieces.

The refused request raises :class:`~needle._core.errors.OutOfMemoryError` (a ``NeedleError``
and a ``MemoryError``) whose message names the request (bytes, rounded block, category and
the op running, when an observer knows it), the live bytes by category, the largest live
tensors with the op that produced each (and the Python line, while :func:`needle.memory.profile`
runs), and reserved vs allocated bytes with the largest free block. ``err.details`` holds the
same as a dict.

Live tensors are found by walking the garbage collector's objects (only when the error is
built): graph nodes (anything with ``cached_data`` and ``op``) and the arrays they hold; an
array no node holds (optimizer state, a raw ``NDArray``) is listed as such.

Example:
    >>> import needle as ndl, numpy as np
    >>> d = ndl.cpu_numpy()
    >>> with limit(8 * 2**20, d):  # doctest: +ELLIPSIS
    ...     try:
    ...         big = ndl.Tensor(np.zeros((3000, 1000), "float32"), device=d)
    ...     except ndl.OutOfMemoryError as err:
    ...         print(str(err).splitlines()[0])
    cpu_numpy: out of memory, cannot allocate 12,000,000 bytes (...
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

from needle._core.errors import OutOfMemoryError

from ._errors import MemoryArgumentError
from .categories import CATEGORIES

__all__ = ["set_limit", "get_limit", "limit", "out_of_memory_error", "live_tensors"]

TOP = 5  # largest live tensors named in the message

# Optional source of "where was this buffer made" (the profiler, while it runs):
# fn(device name, block id) -> dict with "op", "line", "shape", "dtype", or None.
_ORIGIN = None


def set_origin_source(fn) -> None:
    """Let the profiler tell the report which op and line made each live buffer."""
    global _ORIGIN
    _ORIGIN = fn


def set_limit(nbytes: int | None, device=None) -> int | None:
    """Make ``device``'s allocator refuse to reserve more than ``nbytes`` (None: no limit).

    Returns the previous limit. The limit covers reserved bytes (segments held by the cache,
    in use or free); ``stats(device)["reserved_bytes"]`` is the number it is checked against.

    Raises:
        MemoryArgumentError: ``nbytes`` is not a non-negative int or None.

    Example:
        >>> set_limit(None, "cpu_numpy") is None
        True
    """
    from .registry import get_allocator

    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                               or nbytes < 0):
        raise MemoryArgumentError(
            f"set_limit: bad limit, expected a non-negative int of bytes or None, got "
            f"{nbytes!r}")
    return get_allocator(device).set_limit(nbytes)


def get_limit(device=None) -> int | None:
    """The reserved-bytes limit of ``device`` (None when unlimited)."""
    from .registry import get_allocator

    return get_allocator(device).limit


@contextmanager
def limit(nbytes: int | None, device=None) -> Iterator[None]:
    """:func:`set_limit` for the duration of a block, the previous limit restored after."""
    prev = set_limit(nbytes, device)
    try:
        yield
    finally:
        set_limit(prev, device)


def block_id(handle) -> int | None:
    """The allocator block id behind a backend buffer: ``cpu_numpy`` arrays keep their block
    as ``_block``, ``cuda`` arrays inside their owner (``_owner.block``), the C++ ``Array``
    answers ``block_id``; None for memory no needle allocator owns."""
    block = getattr(handle, "_block", None)
    if block is None:
        block = getattr(getattr(handle, "_owner", None), "block", None)
    if block is not None:
        return block.id
    return getattr(handle, "block_id", None)


def _buffer_key(array):
    """(device name, block id) of the buffer behind an NDArray, or None."""
    handle = getattr(array, "_handle", None)
    device = getattr(array, "_device", None) or getattr(array, "device", None)
    name = getattr(device, "name", None)
    if handle is None or name is None:
        return None
    bid = block_id(handle)
    return (name, bid) if bid is not None else None


def _arrays(data):
    return data if isinstance(data, tuple) else (data,)


def _kind(cls, cache: dict, array_type) -> str | None:
    """``"array"`` for NDArrays, ``"node"`` for graph nodes (class-level ``cached_data`` and
    ``op``), else None. Decided on the class (``type(obj)``), never on the object: some
    objects answer any attribute (ctypes' library loaders try to open a library of that name)
    or warn when asked for their ``__class__``."""
    known = cache.get(cls, False)
    if known is False:
        if issubclass(cls, array_type):
            known = "array"
        else:
            names = set()
            for klass in cls.__mro__:
                names.update(klass.__dict__)
            known = "node" if "cached_data" in names and "op" in names else None
        cache[cls] = known
    return known


def live_tensors(device: str) -> dict:
    """``{block id: description}`` of the buffers of ``device`` that tensors or arrays hold.

    A description has ``shape``, ``dtype``, ``op`` (the op that made the tensor, ``leaf`` for
    a tensor nothing made, ``array`` for an array no tensor holds) and ``requires_grad``.
    Walks the garbage collector's objects: meant for reports, not for hot paths.
    """
    from needle.backend_ndarray import NDArray

    found: dict = {}
    arrays = []
    types: dict = {}
    for obj in gc.get_objects():
        kind = _kind(type(obj), types, NDArray)
        if kind == "array":
            arrays.append(obj)
            continue
        if kind is None:
            continue
        try:
            data = obj.cached_data
        except Exception:  # noqa: BLE001 - a half-built object: nothing to report
            continue
        for array in _arrays(data):
            key = _buffer_key(array)
            if key is None or key[0] != device or key[1] in found:
                continue
            if obj.op is not None:
                op = type(obj.op).__name__
            else:
                op = "leaf (requires grad)" if getattr(obj, "requires_grad", False) else "leaf"
            found[key[1]] = {"shape": tuple(array.shape), "dtype": str(array.dtype), "op": op,
                             "requires_grad": bool(getattr(obj, "requires_grad", False))}
    for array in arrays:
        key = _buffer_key(array)
        if key is not None and key[0] == device and key[1] not in found:
            found[key[1]] = {"shape": tuple(array.shape), "dtype": str(array.dtype),
                             "op": "array", "requires_grad": False}
    return found


def _largest(device: str, alloc) -> list[dict]:
    blocks = alloc.live_blocks() if hasattr(alloc, "live_blocks") else []
    known = live_tensors(device)
    rows = []
    for block_id, size, requested, category in blocks:
        row = {"block": block_id, "bytes": size, "requested": requested, "category": category,
               "shape": None, "dtype": None, "op": None, "line": None}
        row.update({k: v for k, v in known.get(block_id, {}).items() if k != "requires_grad"})
        if _ORIGIN is not None:
            origin = _ORIGIN(device, block_id)
            if origin:
                row.update({k: v for k, v in origin.items() if v is not None
                            and (k != "op" or row["op"] in (None, "array", "leaf"))})
        rows.append(row)
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:TOP]


def _describe(row: dict) -> str:
    what = f"{row['bytes']:,} B {row['category']}"
    if row["shape"] is not None:
        what += f" {row['dtype']} {tuple(row['shape'])}"
    made = row["op"] or "unknown (no tensor holds it)"
    where = f" at {row['line']}" if row.get("line") else ""
    return f"{what} made by {made}{where}"


def out_of_memory_error(info: dict, allocator=None) -> OutOfMemoryError:
    """The :class:`OutOfMemoryError` for a refused request (``info`` from the allocator).

    ``info``: device, requested, block, segment, allocated, reserved, limit,
    largest_free_block, category. ``allocator``: the one that refused (default: the device's
    registered allocator).
    """
    from .registry import get_allocator
    from .timeline import current_op

    device = info["device"]
    alloc = allocator if allocator is not None else get_allocator(device)
    stats = alloc.stats()
    live = {c: stats["by_category"][c]["current"] for c in CATEGORIES}
    largest = _largest(device, alloc)
    op = current_op()
    cached = info["reserved"] - info["allocated"]
    free_block = info["largest_free_block"]
    fragmented = cached >= info["block"] > free_block
    lines = [
        f"{device}: out of memory, cannot allocate {info['requested']:,} bytes (block "
        f"{info['block']:,} B, category {info['category']}"
        + (f", op {op}" if op else "") + f"): a new segment of {info['segment']:,} B would "
        f"reserve {info['reserved'] + info['segment']:,} B, expected at most the limit of "
        f"{info['limit']:,} B, got {info['reserved']:,} B reserved already",
        f"  allocated {info['allocated']:,} B of {info['reserved']:,} B reserved; cached free "
        f"{cached:,} B, largest free block {free_block:,} B"
        + (" (fragmented: enough free bytes, but no free block fits the request)"
           if fragmented else ""),
        "  live bytes by category: " + ", ".join(f"{c} {b:,}" for c, b in live.items() if b),
        "  largest live tensors:",
        *[f"    {_describe(r)}" for r in largest],
    ]
    details = dict(info, op=op, live_by_category=live, largest=largest, cached=cached,
                   fragmented=fragmented)
    return OutOfMemoryError("\n".join(lines), details)
