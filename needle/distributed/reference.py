"""Naive collectives built only on send/recv: gather to rank 0, reduce in rank order, send back.

They are the oracle the real algorithms are tested against (slow, simple, obviously right).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import p2p
from ._algorithms import REDUCE
from ._group import resolve

_TAG = 1 << 27  # far from the tags tests use for their own point-to-point traffic


def naive_all_reduce(arr: np.ndarray, op: str = "sum", group: Any = None) -> np.ndarray:
    """Return the reduction of ``arr`` over ranks (a new array; ``arr`` is not modified).

    Example:
        >>> import numpy as np, needle.distributed as dist
        >>> dist.spawn_threads(lambda r: naive_all_reduce(np.array([r, 1.0])).tolist(), 2)
        [[1.0, 2.0], [1.0, 2.0]]
    """
    pg = resolve(group, "naive_all_reduce")
    result = np.array(arr, copy=True)
    if pg.rank == 0:
        part = np.empty_like(result)
        for src in range(1, pg.size):
            p2p.recv(part, src, group, tag=_TAG)
            REDUCE[op](result, part, out=result)
        if op == "mean":
            result /= pg.size
        for dst in range(1, pg.size):
            p2p.send(result, dst, group, tag=_TAG)
    else:
        p2p.send(result, 0, group, tag=_TAG)
        p2p.recv(result, 0, group, tag=_TAG)
    return result


def naive_all_gather(arr: np.ndarray, group: Any = None) -> list[np.ndarray]:
    """Every rank's ``arr``, in rank order, on every rank."""
    pg = resolve(group, "naive_all_gather")
    parts = [np.empty_like(arr) for _ in range(pg.size)]
    for root in range(pg.size):
        if pg.rank == root:
            parts[root][...] = arr
            for dst in range(pg.size):
                if dst != root:
                    p2p.send(arr, dst, group, tag=_TAG + 1)
        else:
            p2p.recv(parts[root], root, group, tag=_TAG + 1)
    return parts
