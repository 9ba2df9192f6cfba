"""Predict a pipeline schedule's timeline, bubble and activation memory from its action lists.

The model: each rank runs its actions in order. ``F``, ``B`` and ``W`` take their stage's
cost; a send takes no time on the sender and its message arrives ``comm`` later; a receive
ends when the rank reaches it or when the message arrives, whichever is later (waiting is
idle time). A micro-batch's activations on a stage are held from the end of its ``F`` until
the end of its ``B`` (its ``W`` when the backward is split).

``bubble_fraction = 1 - (sum of every rank's compute time) / (ranks x makespan)``. For GPipe
with no communication cost this is ``(p - 1) / (m + p - 1)``: 3/11 for 4 stages and 8
micro-batches.

Example:
    >>> sim = simulate("gpipe", stages=4, microbatches=8)
    >>> round(sim.bubble_fraction, 4), sim.peak_inflight
    (0.2727, [8, 8, 8, 8])
    >>> simulate("1f1b", stages=4, microbatches=8).peak_inflight
    [4, 3, 2, 1]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .schedules import COMPUTE, Action, Plan, ScheduleError, canonical_name, make_plan

Number = float | int


@dataclass(frozen=True)
class Event:
    """One action on the timeline of a rank (times in the cost model's unit)."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


@dataclass
class Simulation:
    """What :func:`simulate` predicts. Lists are indexed by rank (``stages`` = ranks)."""

    plan: Plan
    timeline: list[list[Event]]
    makespan: float
    busy: list[float]
    bubble_fraction: float
    bubble_per_rank: list[float]
    peak_inflight: list[int]
    peak_activation_bytes: list[float]
    costs: dict = field(default_factory=dict)

    @property
    def schedule(self) -> str:
        return self.plan.name

    def text(self, width: int = 120) -> str:
        """The timeline as text: two lines per rank (action kind, micro-batch mod 10)."""
        from .render import timeline_text

        return timeline_text(self, width)

    def plot(self, path: str) -> str:
        """Draw the timeline to ``path`` (PNG): one row per rank, F/B/W coloured, bubble grey."""
        from .render import plot_timeline

        return plot_timeline(self, path)

    def as_dict(self) -> dict:
        return {"schedule": self.plan.name, "stages": self.plan.num_ranks,
                "virtual_stages": self.plan.virtual_stages,
                "microbatches": self.plan.num_microbatches, "makespan": self.makespan,
                "bubble_fraction": self.bubble_fraction, "bubble_per_rank": self.bubble_per_rank,
                "peak_inflight": self.peak_inflight,
                "peak_activation_bytes": self.peak_activation_bytes, "costs": self.costs}


def _per_stage(name: str, value, num_stages: int) -> list[float]:
    if value is None:
        return [0.0] * num_stages
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
    else:
        values = [float(x) for x in value]
    if len(values) != num_stages or any(not math.isfinite(x) or x < 0 for x in values):
        raise ScheduleError(f"simulate: {name} must be a non-negative number or one per stage, "
                            f"expected {num_stages} values, got {value!r}")
    return values


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _costs(plan_name: str, num_stages: int, forward, backward, weight) -> dict[str, list[float]]:
    """Per-stage cost of F, B, W. ``weight=None``: ``backward`` is the whole backward (split
    schedules then give half of it to B and half to W); else B costs ``backward`` and W
    ``weight`` when split, and a fused backward costs their sum."""
    f = _per_stage("forward", forward, num_stages)
    b = _per_stage("backward", backward, num_stages)
    split = plan_name == "zero-bubble"
    if weight is None:
        w = [x / 2 for x in b] if split else [0.0] * num_stages
        b = [x / 2 for x in b] if split else b
    else:
        w = _per_stage("weight", weight, num_stages)
        if not split:
            b, w = [x + y for x, y in zip(b, w, strict=True)], [0.0] * num_stages
    return {"F": f, "B": b, "W": w}


def simulate(schedule, stages: int | None = None, microbatches: int | None = None,
             forward: Number | Sequence[Number] = 1.0, backward: Number | Sequence[Number] = 2.0,
             weight: Number | Sequence[Number] | None = None, comm: Number = 0.0,
             activation_bytes: Number | Sequence[Number] = 1.0,
             virtual_stages: int | None = None, send_time: Number = 0.0,
             overhead: Number = 0.0) -> Simulation:
    """Predict the timeline of ``schedule`` on ``stages`` ranks with ``microbatches``.

    Args:
        schedule: "gpipe", "1f1b", "interleaved", "zero-bubble", a schedule class, or a
            :class:`Plan` (then ``stages``/``microbatches`` may be omitted).
        forward, backward, weight: cost of one micro-batch's F, B and W on a stage, one number
            or one per stage (``stages x virtual_stages`` values). ``weight=None`` means that
            ``backward`` is the whole backward; split schedules then give half to B, half to W.
        comm: time for a message between ranks (receives wait for it).
        activation_bytes: bytes one micro-batch holds on a stage between F and B/W (number or
            one per stage); the default 1 makes ``peak_activation_bytes`` a count.
        virtual_stages: chunks per rank (interleaved).
        send_time: time a send occupies its rank (copying the data out), not compute.
        overhead: idle time before every action (the runtime's own bookkeeping); this and
            ``send_time`` let a prediction fitted to a measured run account for everything.

    Returns:
        :class:`Simulation` with ``timeline`` (per rank), ``bubble_fraction``,
        ``peak_inflight`` and ``peak_activation_bytes`` (per rank).

    Raises:
        ScheduleError: bad sizes or costs, or a plan that deadlocks (naming the stuck actions).

    Example:
        >>> round(simulate("gpipe", 4, 28).bubble_fraction, 4)
        0.0968
    """
    plan = schedule if isinstance(schedule, Plan) else None
    if plan is None:
        if stages is None or microbatches is None:
            raise ScheduleError("simulate: stages and microbatches are required with a "
                                f"schedule name, got stages={stages}, microbatches={microbatches}")
        name = canonical_name(schedule)
        s = stages * (virtual_stages or (2 if name == "interleaved" else 1))
        c = _costs(name, s, forward, backward, weight)
        plan = make_plan(name, stages, microbatches, virtual_stages, _mean(c["F"]),
                         _mean(c["B"]), _mean(c["W"]) or 1.0, float(comm))
    costs = _costs(plan.name, plan.num_stages, forward, backward, weight)
    act = _per_stage("activation_bytes", activation_bytes, plan.num_stages)
    for name, value in (("comm", comm), ("send_time", send_time), ("overhead", overhead)):
        if not math.isfinite(float(value)) or value < 0:
            raise ScheduleError(f"simulate: {name} must be a non-negative number, got "
                                f"{value!r}")
    costs["SEND"], costs["GAP"] = float(send_time), float(overhead)
    return _run(plan, costs, float(comm), act)


def _run(plan: Plan, costs: dict[str, list[float]], comm: float, act: list[float]) -> Simulation:
    p = plan.num_ranks
    clock = [0.0] * p
    pos = [0] * p
    sent: dict[tuple[str, int, int], float] = {}  # (direction, receiving stage, mb) -> arrival
    timeline: list[list[Event]] = [[] for _ in range(p)]
    held = [0.0] * p
    count, peak_count, peak_bytes = [0] * p, [0] * p, [0.0] * p
    frees_at = "W" if plan.split_backward else "B"
    progress = True
    while progress:
        progress = False
        for r in range(p):
            actions = plan.actions[r]
            while pos[r] < len(actions):
                a = actions[pos[r]]
                key = _message_key(a)
                if a.kind.startswith("RECV") and key not in sent:
                    break  # blocked until the sender gets there
                start = clock[r] + costs["GAP"]
                if a.kind.startswith("RECV"):
                    end = max(start, sent[key])
                elif a.kind.startswith("SEND"):
                    end = start + costs["SEND"]
                    sent[key] = start + comm
                else:
                    end = start + costs[a.kind][a.stage]
                    if a.kind == "F":
                        held[r] += act[a.stage]
                        count[r] += 1
                        peak_count[r] = max(peak_count[r], count[r])
                        peak_bytes[r] = max(peak_bytes[r], held[r])
                    if a.kind == frees_at:
                        held[r] -= act[a.stage]
                        count[r] -= 1
                timeline[r].append(Event(a.kind, a.stage, a.microbatch, start, end))
                clock[r] = end
                pos[r] += 1
                progress = True
    stuck = [(r, plan.actions[r][pos[r]]) for r in range(p) if pos[r] < len(plan.actions[r])]
    if stuck:
        what = ", ".join(f"rank {r} at {a}" for r, a in stuck)
        raise ScheduleError(f"simulate: {plan.describe()} deadlocks, expected every receive to "
                            f"have a send that can run first, got stuck: {what}")
    return _summarise(plan, timeline, costs, comm, act, peak_count, peak_bytes)


def _message_key(a: Action) -> tuple[str, int, int]:
    """The message a communication action moves, named by who receives it."""
    if a.kind == "SEND_F":
        return ("F", a.stage + 1, a.microbatch)
    if a.kind == "RECV_F":
        return ("F", a.stage, a.microbatch)
    if a.kind == "SEND_B":
        return ("B", a.stage - 1, a.microbatch)
    return ("B", a.stage, a.microbatch)


def _summarise(plan: Plan, timeline: list[list[Event]], costs: dict, comm: float,
               act: list[float], peak_count: list[int], peak_bytes: list[float]) -> Simulation:
    p = plan.num_ranks
    makespan = max((e.end for row in timeline for e in row), default=0.0)
    busy = [sum(e.end - e.start for e in row if e.kind in COMPUTE) for row in timeline]
    span = makespan if makespan > 0 else 1.0
    # idle / total rather than 1 - busy / total: exact for integer costs (3/30 is 0.1, not
    # 0.0999..., which matters when asking where the bubble first drops below 10%)
    bubble = (p * makespan - sum(busy)) / (p * span)
    used = {k: list(v) for k, v in costs.items() if k in COMPUTE}
    used |= {"comm": comm, "send_time": costs["SEND"], "overhead": costs["GAP"],
             "activation_bytes": act}
    return Simulation(plan, timeline, makespan, busy, bubble, [(makespan - b) / span for b in busy],
                      peak_count, peak_bytes, used)


def min_microbatches(schedule, stages: int, target: float, limit: int = 4096, **costs) -> int:
    """The smallest number of micro-batches whose simulated bubble is below ``target``.

    Example:
        >>> min_microbatches("gpipe", 4, 0.10)
        28
    """
    if not 0 < target < 1:
        raise ScheduleError(f"min_microbatches: target must be in (0, 1), got {target}")
    for m in range(1, limit + 1):
        if simulate(schedule, stages, m, **costs).bubble_fraction < target:
            return m
    raise ScheduleError(f"min_microbatches: no m <= {limit} brings {schedule} on {stages} "
                        f"stages below a bubble of {target}")
