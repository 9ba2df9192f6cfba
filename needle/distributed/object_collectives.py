"""Collectives of Python values: ``gather_object`` and ``all_gather_object``.

Each rank encodes its value as an object message (``_wire``: JSON of a tagged tree, never
pickle; the same types as ``send_object``). The ranks first all-gather their fixed-size
message headers, so every rank learns every payload's size and checks the total against
``max_bytes`` before allocating; then the payloads travel in one collective (``all_gather_v``
on the exact sizes, or ``gather`` of payloads padded to the largest). Objects may differ in
size and type from rank to rank.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._errors import MessageError
from ._group import ProcessGroup, resolve
from ._transport import unexpected_limit_bytes
from ._wire import OBJECT, Header, decode_object, encode_object, pack_header, unpack_header
from .collectives import all_gather, all_gather_v, gather


def _headers(pg: ProcessGroup, op: str, payload: np.ndarray, timeout: float | None,
             limit: int) -> list[Header]:
    mine = pack_header(payload, op, OBJECT)
    every = [np.empty_like(mine) for _ in range(pg.size)]
    all_gather(every, mine, group=pg, timeout=timeout)
    headers = [unpack_header(raw, op) for raw in every]
    for r, h in enumerate(headers):
        if h.kind != OBJECT:
            raise MessageError(f"{op}: {pg.describe(r)} sent a header that is not an object's, "
                               f"expected an object, got {h.describe()}")
    total = sum(h.nbytes for h in headers)
    if total > limit:
        raise MessageError(f"{op}: the ranks' objects take {total} bytes "
                           f"({[h.nbytes for h in headers]}), expected at most {limit} bytes "
                           "(max_bytes)")
    return headers


def _limit(max_bytes: int | None) -> int:
    return unexpected_limit_bytes() if max_bytes is None else int(max_bytes)


def all_gather_object(obj: Any, *, group: Any = None, timeout: float | None = None,
                      max_bytes: int | None = None) -> list:
    """Every rank's ``obj``, in rank order, on every rank (collective).

    Args:
        max_bytes: the most bytes the encoded objects may take together (default:
            NEEDLE_DIST_MAX_UNEXPECTED_MB); checked before anything is allocated.

    Raises:
        ObjectTypeError: ``obj`` holds a type ``send_object`` does not take (raised on that
            rank before it communicates; the others then time out waiting for it).
        MessageError: objects over ``max_bytes`` together, or a malformed encoding.

    Example:
        >>> import needle.distributed as dist
        >>> def job(rank):
        ...     return dist.all_gather_object({"rank": rank, "name": "r" * rank})
        >>> dist.spawn_threads(job, 3)[2]
        [{'rank': 0, 'name': ''}, {'rank': 1, 'name': 'r'}, {'rank': 2, 'name': 'rr'}]
    """
    op = "all_gather_object"
    pg = resolve(group, op)
    payload = encode_object(obj, op)
    headers = _headers(pg, op, payload, timeout, _limit(max_bytes))
    bounds = np.cumsum([0] + [h.nbytes for h in headers]).tolist()
    flat = np.zeros(bounds[-1], np.uint8)
    flat[bounds[pg.rank]:bounds[pg.rank + 1]] = payload
    all_gather_v(flat, bounds, group=pg, timeout=timeout)
    return [decode_object(flat[bounds[r]:bounds[r + 1]], op) for r in range(pg.size)]


def gather_object(obj: Any, dst: int = 0, *, group: Any = None, timeout: float | None = None,
                  max_bytes: int | None = None) -> list | None:
    """Every rank's ``obj``, in rank order, on rank ``dst``; None on the other ranks
    (collective). Arguments and errors as :func:`all_gather_object`.

    Example:
        >>> import needle.distributed as dist
        >>> def job(rank):
        ...     return dist.gather_object([rank] * rank, dst=1)
        >>> dist.spawn_threads(job, 3)
        [None, [[], [1], [2, 2]], None]
    """
    op = "gather_object"
    pg = resolve(group, op)
    pg.check_peer(op, dst, "dst")
    payload = encode_object(obj, op)
    limit = _limit(max_bytes)
    headers = _headers(pg, op, payload, timeout, limit)
    sizes = [h.nbytes for h in headers]
    if pg.size * max(sizes) > limit:  # what dst allocates: every payload padded to the largest
        raise MessageError(f"{op}: {pg.size} objects padded to the largest ({max(sizes)} bytes) "
                           f"take {pg.size * max(sizes)} bytes, expected at most {limit} bytes "
                           "(max_bytes)")
    mine = np.zeros(max(sizes), np.uint8)
    mine[:payload.size] = payload
    parts = [np.empty_like(mine) for _ in range(pg.size)] if pg.rank == dst else None
    gather(mine, parts, dst=dst, group=pg, timeout=timeout)
    if parts is None:
        return None
    return [decode_object(part[:n], op) for part, n in zip(parts, sizes, strict=True)]
