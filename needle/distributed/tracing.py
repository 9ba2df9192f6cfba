"""One merged timeline of a distributed job, in the Chrome trace-event JSON format.

Every rank records spans (forward, backward, optimizer, each collective and point-to-point
call with its bytes and peer, gradient-sync buckets, pipeline actions, parameter-server
push/pull, checkpoint saves) into a bounded in-memory buffer. At :func:`stop` each rank writes
its part next to the trace file and rank 0 merges the parts into one file: one process track
per rank, one thread track per Python thread (``main``, the communication thread, the
gradient-sync buckets). It opens in Perfetto (ui.perfetto.dev) or ``chrome://tracing``.

Off, the cost is one module-level flag check per instrumentation point: :func:`span` returns a
shared no-op context manager.

Clocks. Each rank stamps events with its own monotonic clock (``time.perf_counter``), whose
origin differs between machines. At :func:`start`, every rank measures its offset to rank 0
with a few ping-pongs (NTP's midpoint rule): rank ``r`` sends its time ``t1``, rank 0 answers
with its time ``t0``, ``r`` reads ``t2`` on arrival and estimates ``offset = t0 - (t1 + t2)/2``;
of ``rounds`` tries the one with the shortest round trip wins. The residual error is at most
half that round trip (assuming nothing about how it splits between the two directions); it is
written into the trace's metadata per rank (``clock_error_us``) so a reader knows how far
apart two ranks' events can be trusted. Drift over a job of minutes is far smaller.

Example:
    >>> import numpy as np, os, tempfile, needle.distributed as dist
    >>> from needle.distributed import tracing
    >>> path = os.path.join(tempfile.mkdtemp(), "trace.json")
    >>> with tracing.trace(path):
    ...     with tracing.span("work", "compute"):
    ...         _ = np.ones(1000).sum()
    >>> import json; [e["name"] for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
    ['work']
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

__all__ = ["trace", "start", "stop", "enabled", "span", "complete", "instant", "now",
           "p2p_span", "collective_span", "gradient_sync",
           "DEFAULT_CAPACITY", "CLOCK_TAG"]

DEFAULT_CAPACITY = 200_000  # events per rank; the oldest go first
CLOCK_TAG = (1 << 28) - 2   # the p2p tag of the clock ping-pongs at start
_PART_WAIT_S = 120.0        # how long rank 0 waits for the other ranks' parts

_ON = False                 # the one check every instrumentation point makes


class _Sink(dict):
    """What a span yields when tracing is off: arguments set on it go nowhere."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


_NULL = nullcontext(_Sink())
_skew = 0.0                 # added to this process's clock (tests simulate another machine)


class _State:
    def __init__(self, path: str | None, capacity: int, rank: int, world: int, group: Any,
                 role: str | None):
        self.path, self.rank, self.world, self.group, self.role = path, rank, world, group, role
        self.events: deque = deque(maxlen=capacity)
        self.offset, self.error = 0.0, 0.0
        self.threads: dict[int, str] = {}
        self.seq: Counter = Counter()


_state: _State | None = None


def enabled() -> bool:
    """Whether this process is recording a trace now."""
    return _ON


def now() -> float:
    """This process's trace clock in seconds (``time.perf_counter`` plus any test skew)."""
    return time.perf_counter() + _skew


def _thread() -> str:
    t = threading.current_thread()
    return "main" if t is threading.main_thread() else t.name


def complete(name: str, cat: str, begin: float, end: float, *, thread: str | None = None,
             **args: Any) -> None:
    """Record a span that already happened, from ``begin`` to ``end`` (``time.perf_counter``
    seconds, as needle's own timelines keep them) on ``thread`` (default: the caller's)."""
    if not _ON or _state is None:
        return
    _state.events.append(("X", name, cat, begin + _skew, max(end - begin, 0.0),
                          thread or _thread(), args))


def instant(name: str, cat: str, at: float | None = None, *, thread: str | None = None,
            **args: Any) -> None:
    """Record a moment (``at``: ``time.perf_counter`` seconds, default now)."""
    if not _ON or _state is None:
        return
    when = now() if at is None else at + _skew
    _state.events.append(("i", name, cat, when, 0.0, thread or _thread(), args))


class _Span:
    __slots__ = ("name", "cat", "args", "begin")

    def __init__(self, name: str, cat: str, args: dict):
        self.name, self.cat, self.args = name, cat, args

    def __enter__(self) -> dict:
        self.begin = time.perf_counter()
        return self.args  # the caller may add arguments known only at the end

    def __exit__(self, *exc: Any) -> None:
        complete(self.name, self.cat, self.begin, time.perf_counter(), **self.args)


def span(name: str, cat: str, **args: Any) -> Any:
    """A context manager recording the block as a span ``name`` of category ``cat`` with
    ``args`` (a no-op when not tracing). ``with span(...) as a: a["bytes"] = n`` adds
    arguments at the end.

    Example:
        >>> with span("forward", "compute", step=3):
        ...     pass
    """
    if not _ON:
        return _NULL
    return _Span(name, cat, args)


def p2p_span(direction: str, pg: Any, peer: int, tag: int, nbytes: int) -> Any:
    """A span for one send or receive between this rank and group rank ``peer``: its global
    ranks, tag, bytes and sequence number (the n-th send from a to b on a tag is matched by
    the n-th receive at b from a on that tag)."""
    if not _ON or _state is None or tag == CLOCK_TAG:
        return _NULL
    me, other = pg.ranks[pg.rank], pg.ranks[peer]
    src, dst = (me, other) if direction == "send" else (other, me)
    key = (tuple(pg.ranks), src, dst, tag)
    _state.seq[key] += 1
    return _Span(direction, "p2p", {"src": src, "dst": dst, "tag": tag, "bytes": int(nbytes),
                                    "seq": _state.seq[key]})


def collective_span(where: str, pg: Any, record: Any) -> Any:
    """A span for one collective on ``pg`` (its traffic ``record`` gives the payload bytes,
    the algorithm and the label open where it was called, e.g. "ddp gradients")."""
    if not _ON:
        return _NULL
    args = {"ranks": list(pg.ranks)}
    if record is not None:
        args.update(bytes=record.payload_bytes, algorithm=record.algorithm, label=record.label)
    return _Span(where, "collective", args)


def gradient_sync(step: dict, owner: str) -> None:
    """The buckets of one synchronized step of a gradient sync (its ``timeline`` entry) on a
    "gradient sync" track: each bucket's ``ready`` and ``launch`` moments and its collective
    from start to finish."""
    if not _ON:
        return
    for b in step["buckets"]:
        args = {"bucket": b["index"], "bytes": b["bytes"], "owner": owner}
        for what in ("ready", "launched"):
            if b[what] is not None:
                instant(f"bucket {what.replace('launched', 'launch')}", "gradient sync",
                        b[what], thread="gradient sync", **args)
        if b["started"] is not None and b["done"] is not None:
            complete("bucket collective", "gradient sync", b["started"], b["done"],
                     thread="gradient sync", **args)


# ---- start and stop ------------------------------------------------------------------------
def start(path: str | None, *, group: Any = None, capacity: int = DEFAULT_CAPACITY,
          rounds: int = 8, role: str | None = None) -> None:
    """Start recording on this rank (collective over ``group``, default the world when a
    process group exists: the ranks align their clocks to rank 0's).

    Args:
        path: the merged trace rank 0 writes at :func:`stop` (each rank's part goes to
            ``path + ".rankR"`` first); None keeps the events in memory only.
        capacity: events kept per rank (the oldest are dropped beyond it).
        rounds: clock ping-pongs per rank; the one with the shortest round trip counts.
        role: a word shown beside the rank in the track's name ("server", "worker").
    """
    global _ON, _state
    if capacity < 1 or rounds < 1:
        from ._errors import CommError

        raise CommError(f"tracing.start: expected capacity >= 1 and rounds >= 1, got "
                        f"capacity={capacity}, rounds={rounds}")
    pg = _group(group)
    rank, world = (0, 1) if pg is None else (pg.ranks[pg.rank], pg.size)
    state = _State(path, capacity, rank, world, pg, role)
    if pg is not None and pg.size > 1:
        state.offset, state.error = _align(pg, rounds)
    _state, _ON = state, True


def _group(group: Any) -> Any:
    from . import process_group

    if group is None and not process_group.is_initialized():
        return None
    from ._group import resolve

    return resolve(group, "tracing")


def _align(pg: Any, rounds: int) -> tuple[float, float]:
    """(offset to rank 0's clock, half the best round trip) in seconds; rank 0 answers the
    other ranks in turn."""
    from .p2p import recv_object, send_object

    if pg.rank == 0:
        for peer in range(1, pg.size):
            for _ in range(rounds):
                recv_object(peer, tag=CLOCK_TAG, group=pg)
                send_object(now(), peer, tag=CLOCK_TAG, group=pg)
        return 0.0, 0.0
    best = (float("inf"), 0.0)
    for _ in range(rounds):
        t1 = now()
        send_object(t1, 0, tag=CLOCK_TAG, group=pg)
        t0 = float(recv_object(0, tag=CLOCK_TAG, group=pg))
        t2 = now()
        best = min(best, (t2 - t1, t0 - (t1 + t2) / 2))
    return best[1], best[0] / 2


def stop() -> dict | None:
    """Stop recording; write this rank's part and, on rank 0, merge every part into the trace
    file. Returns the merged trace (a dict) on rank 0 when a path was given, else None."""
    global _ON, _state
    state, _ON, _state = _state, False, None
    if state is None or state.path is None:
        return None
    part = _part(state)
    _atomic_json(f"{state.path}.rank{state.rank}", part)
    if state.rank != 0:
        return None
    parts = [part] + _wait_parts(state.path, state.world)
    merged = merge(parts)
    _atomic_json(state.path, merged)
    for r in range(1, state.world):
        try:
            os.remove(f"{state.path}.rank{r}")
        except OSError:
            pass
    os.remove(f"{state.path}.rank0")
    return merged


@contextmanager
def trace(path: str | None, **kwargs: Any) -> Iterator[None]:
    """Record a trace of the block on every rank into ``path`` (see :func:`start`); rank 0
    writes the merged file when the block ends.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "t.json")
        >>> with trace(path):
        ...     instant("hello", "mark")
        >>> os.path.exists(path)
        True
    """
    start(path, **kwargs)
    try:
        yield
    finally:
        stop()


def _part(state: _State) -> dict:
    """This rank's events on rank 0's clock, in microseconds."""
    shift = state.offset
    events = [{"ph": ph, "name": name, "cat": cat, "ts": (t + shift) * 1e6, "dur": dur * 1e6,
               "thread": thread, "args": args}
              for ph, name, cat, t, dur, thread, args in state.events]
    return {"rank": state.rank, "role": state.role, "world_size": state.world,
            "clock_offset_us": state.offset * 1e6, "clock_error_us": state.error * 1e6,
            "events": events}


def _atomic_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, default=str)
    os.replace(tmp, path)


def _wait_parts(path: str, world: int) -> list[dict]:
    """The other ranks' parts, waiting for each up to a deadline (a rank that died leaves a
    gap, named in the trace's metadata, rather than a hang)."""
    deadline = time.monotonic() + _PART_WAIT_S
    parts = []
    for r in range(1, world):
        name = f"{path}.rank{r}"
        while not os.path.exists(name) and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.path.exists(name):
            with open(name) as f:
                parts.append(json.load(f))
    return parts


def merge(parts: list[dict]) -> dict:
    """One Chrome trace from the ranks' parts: a process per rank (pid = rank + 1, as pid 0
    is reserved in some viewers), a thread per recorded thread, timestamps from the earliest
    event. ``metadata`` names each rank's clock offset and its error bound."""
    origin = min((e["ts"] for p in parts for e in p["events"]), default=0.0)
    out: list[dict] = []
    for p in sorted(parts, key=lambda p: p["rank"]):
        pid = p["rank"] + 1
        label = f"rank {p['rank']}" + (f" ({p['role']})" if p.get("role") else "")
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": label}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": p["rank"]}})
        tids = {"main": 1}
        for e in p["events"]:
            tids.setdefault(e["thread"], len(tids) + 1)
        for thread, tid in tids.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": thread}})
        for e in p["events"]:
            event = {"ph": e["ph"], "name": e["name"], "cat": e["cat"], "pid": pid,
                     "tid": tids[e["thread"]], "ts": round(e["ts"] - origin, 3),
                     "args": e["args"]}
            if e["ph"] == "X":
                event["dur"] = round(e["dur"], 3)
            else:
                event["s"] = "t"
            out.append(event)
    meta = {"ranks": [{"rank": p["rank"], "role": p.get("role"),
                       "clock_offset_us": p["clock_offset_us"],
                       "clock_error_us": p["clock_error_us"], "events": len(p["events"])}
                      for p in parts],
            "world_size": parts[0]["world_size"] if parts else 0,
            "missing_ranks": sorted(set(range(parts[0]["world_size"] if parts else 0))
                                    - {p["rank"] for p in parts})}
    return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": meta}
