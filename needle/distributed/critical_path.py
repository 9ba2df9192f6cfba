"""What bounded each step of a traced job: the critical path through a merged trace.

A pure function of the trace :mod:`needle.distributed.tracing` writes (no processes, no
clocks), so it is tested on hand-made traces as well as real ones.

Data parallel (DDP, ZeRO, a single process). A collective completes on no rank before every
rank has joined it, so each synchronization point of a step (the ``gradient sync`` that waits
for the gradient collectives, and every collective the step calls itself, such as the count of
examples) is reached by all ranks and left together. The stretch before the k-th point is
bounded by the rank that reached it last: *its* spans in that stretch are on the critical path
(``forward``, ``backward``, ``slow-worker`` — the sleep ``--slow-worker`` injects, standing
for slow compute — and ``other`` for time no span covers), and so is its own time inside the
point (``gradient sync``, ``all_reduce``...: the communication its compute did not hide). The
other ranks' waiting is not. After the last point, the rank whose step ends last counts
(``optimizer``...). For the gradient sync this is the rule "the rank whose compute ends last
before the gradient collectives is critical".

Pipeline. A step's path is walked back from the action (``F``, ``B``, ``W``, ``SEND_*``,
``RECV_*``) that ends last across ranks, through dependencies: an action's predecessor is the
previous action on its rank, unless it is a receive that waited, i.e. the matching send (same
source, destination, tag and sequence number) started after the receive began; then the path
counts the receive's span from the send's start as ``transfer`` and continues on the sender,
in the action that posted the send, up to the send's start. Gaps between actions on the path
count as ``other``. Phases are ``forward`` (F), ``backward`` (B), ``weight gradient`` (W),
``send`` and ``receive`` (the part of a receive that did not wait).

Example:
    >>> def ev(pid, name, ts, dur, **args):
    ...     return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur,
    ...             "cat": "", "args": args}
    >>> trace = {"traceEvents": [
    ...     ev(1, "step", 0, 100, step=1), ev(1, "backward", 10, 20),
    ...     ev(1, "gradient sync", 30, 70),
    ...     ev(2, "step", 0, 100, step=1), ev(2, "slow-worker", 0, 50),
    ...     ev(2, "backward", 50, 40), ev(2, "gradient sync", 90, 10)]}
    >>> [(r["rank"], r["phase"], r["seconds"]) for r in critical_path(trace)]
    [(1, 'slow-worker', 5e-05), (1, 'backward', 4e-05), (1, 'gradient sync', 1e-05)]
"""
from __future__ import annotations

from collections import defaultdict

__all__ = ["critical_path", "step_paths", "PIPELINE_PHASES"]

PIPELINE_PHASES = {"F": "forward", "B": "backward", "W": "weight gradient", "SEND_F": "send",
                   "SEND_B": "send", "RECV_F": "receive", "RECV_B": "receive"}


class _Span:
    __slots__ = ("rank", "tid", "name", "cat", "begin", "end", "args")

    def __init__(self, e: dict):
        self.rank, self.tid, self.name, self.cat = e["pid"] - 1, e["tid"], e["name"], e["cat"]
        self.begin, self.end, self.args = e["ts"], e["ts"] + e.get("dur", 0.0), e["args"]


def _spans(trace: dict) -> list[_Span]:
    return sorted((_Span(e) for e in trace["traceEvents"] if e.get("ph") == "X"),
                  key=lambda s: (s.begin, -s.end))


def _inside(outer: _Span, spans: list[_Span]) -> list[_Span]:
    return [s for s in spans if s.rank == outer.rank and s.tid == outer.tid and s is not outer
            and s.begin >= outer.begin and s.end <= outer.end]


def _children(outer: _Span, spans: list[_Span]) -> list[_Span]:
    """The spans directly inside ``outer`` (not inside another span inside it)."""
    inner = _inside(outer, spans)
    return [s for s in inner if not any(o is not s and o.begin <= s.begin and s.end <= o.end
                                        and (o.begin, -o.end) != (s.begin, -s.end)
                                        for o in inner)]


def _measured(inner: list[_Span]) -> list[_Span]:
    """The spans of a step that are not the meters' own work (``metrics`` spans run the
    model's copies, a pipeline's actions included, to predict memory)."""
    meters = [x for x in inner if x.name == "metrics"]
    return [x for x in inner if not any(m.begin <= x.begin and x.end <= m.end and x is not m
                                        for m in meters)]


def step_paths(trace: dict) -> list[dict]:
    """Per step: ``{"step", "kind": "data-parallel" | "pipeline", "path": {(rank, phase):
    microseconds}}``, in step order."""
    spans = _spans(trace)
    steps: dict[int, list[_Span]] = defaultdict(list)
    for s in spans:
        if s.name == "step" and "step" in s.args:
            steps[int(s.args["step"])].append(s)
    out = []
    for n in sorted(steps):
        per_rank = steps[n]
        inner = {s.rank: _measured(_inside(s, spans)) for s in per_rank}
        if any(x.cat == "pipeline" for xs in inner.values() for x in xs):
            path = _pipeline_step(per_rank, inner, spans)
            kind = "pipeline"
        else:
            path = _data_parallel_step(per_rank, inner, spans)
            kind = "data-parallel"
        if path:
            out.append({"step": n, "kind": kind, "path": path})
    return out


def critical_path(trace: dict) -> list[dict]:
    """Seconds on the critical path by rank and phase, summed over the steps, longest first:
    ``[{"rank", "phase", "seconds"}]`` (``summary.json``'s ``critical_path``)."""
    total: dict[tuple[int, str], float] = defaultdict(float)
    for step in step_paths(trace):
        for key, us in step["path"].items():
            total[key] += us
    rows = [{"rank": r, "phase": p, "seconds": round(us / 1e6, 9)}
            for (r, p), us in total.items() if us > 0]
    return sorted(rows, key=lambda row: (-row["seconds"], row["rank"], row["phase"]))


# ---- data parallel ---------------------------------------------------------------------------
def _data_parallel_step(per_rank: list[_Span], inner: dict, spans: list[_Span]) -> dict:
    """Cut each rank's step at its synchronization points (``gradient sync`` and every
    collective called from the step itself); the k-th segment is bounded by the rank that
    reached the k-th point last. It counts that rank's spans up to the point and its time in
    the point (the communication it did not hide); the step's tail after the last point counts
    for the rank whose step ends last."""
    steps = {s.rank: s for s in per_rank}
    children = {r: _children(s, spans) for r, s in steps.items()}
    points = {r: [c for c in cs if c.name == "gradient sync" or c.cat == "collective"]
              for r, cs in children.items()}
    if len({len(p) for p in points.values()}) != 1:  # ranks disagree: no common points
        points = {r: [] for r in points}
    path: dict[tuple[int, str], float] = defaultdict(float)
    count = len(next(iter(points.values())))
    for k in range(count + 1):
        if k < count:
            critical = max(points, key=lambda r: (points[r][k].begin, -r))
            end_span = points[critical][k]
            lo, hi = _segment_start(steps[critical], points[critical], k), end_span.begin
            path[(critical, end_span.name)] += end_span.end - end_span.begin
        else:
            critical = max(steps, key=lambda r: (steps[r].end, -r))
            lo, hi = _segment_start(steps[critical], points[critical], k), steps[critical].end
        _count_between(path, critical, children[critical], lo, hi)
    return dict(path)


def _segment_start(step: _Span, points: list[_Span], k: int) -> float:
    return step.begin if k == 0 else points[k - 1].end


def _count_between(path: dict, rank: int, children: list[_Span], lo: float, hi: float) -> None:
    """The spans of ``rank`` within [lo, hi) by name, the rest as ``other``."""
    covered = 0.0
    for c in children:
        if c.begin >= lo and c.end <= hi and c.name != "gradient sync" and c.cat != "collective":
            path[(rank, c.name)] += c.end - c.begin
            covered += c.end - c.begin
    path[(rank, "other")] += max(hi - lo - covered, 0.0)


# ---- pipeline --------------------------------------------------------------------------------
def _pipeline_step(per_rank: list[_Span], inner: dict, spans: list[_Span]) -> dict:
    actions = {r: sorted((x for x in xs if x.cat == "pipeline"), key=lambda x: x.begin)
               for r, xs in inner.items()}
    sends = {}
    recvs: dict[int, list[_Span]] = {}
    for r, xs in inner.items():
        for x in xs:
            if x.cat == "p2p":
                key = (x.args["src"], x.args["dst"], x.args["tag"], x.args["seq"])
                if x.name == "send":
                    sends[key] = x
                else:
                    recvs.setdefault(r, []).append(x)
    last = max((a for xs in actions.values() for a in xs), key=lambda a: a.end, default=None)
    path: dict[tuple[int, str], float] = defaultdict(float)
    current, cut = last, None if last is None else last.end
    budget = 2 * sum(len(xs) for xs in actions.values())  # each hop moves back in time
    while current is not None and budget > 0:
        budget -= 1
        rank, phase = current.rank, PIPELINE_PHASES.get(current.name, current.name)
        waited = _waited_send(current, recvs.get(rank, []), sends)
        if waited is not None and waited.begin > current.begin:
            path[(rank, "transfer")] += max(cut - waited.begin, 0.0)
            current, cut = _action_at(actions.get(waited.rank, []), waited.begin), waited.begin
            if current is None:
                break
            continue
        path[(rank, phase)] += max(cut - current.begin, 0.0)
        previous = _previous(actions[rank], current)
        if previous is not None:
            path[(rank, "other")] += max(current.begin - previous.end, 0.0)
        current, cut = previous, None if previous is None else previous.end
    return dict(path)


def _waited_send(action: _Span, recvs: list[_Span], sends: dict) -> _Span | None:
    """The send that the last receive inside ``action`` matched, if it was traced."""
    for r in reversed(recvs):
        if action.begin <= r.begin and r.end <= action.end:
            return sends.get((r.args["src"], r.args["dst"], r.args["tag"], r.args["seq"]))
    return None


def _action_at(actions: list[_Span], t: float) -> _Span | None:
    for a in actions:
        if a.begin <= t <= a.end:
            return a
    return None


def _previous(actions: list[_Span], current: _Span) -> _Span | None:
    i = actions.index(current)
    return actions[i - 1] if i > 0 else None
