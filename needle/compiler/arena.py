"""Which intermediates a compiled step's arena holds: never more memory than the eager call.

A replay takes its arena whole before the step's first kernel and gives it back after the
last; every buffer the plan does not place in it comes from the device's pools, when the
traced call asked for it, as eagerly. Putting *every* intermediate in the arena (what
:func:`needle.memory.plan` alone does) can need more than the eager call, for three reasons
the eager call does not have:

* the arena exists before the step starts, beside what the step frees first: a training step
  drops the previous step's gradients (``opt.reset_grad()``), an optimiser its replaced
  weights and moments; eagerly the activations reuse those bytes;
* what outlives the call (new gradients, weights, moments, the result) is made beside the
  whole arena, also after the activations died;
* every buffer in the arena takes a multiple of the alignment (256 B), a 4-byte scalar or a
  128-byte bias row included.

:func:`plan_arena` therefore chooses the buffers the arena holds. The trace gives each
buffer's life in steps and the order of everything else the call allocated or freed
(:func:`outside_events`), so the peak of a replay follows for any choice: the arena plus the
most bytes the pools ever hold above those live before the call. Buffers are placed largest
first at the lowest offset free during their life, within a capacity; a capacity whose replay
would pass the eager peak shrinks by the excess, and the first one within it is kept. The
empty arena is the eager call itself, so the search always ends within the eager peak.

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle.memory import trace
    >>> x = ndl.Tensor(np.ones((64, 64)), device=ndl.cpu_numpy(), requires_grad=False)
    >>> choice = plan_arena(trace(lambda t: ((t * 2 + 1) * 3).sum(), x))
    >>> choice.planned_peak_bytes <= choice.eager_peak_bytes
    True
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from needle.memory import plan as plan_all
from needle.memory.planner import Plan, lower_bound

__all__ = ["ArenaChoice", "plan_arena", "outside_events", "replay_peak", "ALIGNMENT",
           "POLICIES"]

ALIGNMENT = 256  # what needle.memory.plan uses: the C++ allocator's block alignment
POLICIES = ("bounded", "all")


@dataclass(frozen=True)
class ArenaChoice:
    """A plan for :func:`needle.memory.replay.run_plan` (``plan``: offsets of the buffers in
    the arena; the others come from the pools) and what a replay of it needs:
    ``planned_peak_bytes``, requested bytes above those live before the call (the arena
    plus the pools' peak), against the traced call's ``eager_peak_bytes``; ``arena_buffers``
    of ``intermediates`` and ``arena_share`` (of their requested bytes) are in the arena."""

    plan: Plan
    planned_peak_bytes: int
    eager_peak_bytes: int
    arena_buffers: int
    intermediates: int
    arena_share: float
    policy: str


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def outside_events(graph) -> list[tuple[int, int]] | None:
    """``(step, bytes)`` of every allocation and release of the traced call that is not a
    planned intermediate (outputs made, buffers from before freed), or None when the trace
    does not account for them.

    The trace counts one step per allocation, per release and per op; it keeps the
    outside changes in order but without their steps. Allocations, releases of
    intermediates, releases of earlier buffers the ops read and the op steps are known; the
    steps left over are the releases of earlier buffers no op read. Checked: one step per
    change, each output's bytes at its own allocation, and the eager peak of the trace.
    """
    end = graph.end_index
    outputs = {t.def_index: t.nbytes for t in graph.tensors if t.kind == "output"}
    inter = [t for t in graph.tensors if t.kind == "intermediate"]
    known = ({t.def_index for t in inter} | {t.last_use for t in inter}
             | {n.index for n in graph.ops})
    earlier = {t.last_use for t in graph.tensors
               if t.kind in ("input", "parameter") and t.last_use < end}
    unread = set(range(1, end)) - known - earlier - set(outputs)
    steps = sorted(set(outputs) | earlier | unread)
    deltas = graph.outside_deltas
    counted = 2 * len(inter) + len(graph.ops) + len(outputs) + len(earlier)
    if len(steps) != len(deltas) or len(known | earlier | set(outputs)) != counted:
        return None  # two events on one step: not the trace this account reads
    events = list(zip(steps, deltas, strict=True))
    if any((s in outputs) != (d > 0) or (s in outputs and d != outputs[s]) for s, d in events):
        return None
    changes = dict(events)
    for t in inter:
        changes[t.def_index] = t.nbytes
        changes[t.last_use] = -t.nbytes
    level = top = 0
    for step in sorted(changes):
        level += changes[step]
        top = max(top, level)
    return events if top == graph.eager_peak_bytes else None


def _base(events, end: int) -> np.ndarray:
    """Per step, the change of requested bytes from outside the arena's candidates."""
    base = np.zeros(end + 1, dtype=np.int64)
    for step, delta in events:
        base[step] += delta
    return base


def _peak(base: np.ndarray, inter: list, in_arena: set, arena_bytes: int) -> int:
    """Requested bytes above those before the call, at the highest point of a replay whose
    arena (held throughout) has ``arena_bytes`` and holds ``in_arena``."""
    level = base.copy()
    for t in inter:
        if t.id not in in_arena:
            level[t.def_index] += t.nbytes
            level[t.last_use] -= t.nbytes
    return arena_bytes + max(int(np.cumsum(level).max(initial=0)), 0)


def replay_peak(graph, plan: Plan) -> int | None:
    """The peak requested bytes above those live before a replay of ``plan`` (None when the
    trace does not account for the buffers outside its intermediates)."""
    events = outside_events(graph)
    if events is None:
        return None
    inter = [t for t in graph.tensors if t.kind == "intermediate"]
    return _peak(_base(events, graph.end_index), inter, set(plan.assignments), plan.peak_bytes)


def _place(inter: list, capacity: int) -> dict[int, int]:
    """Largest first, each at the lowest aligned offset free during its life, if below
    ``capacity``; returns tensor id -> offset of those placed."""
    order = sorted(inter, key=lambda t: (-_align(t.nbytes), t.def_index, t.id))
    n = len(order)
    starts, ends = np.empty(n, np.int64), np.empty(n, np.int64)
    lows, highs = np.empty(n, np.int64), np.empty(n, np.int64)
    placed, offsets = 0, {}
    for t in order:
        size = _align(t.nbytes)
        if size > capacity:
            continue
        live = (starts[:placed] <= t.last_use) & (t.def_index <= ends[:placed])
        cursor = 0
        if live.any():
            busy = np.argsort(lows[:placed][live], kind="stable")
            for lo, hi in zip(lows[:placed][live][busy], highs[:placed][live][busy],
                              strict=True):
                if lo >= cursor + size:
                    break
                cursor = max(cursor, int(hi))
        if cursor + size > capacity:
            continue
        offsets[t.id] = cursor
        starts[placed], ends[placed] = t.def_index, t.last_use
        lows[placed], highs[placed] = cursor, cursor + size
        placed += 1
    return offsets


def _choice(graph, assignments: dict, planned: int, policy: str, strategy: str):
    inter = [t for t in graph.tensors if t.kind == "intermediate"]
    sizes = {t.id: _align(t.nbytes) for t in inter}
    arena = max((assignments[i] + sizes[i] for i in assignments), default=0)
    plan = Plan(arena, sum(sizes.values()),
                lower_bound([(sizes[t.id], t.def_index, t.last_use) for t in inter]),
                dict(assignments), {i: sizes[i] for i in assignments}, strategy, graph)
    total = sum(t.nbytes for t in inter)
    share = sum(t.nbytes for t in inter if t.id in assignments) / total if total else 1.0
    return ArenaChoice(plan, planned, graph.eager_peak_bytes, len(assignments), len(inter),
                       share, policy)


def plan_arena(graph, policy: str = "bounded") -> ArenaChoice:
    """Plan the arena of a traced call (module docstring).

    ``policy``: ``"bounded"`` (default) keeps a replay's peak within the traced call's eager
    peak; ``"all"`` puts every intermediate in the arena (the fewest pool requests, the
    smallest arena for them, a peak that may pass the eager one).
    """
    if policy not in POLICIES:
        raise ValueError(f"plan_arena: unknown policy, expected one of {POLICIES}, got "
                         f"{policy!r}")
    full = plan_all(graph, alignment=ALIGNMENT)
    events = outside_events(graph)
    if events is None:  # no exact account: all in the arena, or the eager call itself
        if policy == "all":
            return _choice(graph, full.assignments, graph.planned_peak_bytes(full), policy,
                           full.strategy)
        return _choice(graph, {}, graph.eager_peak_bytes, policy, "pools (no account)")
    inter = [t for t in graph.tensors if t.kind == "intermediate"]
    base = _base(events, graph.end_index)
    everything = _peak(base, inter, set(full.assignments), full.peak_bytes)
    eager = graph.eager_peak_bytes
    if policy == "all" or everything <= eager:
        return _choice(graph, full.assignments, everything, policy, full.strategy)
    capacity = full.peak_bytes
    while capacity > 0:
        offsets = _place(inter, capacity)
        arena = max((offsets[i] + _align(t.nbytes) for t in inter
                     for i in (t.id,) if i in offsets), default=0)
        peak = _peak(base, inter, set(offsets), arena)
        if peak <= eager:
            return _choice(graph, offsets, peak, policy, "bounded greedy_by_size")
        capacity = min(capacity, arena) - _align(peak - eager)
    return _choice(graph, {}, _peak(base, inter, set(), 0), policy, "pools")
