"""Transport layer: nonblocking byte messages between ranks, addressed by (channel, peer, tag).

A transport moves contiguous NumPy buffers. Each message is matched to receives in the order
they were posted (as in MPI), and a receive checks that the message has exactly the number of
bytes it expects, so a mismatch raises instead of writing past or into the wrong memory.

``Channel`` is what the layers above use: a set of ranks (a process group), with group-local
rank numbers, isolated from every other channel's messages.
"""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict, deque
from typing import Any, Callable

import numpy as np

from ._errors import CommError, PeerError

# Bytes of messages from one sender that may wait for a receive before the sender is cut off.
UNEXPECTED_LIMIT_ENV = "NEEDLE_DIST_MAX_UNEXPECTED_MB"
DEFAULT_UNEXPECTED_MB = 1024.0


def unexpected_limit_bytes() -> int:
    """The per-sender bound on unexpected-message memory (env NEEDLE_DIST_MAX_UNEXPECTED_MB)."""
    raw = os.environ.get(UNEXPECTED_LIMIT_ENV, str(DEFAULT_UNEXPECTED_MB))
    try:
        mib = float(raw)
    except ValueError:
        raise CommError(f"init_process_group: bad {UNEXPECTED_LIMIT_ENV}, expected a number of "
                        f"MiB, got {raw!r}") from None
    return int(mib * 2**20)


class Request:
    """A nonblocking send or receive. ``test()`` progresses it; errors surface as CommError."""

    what = "request"

    def test(self) -> bool:
        raise NotImplementedError

    def wait(self, deadline: float) -> bool:
        """Wait until done; return False if ``deadline`` (time.monotonic) passed first."""
        return poll_until(self.test, deadline)

    def cancel(self) -> bool:
        """Give up on the request (after a timeout); True when it had completed after all
        (its message arrived between the deadline and the cancel: the caller must take it,
        or it is lost to the next receive)."""
        return False


def poll_until(test: Callable[[], bool], deadline: float) -> bool:
    """Spin on ``test`` (mpi4py drops the GIL inside MPI_Test, so other threads still run),
    then back off: sleeping at once would cost small messages a scheduler round trip."""
    spins = 0
    spin_until = time.monotonic() + 2e-3
    while not test():
        spins += 1
        if spins & 63:
            continue
        now = time.monotonic()
        if now > deadline:
            return False
        if now > spin_until:
            time.sleep(0 if now < spin_until + 0.02 else 2e-4)
    return True


class Channel:
    """Point-to-point messaging among the ranks of one group (group-local numbering)."""

    rank: int
    size: int
    backend: str

    def isend(self, buf: np.ndarray, dst: int, tag: int) -> Request:
        raise NotImplementedError

    def irecv(self, buf: np.ndarray, src: int, tag: int) -> Request:
        raise NotImplementedError

    def global_rank(self, group_rank: int) -> int:
        raise NotImplementedError

    def native(self) -> Any | None:
        """The transport's own collectives for this channel, or None when it has none."""
        return None


# ---------------------------------------------------------------------------------------------
# Mailbox: MPI-style matching for the thread and TCP transports.


class MailboxRecv(Request):
    def __init__(self, box: "Mailbox", buf: np.ndarray, key: tuple):
        self.box, self.buf, self.key = box, buf, key
        self.done = False
        self.error: str | None = None
        self.gone: _Gone | None = None

    def fill(self, payload: Any) -> None:
        """Called under the mailbox lock with a matching message (bytes-like or a marker)."""
        if isinstance(payload, _Gone):
            self.error, self.gone = payload.reason, payload
        else:
            data = np.frombuffer(payload, dtype=np.uint8)
            if data.nbytes != self.buf.nbytes:
                self.error = (
                    f"message size mismatch, expected {self.buf.nbytes} bytes, "
                    f"got {data.nbytes} bytes"
                )
            elif data.nbytes:
                self.buf.reshape(-1).view(np.uint8)[:] = data
        self.done = True

    def test(self) -> bool:
        if self.done and self.error:
            if self.gone is not None:
                raise PeerError(self.error, self.gone.src, self.gone.kind)
            raise CommError(self.error)
        return self.done

    def wait(self, deadline: float) -> bool:
        with self.box.cond:
            while not self.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.box.cond.wait(min(left, 0.5))
        return self.test()

    def cancel(self) -> bool:
        return self.box.cancel(self)


class DoneRequest(Request):
    def test(self) -> bool:
        return True


class FailedRequest(Request):
    """A send to a peer that is known to be gone: fails at once instead of at the timeout."""

    def __init__(self, error: CommError):
        self.error = error

    def test(self) -> bool:
        raise self.error


class _Gone:
    """Why receives from ``src`` fail: ``kind`` is a PeerError reason ("gone", "flood", ...)."""

    def __init__(self, src: int, reason: str, kind: str):
        self.src, self.reason, self.kind = src, reason, kind


class Mailbox:
    """Incoming messages of one rank: unexpected messages and posted receives, per key.

    A key is (channel id, source global rank, tag). Messages and receives are matched in order.
    Unexpected messages (no receive posted yet) are kept, up to ``limit_bytes`` per sender: a
    sender beyond that is cut off (its kept messages are freed, every receive from it fails
    with a PeerError naming it), so a runaway or hostile sender cannot exhaust memory.
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.cond = threading.Condition()
        self.limit_bytes = limit_bytes
        self._unexpected: dict[tuple, deque] = defaultdict(deque)
        self._posted: dict[tuple, deque] = defaultdict(deque)
        self._gone: dict[int, _Gone] = {}
        self._held: dict[int, int] = defaultdict(int)  # unexpected bytes kept, per sender
        self.peak_held_bytes = 0

    def post(self, buf: np.ndarray, key: tuple) -> MailboxRecv:
        req = MailboxRecv(self, buf, key)
        with self.cond:
            queue = self._unexpected.get(key)
            if queue:
                payload = queue.popleft()
                self._held[key[1]] -= len(memoryview(payload).cast("B"))
                req.fill(payload)
            elif key[1] in self._gone:
                req.fill(self._gone[key[1]])
            else:
                self._posted[key].append(req)
        return req

    def deliver(self, key: tuple, payload: Any) -> None:
        """Hand a message to the oldest matching receive, or keep it. ``payload`` is not copied
        when kept, so callers pass memory that nobody will modify (a copy or a received frame)."""
        with self.cond:
            posted = self._posted.get(key)
            if posted:
                posted.popleft().fill(payload)
                self.cond.notify_all()
            else:
                self._keep(key, payload)

    def deliver_into(self, key: tuple, buf: np.ndarray) -> None:
        """Like deliver, but copies ``buf`` when no receive is waiting (the sender may reuse it)."""
        with self.cond:
            posted = self._posted.get(key)
            if posted:
                posted.popleft().fill(buf.reshape(-1).view(np.uint8))
                self.cond.notify_all()
            else:
                self._keep(key, buf.tobytes())

    def _keep(self, key: tuple, payload: Any) -> None:
        src = key[1]
        if src in self._gone:
            return  # a sender that was cut off (or left) delivers nothing more
        nbytes = len(memoryview(payload).cast("B"))
        held = self._held[src] + nbytes
        if self.limit_bytes is not None and held > self.limit_bytes:
            self._cut_off(src, held)
            return
        self._held[src] = held
        self.peak_held_bytes = max(self.peak_held_bytes, sum(self._held.values()))
        self._unexpected[key].append(payload)

    def _cut_off(self, src: int, held: int) -> None:
        for key in [k for k in self._unexpected if k[1] == src]:
            del self._unexpected[key]
        self._held[src] = 0
        reason = (f"rank {src} sent {held} bytes of messages that no receive was waiting for, "
                  f"more than the limit of {self.limit_bytes} bytes per sender "
                  f"({UNEXPECTED_LIMIT_ENV}); its messages were dropped")
        self._fail_from(src, _Gone(src, reason, "flood"))

    def mark_gone(self, src: int, reason: str, kind: str = "gone") -> None:
        """Fail receives from ``src`` that are waiting now or posted later (a rank left). The
        first reason stays: a goodbye followed by the closed connection reads "left"."""
        with self.cond:
            if src not in self._gone:
                self._fail_from(src, _Gone(src, reason, kind))

    def _fail_from(self, src: int, gone: _Gone) -> None:
        self._gone[src] = gone
        for key, posted in self._posted.items():
            if key[1] == src:
                while posted:
                    posted.popleft().fill(gone)
        self.cond.notify_all()

    def revive(self, src: int) -> None:
        """``src`` was restarted and rejoined: receives from it work again, and what its dead
        incarnation sent but nobody received is dropped."""
        with self.cond:
            self._gone.pop(src, None)
            for key in [k for k in self._unexpected if k[1] == src]:
                del self._unexpected[key]
            self._held[src] = 0

    def gone(self, src: int) -> _Gone | None:
        with self.cond:
            return self._gone.get(src)

    def cancel(self, req: MailboxRecv) -> bool:
        """Withdraw a posted receive; True when a message had already landed in it."""
        with self.cond:
            posted = self._posted.get(req.key)
            if posted and req in posted:
                posted.remove(req)
                return False
            return req.done


class MailboxChannel(Channel):
    """Channel for transports that deliver into per-rank mailboxes (thread, tcp)."""

    def __init__(self, transport: Any, channel_id: int, ranks: list[int]):
        self.transport = transport
        self.channel_id = channel_id
        self.ranks = ranks
        self.rank = ranks.index(transport.rank)
        self.size = len(ranks)
        self.backend = transport.backend

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def isend(self, buf: np.ndarray, dst: int, tag: int) -> Request:
        key = (self.channel_id, self.transport.rank, tag)
        return self.transport.send_bytes(buf, self.ranks[dst], key)

    def irecv(self, buf: np.ndarray, src: int, tag: int) -> Request:
        key = (self.channel_id, self.ranks[src], tag)
        return self.transport.mailbox.post(buf, key)

    def native(self) -> Any | None:
        return self.transport.native_for(self)


class MailboxTransportMixin:
    """Channel ids come from a counter that advances identically on every rank, because every
    rank calls ``init_process_group`` and ``new_group`` in the same order."""

    rank: int
    _next_channel = 0

    def channels(self, count: int, ranks: list[int]) -> list[MailboxChannel] | None:
        first = self._next_channel
        self._next_channel = first + count
        if self.rank not in ranks:
            return None
        return [MailboxChannel(self, first + i, ranks) for i in range(count)]
