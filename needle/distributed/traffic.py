"""The communication-volume ledger: bytes predicted per collective or message beside the bytes
the transport was handed, per step.

Measured side. Every process group wraps its two channels (collectives, point-to-point) in a
:class:`CountingChannel`, the layer every message of needle's algorithms and of ``send``/
``recv`` passes through on its way to the transport: it counts the bytes of each ``isend``
and ``irecv`` it posts. Messages are *payload* (the tensor data) or *overhead*: the 192-byte
call check each collective exchanges with its left neighbour, the header of each ``send``. A
transport's native collectives (``algorithm="native"``) bypass the channels: their records say
``measured: None``.

Predicted side. Each collective and point-to-point call opens a :class:`TrafficRecord` with
the payload bytes this rank sends and receives according to the algorithm (``M`` = the
tensor's bytes, ``n`` ranks):

==========================  ============================================================
ring all-reduce             2(n-1) of the n segments of ``M``: ``2(n-1)/n·M`` each way when
                            ``n`` divides the element count (segment sizes otherwise)
ring reduce-scatter         ``(n-1)/n·M`` each way (``M``: the whole input)
ring all-gather             ``(n-1)/n·M`` each way (``M``: the whole gathered result)
tree broadcast / reduce     ``M`` per child sent (broadcast) or received (reduce), ``M`` from
                            or to the parent
linear gather / scatter     root receives / sends ``(n-1)·M``, the others ``M``
dissemination barrier       1 byte per round, ``ceil(log2 n)`` rounds
send / recv                 ``M``
==========================  ============================================================

Records carry the *label* open on the calling thread (``with traffic.label("ddp grads")``) and
the ledger's current step (:meth:`TrafficLedger.mark_step`; DDP marks each synchronized step,
step 0 is set-up). A strategy states its own per-step prediction with
:meth:`TrafficLedger.expect` (label, bytes, formula): the ledger compares it with the bytes
measured for that label in that step. The parameter server's push/pull (``send``/``recv``
under a label, expected ``M`` each) and ZeRO's reduce-scatter and all-gather (labelled,
expected ``(n-1)/n·M`` each) feed it the same way DDP does.

Example:
    >>> import numpy as np, needle.distributed as dist
    >>> def job(rank):
    ...     x = np.ones(1024, np.float32)
    ...     with label("demo"):
    ...         dist.all_reduce(x)
    ...     r = ledger().records[-1]
    ...     return r.predicted_sent, r.sent
    >>> dist.spawn_threads(job, 2)
    [(4096, 4096), (4096, 4096)]
"""
from __future__ import annotations

import math
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator

__all__ = ["TrafficRecord", "TrafficLedger", "CountingChannel", "Counters", "ledger", "label",
           "ring_all_reduce_bytes", "ring_reduce_scatter_bytes", "ring_all_gather_bytes",
           "tree_broadcast_bytes", "tree_reduce_bytes", "gather_bytes", "scatter_bytes",
           "barrier_bytes", "MAX_RECORDS"]

MAX_RECORDS = 100_000  # per ledger; the oldest go first
SIGNATURE_TAG = 1      # the call check of collectives (``_algorithms._TAG_SIGNATURE``)


# ---- predictions --------------------------------------------------------------------------------
def _segments(numel: int, n: int) -> list[int]:
    return [numel * (i + 1) // n - numel * i // n for i in range(n)]


def ring_all_reduce_bytes(numel: int, itemsize: int, n: int, rank: int,
                          bounds: list[int] | None = None) -> tuple[int, int]:
    """(sent, received) payload bytes of ``rank`` in a ring all-reduce of ``numel`` items.

    The reduce-scatter then the all-gather: step ``j`` of ``2(n-1)`` sends segment
    ``rank - 1 - j`` and receives segment ``rank - 2 - j`` (mod n); segments are the ``n``
    near-equal parts of the buffer, or those cut at ``bounds``.

    Example:
        >>> ring_all_reduce_bytes(1000, 4, 4, 0)  # 2 * 3/4 * 4000
        (6000, 6000)
        >>> ring_all_reduce_bytes(10, 1, 2, 0, bounds=[0, 1, 10])  # each sends all 10 once
        (10, 10)
    """
    if n <= 1:
        return 0, 0
    seg = _segments(numel, n) if bounds is None else [
        bounds[i + 1] - bounds[i] for i in range(n)]
    sent = sum(seg[(rank - 1 - j) % n] for j in range(2 * (n - 1)))
    recv = sum(seg[(rank - 2 - j) % n] for j in range(2 * (n - 1)))
    return sent * itemsize, recv * itemsize


def ring_reduce_scatter_bytes(numel: int, itemsize: int, n: int, rank: int) -> tuple[int, int]:
    """(sent, received) of a ring reduce-scatter of a ``numel``-item input: ``(n-1)/n·M``."""
    if n <= 1:
        return 0, 0
    seg = _segments(numel, n)
    start = rank - 1
    sent = sum(seg[(start - j) % n] for j in range(n - 1))
    recv = sum(seg[(start - j - 1) % n] for j in range(n - 1))
    return sent * itemsize, recv * itemsize


def ring_all_gather_bytes(numel: int, itemsize: int, n: int, rank: int) -> tuple[int, int]:
    """(sent, received) of a ring all-gather into ``numel`` items: ``(n-1)/n·M``."""
    if n <= 1:
        return 0, 0
    seg = _segments(numel, n)
    sent = sum(seg[(rank - j) % n] for j in range(n - 1))
    recv = sum(seg[(rank - j - 1) % n] for j in range(n - 1))
    return sent * itemsize, recv * itemsize


def _children(rank: int, root: int, n: int) -> tuple[bool, int]:
    """(has a parent, number of children) in the binomial tree rooted at ``root``."""
    v = (rank - root) % n
    low = v & -v if v else 1 << max(n - 1, 1).bit_length()
    count, bit = 0, 1
    while bit < low and v + bit < n:
        count += 1
        bit <<= 1
    return v != 0, count


def tree_broadcast_bytes(nbytes: int, n: int, rank: int, root: int) -> tuple[int, int]:
    """(sent, received): ``M`` to each child, ``M`` from the parent (none at the root)."""
    parent, children = _children(rank, root, n)
    return children * nbytes, nbytes if parent else 0


def tree_reduce_bytes(nbytes: int, n: int, rank: int, root: int) -> tuple[int, int]:
    """(sent, received): ``M`` to the parent, ``M`` from each child."""
    parent, children = _children(rank, root, n)
    return nbytes if parent else 0, children * nbytes


def gather_bytes(nbytes: int, n: int, rank: int, root: int) -> tuple[int, int]:
    return (0, (n - 1) * nbytes) if rank == root else (nbytes, 0)


def scatter_bytes(nbytes: int, n: int, rank: int, root: int) -> tuple[int, int]:
    return ((n - 1) * nbytes, 0) if rank == root else (0, nbytes)


def barrier_bytes(n: int) -> tuple[int, int]:
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    return rounds, rounds


# ---- records and the ledger ---------------------------------------------------------------------
@dataclass
class TrafficRecord:
    """One collective or point-to-point call on this rank (bytes are payload unless named
    ``overhead``; ``sent``/``recv`` None when the transport's native collective ran)."""

    kind: str
    algorithm: str
    label: str | None
    step: int
    group: list
    rank: int
    payload_bytes: int
    predicted_sent: int
    predicted_recv: int
    formula: str
    sent: int | None = 0
    recv: int | None = 0
    overhead_sent: int = 0
    overhead_recv: int = 0
    messages: int = 0

    @property
    def matches(self) -> bool | None:
        """Whether the measured payload equals the prediction (None: not measured)."""
        if self.sent is None:
            return None
        return self.sent == self.predicted_sent and self.recv == self.predicted_recv


@dataclass
class _Expectation:
    label: str
    step: int
    predicted_sent: int
    predicted_recv: int | None
    formula: str


class TrafficLedger:
    """The records of one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.records: deque = deque(maxlen=MAX_RECORDS)
        self.expectations: list[_Expectation] = []
        self.step = 0
        self._lock = threading.Lock()

    def mark_step(self) -> int:
        """Start the next step; returns its number (records before the first mark: step 0)."""
        with self._lock:
            self.step += 1
            return self.step

    def add(self, record: TrafficRecord) -> TrafficRecord:
        with self._lock:
            self.records.append(record)
        return record

    def expect(self, label: str, predicted_sent: int, predicted_recv: int | None = None,
               formula: str = "") -> None:
        """A strategy's prediction for the bytes of ``label`` in the current step."""
        with self._lock:
            self.expectations.append(_Expectation(label, self.step, int(predicted_sent),
                                                  None if predicted_recv is None
                                                  else int(predicted_recv), formula))
            del self.expectations[:-MAX_RECORDS]

    def per_step(self) -> list[dict]:
        """One row per step: predicted and measured payload, overhead, and per label."""
        steps: dict = {}
        for r in list(self.records):
            row = steps.setdefault(r.step, {"step": r.step, "calls": 0, "predicted_sent": 0,
                                            "sent": 0, "predicted_recv": 0, "recv": 0,
                                            "overhead_sent": 0, "unmeasured": 0,
                                            "by_label": {}})
            row["calls"] += 1
            lab = row["by_label"].setdefault(r.label or r.kind, {
                "predicted_sent": 0, "sent": 0, "predicted_recv": 0, "recv": 0, "calls": 0})
            lab["calls"] += 1
            for key in ("predicted_sent", "predicted_recv"):
                row[key] += getattr(r, key)
                lab[key] += getattr(r, key)
            if r.sent is None:
                row["unmeasured"] += 1
                continue
            row["overhead_sent"] += r.overhead_sent
            for key in ("sent", "recv"):
                row[key] += getattr(r, key)
                lab[key] += getattr(r, key)
        for e in self.expectations:
            lab = steps.get(e.step, {}).get("by_label", {}).get(e.label)
            if lab is not None:
                lab["expected_sent"] = lab.get("expected_sent", 0) + e.predicted_sent
                lab["formula"] = e.formula
        return [steps[k] for k in sorted(steps)]

    def summary(self, last: int = 50) -> dict:
        """A JSON block (``summary.json``'s ``traffic``): totals, the last ``last`` steps, and
        whether every measured record equals its prediction."""
        rows = self.per_step()
        measured = [r for r in list(self.records) if r.sent is not None]
        return {
            "calls": len(self.records),
            "predicted_sent": sum(r.predicted_sent for r in self.records),
            "sent": sum(r.sent for r in measured),
            "overhead_sent": sum(r.overhead_sent for r in measured),
            "all_match": all(r.matches for r in measured),
            "mismatches": [asdict(r) for r in measured if not r.matches][:10],
            "steps": rows[-last:],
        }

    def table(self, last: int = 5) -> str:
        lines = [f"{'step':>5} {'calls':>6} {'predicted sent':>15} {'sent':>12} "
                 f"{'overhead':>9}  labels"]
        for row in self.per_step()[-last:]:
            labels = ", ".join(f"{k} {v['sent']:,}" for k, v in row["by_label"].items())
            lines.append(f"{row['step']:>5} {row['calls']:>6} {row['predicted_sent']:>15,} "
                         f"{row['sent']:>12,} {row['overhead_sent']:>9,}  {labels}")
        return "\n".join(lines)


# ---- where records come from ----------------------------------------------------------------
class _Local(threading.local):
    def __init__(self) -> None:
        self.active: list[TrafficRecord] = []  # records counting messages posted here
        self.labels: list[str] = []


_LOCAL = _Local()


@contextmanager
def label(name: str) -> Iterator[str]:
    """Records opened on this thread inside the block carry ``name``."""
    _LOCAL.labels.append(name)
    try:
        yield name
    finally:
        _LOCAL.labels.pop()


def ledger(group: Any = None) -> TrafficLedger:
    """The ledger of this rank (of ``group``'s process, default: the current process group)."""
    from ._group import current_state, resolve

    if group is not None:
        return resolve(group, "traffic.ledger").traffic
    state = current_state()
    if state is None:
        from ._errors import CommError

        raise CommError("traffic.ledger: no process group, expected dist.init_process_group() "
                        "first")
    return state.world.traffic


def open_record(pg: Any, kind: str, algorithm: str, payload: int,
                predicted: tuple[int, int], formula: str, native: bool = False
                ) -> TrafficRecord:
    """A record for a call about to run on ``pg`` (on the calling thread: label and step)."""
    book = pg.traffic
    rec = TrafficRecord(kind, algorithm, _LOCAL.labels[-1] if _LOCAL.labels else None,
                        book.step, list(pg.ranks), pg.rank, int(payload), int(predicted[0]),
                        int(predicted[1]), formula)
    if native:
        rec.sent = rec.recv = None
    return book.add(rec)


@contextmanager
def counting(record: TrafficRecord | None) -> Iterator[None]:
    """Messages posted on this thread inside the block are counted in ``record``."""
    if record is None:
        yield
        return
    _LOCAL.active.append(record)
    try:
        yield
    finally:
        _LOCAL.active.pop()


@dataclass
class Counters:
    """Totals of one process group's channels (every message, recorded or not)."""

    sent: int = 0
    recv: int = 0
    overhead_sent: int = 0
    overhead_recv: int = 0
    messages: int = 0


class CountingChannel:
    """A channel that counts the bytes of every message posted through it (module docstring).

    ``kind`` is ``"coll"`` (overhead: the call-check tag) or ``"p2p"`` (overhead: headers, on
    even tags). Everything else is delegated to the wrapped channel."""

    def __init__(self, inner: Any, kind: str, counters: Counters):
        self._inner = inner
        self._kind = kind
        self._counters = counters

    def _overhead(self, tag: int) -> bool:
        return tag == SIGNATURE_TAG if self._kind == "coll" else tag % 2 == 0

    def _count(self, direction: str, nbytes: int, tag: int) -> None:
        over = self._overhead(tag)
        c = self._counters
        c.messages += 1
        key = ("overhead_" if over else "") + direction
        setattr(c, key, getattr(c, key) + nbytes)
        if _LOCAL.active:
            rec = _LOCAL.active[-1]
            if rec.sent is not None:
                rec.messages += 1
                setattr(rec, key, getattr(rec, key) + nbytes)

    def isend(self, buf, dst: int, tag: int):
        self._count("sent", int(buf.nbytes), tag)
        return self._inner.isend(buf, dst, tag)

    def irecv(self, buf, src: int, tag: int):
        self._count("recv", int(buf.nbytes), tag)
        return self._inner.irecv(buf, src, tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
