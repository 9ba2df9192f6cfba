"""``explain(step_fn, *args)``: why one step needs the memory it needs.

The step runs once under :func:`needle.memory.profile`. Every buffer allocated inside it gets a
lifetime in event order (allocation to release, or to the end for what survives the step:
gradients, optimizer state, results); buffers alive before are there throughout. From those
lifetimes the liveness planner (:func:`needle.memory.plan`, the same one ``trace``/``Plan.run``
use) places everything allocated in the step in one arena. The explanation lays side by side:

* ``measured_peak_bytes``: the allocator's peak (blocks: 512 B rounding included);
* ``measured_requested_bytes``: its peak of requested bytes;
* ``liveness_bytes``: the most requested bytes live at one event according to the lifetimes
  (a lower bound for any placement; equal to the requested peak when nothing else allocates);
* ``planned_bytes``: bytes alive before the step and through it + the planner's arena for the
  other buffers (the step's own and those it releases; what a planned replay of the step
  would hold at most);

and lists the lifetimes that overlap at the peak, largest first: each buffer with its bytes,
shape, category, the op that made it, the Python line, and the ops at both ends of its
lifetime. The rows of :meth:`Explanation.gaps` name the terms between the numbers: allocator
rounding (measured − requested) and the planner's placement loss (arena − liveness).

Example:
    >>> import numpy as np, needle as ndl
    >>> d = ndl.cpu_numpy()
    >>> x = ndl.Tensor(np.ones((64, 64)), device=d)
    >>> e = explain(lambda t: (t * 2 + 1).sum().backward(), x)
    >>> e.liveness_bytes == e.measured_requested_bytes, e.overlapping[0]["op"] is not None
    (True, True)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ._text import columns, line_label, op_label, shape_label
from .planner import plan as _plan
from .profiler import profile

__all__ = ["explain", "Explanation"]


@dataclass
class Explanation:
    """What :func:`explain` found (see the module docstring). ``peak_event`` is -1 when the
    peak is the start (the step never rises above the bytes it began with)."""

    device: str
    measured_peak_bytes: int
    measured_requested_bytes: int
    liveness_bytes: int
    planned_bytes: int
    before_bytes: int
    arena_bytes: int
    peak_event: int
    peak_op: str | None
    peak_phase: str
    overlapping: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)

    def gaps(self) -> list[tuple[str, int]]:
        """Named differences between the numbers, in bytes."""
        return [("allocator rounding (blocks of 512 B)",
                 self.measured_peak_bytes - self.measured_requested_bytes),
                ("measured requested peak - liveness peak",
                 self.measured_requested_bytes - self.liveness_bytes),
                ("planner placement (arena - live bytes at its peak)",
                 self.planned_bytes - self.liveness_bytes)]

    def __str__(self) -> str:
        lines = [f"explain on {self.device}: peak at event {self.peak_event} "
                 f"({op_label(self.peak_op, self.peak_phase)}, {self.peak_phase})"]
        figures = [("measured peak (allocated blocks)", self.measured_peak_bytes),
                   ("measured peak (requested bytes)", self.measured_requested_bytes),
                   ("liveness peak (from lifetimes)", self.liveness_bytes),
                   ("planned: alive throughout", self.before_bytes),
                   ("planned: arena", self.arena_bytes),
                   ("planned: total", self.planned_bytes), *self.gaps()]
        lines += columns([[name, f"{value:,} B"] for name, value in figures], right=[1],
                         indent="  ")
        lines.append("  lifetimes overlapping at the peak:")
        rows = [["requested", "category", "shape", "op", "line", "lifetime", "freed by"]]
        for row in self.overlapping:
            before = row["start"] is None
            life = f"before..{row['end']}" if before else f"events {row['start']}..{row['end']}"
            rows.append([f"{row['requested']:,} B", row["category"], shape_label(row["shape"]),
                         op_label(row["op"], "before" if before else None),
                         line_label(row["line"], "before" if before else None), life,
                         row["freed_by"] or "(alive at the end)"])
        lines += columns(rows, right=[0], indent="    ")
        return "\n".join(lines)


def _lifetimes(recs: list, baseline: dict) -> list[dict]:
    """One row per buffer: requested bytes, [start, end] in event order, who made and freed it.

    ``start`` None for buffers alive before the step; ``end`` = len(recs) for survivors."""
    n = len(recs)
    live: dict = {}
    rows = []
    for block, b in baseline.items():
        live[block] = {"requested": b["requested"], "bytes": b["nbytes"], "start": None,
                       "end": n, "category": b["category"], "shape": b["shape"],
                       "op": b["op"], "line": None, "freed_by": None}
        rows.append(live[block])
    for i, r in enumerate(recs):
        if r.kind == "alloc":
            live[r.block] = {"requested": r.requested, "bytes": r.nbytes, "start": i, "end": n,
                             "category": r.category, "shape": r.shape, "op": r.op,
                             "line": r.line or r.user_line, "freed_by": None}
            rows.append(live[r.block])
        elif r.kind == "free" and r.block in live:
            row = live.pop(r.block)
            row["end"], row["freed_by"] = i, r.op or r.phase
        elif r.block in live:
            live[r.block]["category"] = r.category
    return rows


def explain(step_fn, *args, device=None, top: int = 12, **kwargs) -> Explanation:
    """Run ``step_fn(*args, **kwargs)`` once and explain its peak (module docstring).

    Args:
        step_fn: one step (forward, backward, optimizer step, or any part).
        device: the device to explain (default: the one with the most allocator events).
        top: how many overlapping lifetimes to list.
    """
    with profile(device) as prof:
        step_fn(*args, **kwargs)
    counts = {name: sum(r.device == name for r in prof.records) for name in prof.start_stats}
    name = max(counts, key=lambda n: counts[n]) if device is None else next(iter(prof.start_stats))
    recs = [r for r in prof.records if r.device == name]
    rows = _lifetimes(recs, prof.baseline.get(name, {}))
    before = sum(r["requested"] for r in rows if r["start"] is None)
    # requested bytes live after each event; the baseline counts from the start
    delta = [0] * (len(recs) + 1)
    for row in rows:
        if row["start"] is not None:
            delta[row["start"]] += row["requested"]
        if row["end"] < len(recs):
            delta[row["end"]] -= row["requested"]
    # at = -1: the peak is the start (no event rose above it; the first may be a free)
    live, best, at = before, before, -1
    for i in range(len(recs)):
        live += delta[i]
        if live > best:
            best, at = live, i
    # the planner places the step's own buffers; those alive before keep their bytes until
    # they are released, so they are planned too, as buffers defined at the start
    planned = [(r["requested"], 0 if r["start"] is None else r["start"], r["end"])
               for r in rows if r["start"] is not None or r["end"] < len(recs)]
    kept = sum(r["requested"] for r in rows if r["start"] is None and r["end"] == len(recs))
    arena = _plan(planned, alignment=1).peak_bytes if planned else 0
    overlapping = [r for r in rows
                   if (r["start"] is None or r["start"] <= at) and r["end"] > at]
    overlapping.sort(key=lambda r: -r["requested"])
    stats = prof.end_stats[name]
    peak = recs[at] if at >= 0 else None
    return Explanation(
        device=name, measured_peak_bytes=stats["peak_bytes"],
        measured_requested_bytes=stats["peak_requested_bytes"], liveness_bytes=best,
        planned_bytes=kept + arena, before_bytes=kept, arena_bytes=arena,
        peak_event=at, peak_op=peak.op if peak else None,
        peak_phase=peak.phase if peak else "before", overlapping=overlapping[:top],
        phases=prof.report()["devices"][name]["phases"])
