"""In-process transport: every rank is a thread, messages are memory copies. Tests only.

``native`` on this transport means a shared-memory collective: every rank publishes its buffer,
each reduces all of them, so it is an independent oracle for needle's ring algorithms.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ._errors import CommError
from ._transport import (
    DoneRequest,
    Mailbox,
    MailboxChannel,
    MailboxTransportMixin,
    Request,
)


class ThreadWorld:
    """Shared state of the ranks of one thread 'job': one mailbox per rank."""

    def __init__(self, size: int):
        self.size = size
        self.mailboxes = [Mailbox() for _ in range(size)]
        self._lock = threading.Lock()
        self._slots: dict[int, dict[int, Any]] = {}
        self._barriers: dict[int, threading.Barrier] = {}

    def barrier_for(self, channel_id: int, parties: int) -> threading.Barrier:
        with self._lock:
            if channel_id not in self._barriers:
                self._barriers[channel_id] = threading.Barrier(parties)
                self._slots[channel_id] = {}
            return self._barriers[channel_id]

    def slots(self, channel_id: int) -> dict[int, Any]:
        return self._slots[channel_id]


class ThreadTransport(MailboxTransportMixin):
    backend = "thread"

    def __init__(self, rank: int, world: ThreadWorld):
        self.rank = rank
        self.size = world.size
        self.world = world
        self.mailbox = world.mailboxes[rank]

    def channel(self, channel_id: int, ranks: list[int]) -> MailboxChannel:
        return MailboxChannel(self, channel_id, ranks)

    def send_bytes(self, buf: np.ndarray, dst: int, key: tuple) -> Request:
        self.world.mailboxes[dst].deliver_into(key, buf)
        return DoneRequest()

    def native_for(self, channel: MailboxChannel) -> "ThreadNative":
        return ThreadNative(self.world, channel)

    def close(self) -> None:
        reason = f"rank {self.rank} left the process group"
        for r, box in enumerate(self.world.mailboxes):
            if r != self.rank:
                box.mark_gone(self.rank, reason)


_REDUCE = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}


class ThreadNative:
    """Shared-memory collectives among the thread ranks of one channel."""

    def __init__(self, world: ThreadWorld, channel: MailboxChannel):
        self.channel = channel
        self.barrier = world.barrier_for(channel.channel_id, channel.size)
        self.slots = world.slots(channel.channel_id)

    def _sync(self, op: str, deadline: float) -> None:
        try:
            self.barrier.wait(timeout=max(deadline - time.monotonic(), 1e-3))
        except threading.BrokenBarrierError:
            raise CommError(
                f"{op}: rank {self.channel.rank} timed out in the native barrier waiting for "
                f"ranks {list(range(self.channel.size))}"
            ) from None

    def all_reduce(self, arr: np.ndarray, op: str, deadline: float) -> None:
        self.slots[self.channel.rank] = arr
        self._sync("all_reduce", deadline)
        # Reduce in rank order into a private result; nobody writes until everyone has read.
        parts = [self.slots[r] for r in range(self.channel.size)]
        result = parts[0].copy()
        for part in parts[1:]:
            _REDUCE[op](result, part, out=result)
        if op == "mean":
            result /= self.channel.size
        self._sync("all_reduce", deadline)
        arr[...] = result

    def broadcast(self, arr: np.ndarray, root: int, deadline: float) -> None:
        self.slots[self.channel.rank] = arr
        self._sync("broadcast", deadline)
        result = self.slots[root].copy()
        self._sync("broadcast", deadline)
        arr[...] = result

    def barrier(self, deadline: float) -> None:
        self._sync("barrier", deadline)
