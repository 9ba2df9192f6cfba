"""The caching allocator's state that the CUDA backend's C pair reads and updates: its byte
counters (objects with one attribute per counter) and its re-entrant lock.

``CategoryRow``, ``ParkCounts`` and ``RLock`` come from the C module
``needle.memory._trusted_pair`` when it is built (the per-buffer pair updates the counters and
reads the lock's state without running Python); for a source tree used without building, the
classes below and ``threading.RLock`` do the same in Python. Either way the allocator keeps one
``CategoryRow`` for all its blocks and one per memory category, updated by :func:`add_bytes`
and :func:`take_bytes`, and takes ``with lock:``.

Example:
    >>> row = CategoryRow(); add_bytes(row, 512, 500); take_bytes(row, 512, 500)
    >>> row_dict(row)
    {'current': 0, 'peak': 512, 'current_requested': 0, 'peak_requested': 500}
"""
from __future__ import annotations

import threading

__all__ = ["CategoryRow", "ParkCounts", "RLock", "add_bytes", "take_bytes", "row_dict"]


class _PyCategoryRow:
    """Bytes of live blocks (a category's, or all of them) and their peaks, all 0."""

    __slots__ = ("current", "peak", "current_requested", "peak_requested")

    def __init__(self):
        self.current = self.peak = self.current_requested = self.peak_requested = 0


class _PyParkCounts:
    """The parked pair's events, both 0."""

    __slots__ = ("parked_reuses", "parks")

    def __init__(self):
        self.parked_reuses = 0  # allocations served by a parked block
        self.parks = 0  # releases that parked their block


try:
    from ._trusted_pair import CategoryRow, ParkCounts
    from ._trusted_pair import FastRLock as RLock
except ImportError:  # not built: the same in Python
    CategoryRow, ParkCounts, RLock = _PyCategoryRow, _PyParkCounts, threading.RLock


def add_bytes(row, size: int, requested: int) -> None:
    """Count a block of ``size`` bytes (``requested`` asked for) handed out, peaks included."""
    cur = row.current = row.current + size
    if cur > row.peak:
        row.peak = cur
    req = row.current_requested = row.current_requested + requested
    if req > row.peak_requested:
        row.peak_requested = req


def take_bytes(row, size: int, requested: int) -> None:
    """Count a block given back (a release sets no peak)."""
    row.current -= size
    row.current_requested -= requested


def row_dict(row) -> dict[str, int]:
    """A row as the ``by_category`` entry of ``stats()``."""
    return {"current": row.current, "peak": row.peak,
            "current_requested": row.current_requested, "peak_requested": row.peak_requested}
