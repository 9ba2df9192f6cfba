"""Allocation timelines: record alloc/free events and plot them stacked by category.

Allocators call :func:`emit` for every allocation, release and re-attribution while at least one
:func:`record` block (or another sink, e.g. a trace) is open (a single list check otherwise).
The op name attached to an event is the op (``MatMul``) or backward step (``MatMul.gradient``)
that was running: a record block installs an L3 observer (:mod:`needle.memory.hooks`) that
calls :func:`set_current_op`.

Example:
    >>> from needle.memory.caching_allocator import CachingAllocator
    >>> from needle.memory.timeline import record
    >>> alloc = CachingAllocator("demo")
    >>> with record(allocators=[alloc]) as events:
    ...     alloc.allocate(1000).release()
    >>> [(e.kind, e.nbytes) for e in events]
    [('alloc', 1024), ('free', 1024)]
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from .._core.handles import Callbacks, RemovableHandle
from .categories import CATEGORIES
from .observers import Observer, add_observer

__all__ = ["Event", "Timeline", "record", "emit", "set_current_op", "current_op", "op_scope",
           "timeline_series", "plot_timeline", "add_sink", "remove_sink"]


@dataclass(frozen=True)
class Event:
    """One allocator event.

    ``nbytes`` is the block size (rounded), ``requested`` the bytes asked for, ``category`` the
    category after the event (``prev_category`` is the one before a ``retag``),
    ``allocated_bytes`` the device's allocated bytes after the event.
    """

    kind: str
    device: str
    nbytes: int
    requested: int
    category: str
    op: str | None
    block: int
    new_segment: bool = False
    allocated_bytes: int = 0
    prev_category: str | None = None


class Timeline(list):
    """The event list a :func:`record` block returns; ``baseline`` = bytes live at its start."""

    def __init__(self, baseline: dict[str, int]):
        super().__init__()
        self.baseline = dict(baseline)


_RECORDERS: list[tuple[Timeline, frozenset | None]] = []
_RECORDERS_LOCK = threading.Lock()


class _OpState(threading.local):
    def __init__(self) -> None:
        self.op: str | None = None


_OP = _OpState()


def set_current_op(name: str | None) -> str | None:
    """Set the op name attached to events from this thread; returns the previous name.

    Example:
        >>> prev = set_current_op("matmul"); current_op()
        'matmul'
        >>> _ = set_current_op(prev)
    """
    prev = _OP.op
    _OP.op = name
    for listener in _OP_LISTENERS:  # allocators that keep their own op name (the C++ one)
        listener(name)
    return prev


_OP_LISTENERS = Callbacks()


def add_op_listener(fn) -> RemovableHandle:
    """Also call ``fn(name)`` whenever this thread's op name changes (see set_current_op).

    Returns a handle whose ``remove()`` unregisters ``fn``.
    """
    return _OP_LISTENERS.add(fn)


def current_op() -> str | None:
    """The op name events from this thread carry now (``None`` outside ops)."""
    return _OP.op


@contextmanager
def op_scope(name: str) -> Iterator[str]:
    """Context-manager form of :func:`set_current_op`."""
    prev = set_current_op(name)
    try:
        yield name
    finally:
        set_current_op(prev)


def emit(event: Event) -> None:
    """Deliver ``event`` to every open recorder that watches its device."""
    for timeline, devices in _RECORDERS:
        if devices is None or event.device in devices:
            timeline.append(event)


def add_sink(sink, devices: frozenset | None = None) -> tuple:
    """Deliver events of ``devices`` (None: all) to ``sink.append``; returns a handle."""
    entry = (sink, devices)
    with _RECORDERS_LOCK:
        _RECORDERS.append(entry)
    return entry


def remove_sink(entry: tuple) -> None:
    """Undo :func:`add_sink` (unknown handles are ignored)."""
    with _RECORDERS_LOCK:
        if entry in _RECORDERS:
            _RECORDERS.remove(entry)


class _OpNamer(Observer):
    """Names events after the op (or backward step) that caused them, while recording."""

    def op_begin(self, op, inputs):
        return set_current_op(type(op).__name__)

    def op_end(self, token, node) -> None:
        set_current_op(token)

    def node_begin(self, node):
        return set_current_op(type(node.op).__name__ + ".gradient")

    def node_end(self, token) -> None:
        set_current_op(token)


@contextmanager
def record(device=None, allocators: Iterable | None = None) -> Iterator[Timeline]:
    """Collect allocator events until the block ends.

    Args:
        device: a device or device name to watch; ``None`` watches every device.
        allocators: the allocators whose live bytes form the baseline (default: every
            registered allocator of the watched devices).

    Returns:
        A :class:`Timeline` (a list of :class:`Event`) that keeps filling until exit.
    """
    from .registry import _allocators_for  # lazy: the registry imports this module

    allocs = list(allocators) if allocators is not None else _allocators_for(device)
    names = None if device is None and allocators is None else frozenset(a.name for a in allocs)
    baseline = {c: 0 for c in CATEGORIES}
    for alloc in allocs:
        for cat, row in alloc.stats()["by_category"].items():
            baseline[cat] += row["current"]
    timeline = Timeline(baseline)
    entry = add_sink(timeline, names)
    # Allocators that log events on their own side (the C++ one) hand them over at the end.
    logging = [a for a in allocs if hasattr(a, "begin_recording")]
    for alloc in logging:
        alloc.begin_recording()
    namer = add_observer(_OpNamer())  # op names on events: costs L3 nothing when off
    try:
        yield timeline
    finally:
        namer.remove()
        remove_sink(entry)
        for alloc in logging:
            timeline.extend(alloc.end_recording())


def timeline_series(events: Iterable[Event], baseline: dict[str, int] | None = None
                    ) -> dict[str, np.ndarray]:
    """Bytes live per category after each event (index 0 = before the first event).

    Example:
        >>> e = Event("alloc", "d", 512, 500, "weight", None, 1)
        >>> timeline_series([e])["weight"].tolist()
        [0, 512]
    """
    events = list(events)
    if baseline is None:
        baseline = getattr(events, "baseline", None) or {}
    start = {c: int(baseline.get(c, 0)) for c in CATEGORIES}
    deltas = {c: np.zeros(len(events) + 1, dtype=np.int64) for c in CATEGORIES}
    for i, e in enumerate(events, start=1):
        if e.kind == "alloc":
            deltas[e.category][i] += e.nbytes
        elif e.kind == "free":
            deltas[e.category][i] -= e.nbytes
        elif e.kind == "retag":
            deltas[e.prev_category][i] -= e.nbytes
            deltas[e.category][i] += e.nbytes
    return {c: start[c] + np.cumsum(deltas[c]) for c in CATEGORIES}


def plot_timeline(events: Iterable[Event], path, title: str | None = None) -> str:
    """Write a PNG of bytes stacked by category over event index, with the peak marked.

    Args:
        events: a :class:`Timeline` from :func:`record` (or any list of events).
        path: output file name.
        title: optional plot title.

    Returns:
        ``str(path)``.
    """
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    baseline = getattr(events, "baseline", None)
    series = timeline_series(events, baseline)
    total = sum(series.values())
    peak_index = int(np.argmax(total))
    x = np.arange(total.size)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    try:
        ax.stackplot(x, *[series[c] / 2**20 for c in CATEGORIES], labels=CATEGORIES, step="post")
        ax.axvline(peak_index, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"peak {total[peak_index] / 2**20:.3f} MiB", (peak_index, total[peak_index]
                    / 2**20), xytext=(5, 5), textcoords="offset points")
        ax.set_xlabel("event index")
        ax.set_ylabel("MiB allocated")
        ax.set_title(title or "needle memory timeline")
        ax.legend(loc="upper left", fontsize="small")
        fig.tight_layout()
        fig.savefig(str(path), format="png")
    finally:
        plt.close(fig)
    return str(path)
