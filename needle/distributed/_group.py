"""Process groups: which ranks take part, their channels, timeout and communication thread.

The default group lives in a module global, except on the ``thread`` backend where every rank
is a thread and the state is thread-local.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from collections import Counter
from typing import Any, Callable

from ._errors import CommError
from ._work import CommThread, Work
from .traffic import Counters, CountingChannel, TrafficLedger

DEFAULT_TIMEOUT = float(os.environ.get("NEEDLE_DIST_TIMEOUT", "300"))
CHUNK_ENV = "NEEDLE_DIST_CHUNK_BYTES"


def _chunk_bytes() -> int:
    """The ring's chunk size (env NEEDLE_DIST_CHUNK_BYTES, default 1 MiB); the ring divides
    by it, so anything but a positive integer is refused here rather than mid-collective."""
    raw = os.environ.get(CHUNK_ENV, str(1 << 20))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise CommError(f"init_process_group: bad {CHUNK_ENV}, expected an integer number of "
                        f"bytes >= 1, got {raw!r}")
    return value


class ProcessGroup:
    """A set of ranks that communicate together. ``rank``/``size`` are group-local.

    Collectives run on ``coll`` (a private channel), user point-to-point traffic on ``p2p``, so
    neither can receive the other's messages.
    """

    def __init__(self, transport: Any, channels: list[Any], timeout: float,
                 traffic: TrafficLedger | None = None):
        self.transport = transport
        # every message passes a counting channel on its way to the transport (traffic.py);
        # groups of one process share its ledger
        self.counters = Counters()
        self.p2p = CountingChannel(channels[0], "p2p", self.counters)
        self.coll = CountingChannel(channels[1], "coll", self.counters)
        self.traffic = traffic if traffic is not None else TrafficLedger()
        self.ranks: list[int] = list(self.coll.ranks)
        self.rank: int = self.coll.rank
        self.size: int = self.coll.size
        self.backend: str = transport.backend
        self.timeout = float(timeout)
        # Ring chunk size: small enough that reduction of one chunk overlaps the next transfer,
        # large enough that per-message overhead stays small (see docs/performance.md).
        self.chunk_bytes = _chunk_bytes()
        self.check_signatures = True
        # Payload bytes this rank's collectives sent, by algorithm family ("ring", "tree",
        # "linear", "barrier", "check"): measured traffic, e.g. per training step.
        self.bytes_sent: Counter = Counter()
        # call numbers a timeout or a mismatch names (collectives.py, p2p.py): collectives
        # issued, point-to-point calls per (direction, peer, tag), and the messages whose
        # header a timed-out recv took (their payload is the next recv's)
        self.collectives_issued = 0
        self._p2p_seq: Counter = Counter()
        self._p2p_started: dict = {}
        self.closed = False
        self._comm_thread: CommThread | None = None
        self._lock = threading.Lock()

    is_member = True

    def __repr__(self) -> str:
        return f"ProcessGroup(backend={self.backend!r}, rank={self.rank}, ranks={self.ranks})"

    def check_open(self, op: str) -> None:
        if self.closed:
            raise CommError(
                f"{op}: process group {self.ranks} is destroyed, expected an open group "
                "(call dist.init_process_group / dist.new_group again)"
            )

    def check_peer(self, op: str, peer: int, what: str = "peer") -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.size:
            raise CommError(f"{op}: {what} rank out of range, expected 0 <= {what} < {self.size},"
                            f" got {peer!r}")

    def deadline(self, timeout: float | None = None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else float(timeout))

    def describe(self, rank: int) -> str:
        """'rank 1', or 'rank 1 (global rank 3)' inside a subgroup."""
        global_rank = self.ranks[rank]
        return f"rank {rank}" if global_rank == rank else f"rank {rank} (global rank {global_rank})"

    def run(self, fn: Callable[[], Any], async_op: bool) -> Work | Any:
        """Run a collective in issue order: on the communication thread when asynchronous or
        when asynchronous work is still queued, inline otherwise (saves a thread hop)."""
        with self._lock:
            if self._comm_thread is None and async_op:
                self._comm_thread = CommThread(f"needle-comm-{self.ranks}-{self.rank}")
            thread = self._comm_thread
        if async_op:
            return thread.submit(fn)
        if thread is None or thread.idle():
            return fn()
        return thread.submit(fn).wait()

    def destroy(self) -> None:
        if self._comm_thread is not None:
            self._comm_thread.stop()
        self.closed = True


class NonMemberGroup:
    """What ``new_group`` returns on ranks outside the group: using it raises."""

    is_member = False

    def __init__(self, ranks: list[int], world_rank: int):
        self.ranks = ranks
        self.world_rank = world_rank
        self.closed = False

    def check_open(self, op: str) -> None:
        raise CommError(
            f"{op}: global rank {self.world_rank} is not a member of group {self.ranks}"
        )


class _State:
    def __init__(self, transport: Any, world: ProcessGroup):
        self.transport = transport
        self.world = world
        self.groups: list[ProcessGroup] = [world]


_local = threading.local()
_process_state: _State | None = None


def current_state() -> _State | None:
    return getattr(_local, "state", None) or _process_state


def set_state(state: _State | None, thread_local: bool) -> None:
    global _process_state
    if thread_local:
        _local.state = state
    else:
        _process_state = state


def resolve(group: Any, op: str) -> ProcessGroup:
    """The group to use: ``group`` or the default one; raises if none is open."""
    if group is None:
        state = current_state()
        if state is None:
            raise CommError(
                f"{op}: no process group, expected dist.init_process_group() to be called first"
            )
        group = state.world
    group.check_open(op)
    return group


def _close_at_exit() -> None:
    state = _process_state
    if state is not None:
        for group in state.groups:
            group.destroy()
        try:
            state.transport.close()
        except Exception:  # noqa: BLE001 - the interpreter is exiting anyway
            pass


atexit.register(_close_at_exit)
