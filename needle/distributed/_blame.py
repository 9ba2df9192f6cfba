"""Who to blame when a collective times out: the rank that never arrived, not a ring neighbour.

Every collective starts with the call check: each rank sends what it was asked to do to its
right neighbour and waits for its left neighbour's. A rank that times out *there* knows for
certain that its left neighbour never arrived. The others time out later in the algorithm,
waiting for a neighbour that did arrive but is itself stuck. So on a timeout the certain rank
tells every other rank the culprit (a small note on its own tag), and the others, before
raising, wait a little for such a note and name the culprit it carries. A rank that fails
because a peer left also looks for a note: the peer may have left after timing out itself.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ._errors import CommError

CALL_CHECK = "the call check"
TAG_BLAME = 6
_KEEP: list[Any] = []  # note buffers stay alive while a nonblocking send may still read them


def _grace(op: Any) -> float:
    return min(op.timeout, 5.0)


def _tell_everyone(op: Any, culprit: int) -> None:
    note = np.array([culprit], np.int64)
    _KEEP.append(note)
    del _KEEP[:-64]
    sends = []
    for r in range(op.size):
        if r != op.rank:
            try:
                sends.append(op.channel.isend(note, r, TAG_BLAME))
            except CommError:
                pass  # that peer is gone: it needs no note
    end = time.monotonic() + 0.5
    for req in sends:
        try:
            req.wait(end)
        except CommError:
            pass


def _hear_note(op: Any, grace: float) -> int | None:
    notes = {}
    for r in range(op.size):
        if r != op.rank:
            buf = np.full(1, -1, np.int64)
            notes[r] = (buf, op.channel.irecv(buf, r, TAG_BLAME))
    end = time.monotonic() + grace
    culprit = None
    while culprit is None and notes:
        for r, (buf, req) in list(notes.items()):
            try:
                if req.test():
                    culprit = int(buf[0]) if 0 <= buf[0] < op.size else None
                    del notes[r]
                    break
            except CommError:
                del notes[r]  # a peer that is gone sends no note
        if time.monotonic() >= end:
            break
        time.sleep(0.01)
    for _, req in notes.values():
        req.cancel()
    return culprit


def blame_on_timeout(op: Any, peer: int, certain: bool) -> int:
    """The group rank to blame after ``op`` timed out waiting for ``peer``."""
    if op.size <= 2:
        return peer  # the only other rank
    if certain:
        _tell_everyone(op, peer)
        return peer
    heard = _hear_note(op, _grace(op))
    return peer if heard is None or heard == op.rank else heard


def blame_left_behind(op: Any, gone: int) -> int | None:
    """The culprit named in a note that peer ``gone`` (or another) sent before it left, if any:
    a rank that timed out tells the others before its process ends."""
    if op.size <= 2:
        return None
    heard = _hear_note(op, 0.0)  # a note is delivered before its sender's goodbye
    return None if heard is None or heard in (op.rank, gone) else heard
