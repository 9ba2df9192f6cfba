"""Version counters of backend buffers, stamped on the clock that also orders graph nodes.

Autograd must not compute a gradient from data that changed after an op saved it for
backward. Two kinds of change exist:

* an in-place write into a buffer (``NDArray.__setitem__``, ``NDArray.fill``, and through
  them ``.flat[j] += eps`` and writes through any view) calls :func:`note_write` with the
  buffer's handle — the backend ``Array`` object that every view of the buffer shares, so a
  view and its base see each other's writes;
* a replacement of a Tensor's data (``Tensor.data = ...``, optimizer steps) is recorded on the
  Tensor itself by ``needle.autograd.versions`` with a :class:`WriteLog` of its own.

Every change takes the next tick of :data:`CLOCK`, the counter that also gives recorded graph
nodes their creation number. "Changed after the op ran" is therefore one integer comparison,
``stamp > node._seq``, and nothing has to be stored when an op records itself. :data:`LAST`
holds the latest stamp of any change: while it is below a node's creation number, nothing at
all changed since that node was recorded and backward skips the check for it.

A :class:`WriteLog` counts the changes (the *version*, 0 for a buffer never written in place)
and keeps the stamps of the last :data:`KEEP` of them, so that an error can say at which
version the op saw the data. Logs of buffers exist only for buffers written at least once;
each goes away with its buffer (a weak reference to the handle).

Example:
    >>> import numpy as np
    >>> from needle.backend_ndarray import NDArray, cpu_numpy
    >>> a = NDArray(np.zeros(4), device=cpu_numpy())
    >>> view = a.reshape((2, 2))
    >>> before = buffer_version(a._handle)
    >>> view[0, 0] = 1.0
    >>> buffer_version(a._handle) - before
    1
"""
from __future__ import annotations

import itertools
import weakref
from collections import deque
from functools import partial

__all__ = ["CLOCK", "LAST", "KEEP", "BUFFER_LOGS", "WriteLog", "note_write", "buffer_log",
           "buffer_version"]

CLOCK = itertools.count(1)  # next(CLOCK): graph creation numbers and change stamps
LAST = [0]  # stamp of the latest change of any kind (0: none yet)
KEEP = 16  # stamps kept per log: versions stay exact for nodes at most KEEP changes old


class WriteLog:
    """The changes of one buffer (or of one Tensor's data): how many, and when the last were.

    Example:
        >>> log = WriteLog()
        >>> stamp = log.record()
        >>> log.count, log.version_at(stamp - 1), log.changed_after(stamp - 1)
        (1, (0, True), True)
    """

    __slots__ = ("count", "stamps", "ref")

    def __init__(self):
        self.count = 0
        self.stamps: deque[int] = deque(maxlen=KEEP)  # the oldest drop out
        self.ref = None  # weak reference to the buffer handle (buffer logs only)

    def record(self) -> int:
        """Count one change now; returns its stamp."""
        stamp = next(CLOCK)
        self.count += 1
        self.stamps.append(stamp)
        if stamp > LAST[0]:
            LAST[0] = stamp
        return stamp

    def record_quiet(self) -> int:
        """:meth:`record` without raising :data:`LAST`: a change no graph node can have
        seen (``needle.autograd.versions.note_replaced`` decides)."""
        stamp = next(CLOCK)
        self.count += 1
        self.stamps.append(stamp)
        return stamp

    def changed_after(self, seq: int) -> bool:
        """True when a change was recorded after clock value ``seq``."""
        return bool(self.stamps) and self.stamps[-1] > seq

    def version_at(self, seq: int) -> tuple[int, bool]:
        """``(version, exact)``: the version at clock value ``seq``; ``exact`` is False when
        more than :data:`KEEP` changes happened since (the version is then an upper bound)."""
        stamps = self.stamps
        after = sum(1 for s in stamps if s > seq)
        exact = self.count == len(stamps) or stamps[0] <= seq
        return self.count - after, exact


# Logs of written buffers by id(handle); autograd's check reads it directly (it runs per saved
# tensor), everything else goes through buffer_log. A handle that cannot be weakly referenced
# keeps its log after it dies; its id may then be reused by a new buffer that inherits the
# count. The stamps stay right: the old writes precede every node that can have saved the new
# buffer.
BUFFER_LOGS: dict[int, WriteLog] = {}


def _forget(key: int, ref) -> None:
    log = BUFFER_LOGS.get(key)
    if log is not None and log.ref is ref:
        del BUFFER_LOGS[key]


def note_write(handle) -> None:
    """Record an in-place write into the buffer ``handle`` (bumps its version)."""
    key = id(handle)
    log = BUFFER_LOGS.get(key)
    if log is None:  # (a log under this id is this handle's: a dead handle's log is gone)
        log = WriteLog()
        try:
            log.ref = weakref.ref(handle, partial(_forget, key))
        except TypeError:
            log.ref = None
        log.record()  # before publishing it: a reader never sees a log without stamps
        BUFFER_LOGS[key] = log
        return
    log.record()


def buffer_log(handle) -> WriteLog | None:
    """The :class:`WriteLog` of ``handle``, or None when it was never written in place."""
    return BUFFER_LOGS.get(id(handle))


def buffer_version(handle) -> int:
    """How many in-place writes the buffer ``handle`` has had (0: none)."""
    log = buffer_log(handle)
    return 0 if log is None else log.count
