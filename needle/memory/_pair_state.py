"""The caching allocator's state that the CUDA backend's C pair reads and updates: its byte
counters (objects with one attribute per counter) and its re-entrant lock.

``Totals``, ``CategoryRow`` and ``RLock`` come from the C module ``needle.memory._trusted_pair``
when it is built (the per-buffer pair updates the counters and reads the lock's state without
running Python); for a source tree used without building, the counter classes below and
``threading.RLock`` do the same in Python. Either way the allocator reads and writes
``totals.allocated``, ``row.current`` and so on, and takes ``with lock:``.

Example:
    >>> row = CategoryRow(); row.current += 512; row_dict(row)["current"]
    512
"""
from __future__ import annotations

import threading

__all__ = ["Totals", "CategoryRow", "RLock", "row_dict", "ROW_FIELDS"]

ROW_FIELDS = ("current", "peak", "current_requested", "peak_requested")


class _PyTotals:
    """An allocator's byte and event counters, all 0."""

    __slots__ = ("allocated", "requested", "peak", "peak_requested", "parked_reuses", "parks")

    def __init__(self):
        self.allocated = self.requested = self.peak = self.peak_requested = 0
        self.parked_reuses = 0  # allocations served by a parked block
        self.parks = 0  # releases that parked their block


class _PyCategoryRow:
    """One memory category's byte counters, all 0."""

    __slots__ = ROW_FIELDS

    def __init__(self):
        self.current = self.peak = self.current_requested = self.peak_requested = 0


try:
    from ._trusted_pair import CategoryRow, Totals
    from ._trusted_pair import FastRLock as RLock
except ImportError:  # not built: the same in Python
    Totals, CategoryRow, RLock = _PyTotals, _PyCategoryRow, threading.RLock


def row_dict(row) -> dict[str, int]:
    """A category row as the ``by_category`` entry of ``stats()``."""
    return {"current": row.current, "peak": row.peak,
            "current_requested": row.current_requested, "peak_requested": row.peak_requested}
