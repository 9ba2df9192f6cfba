"""Measured vs predicted: a recorded pipeline run against the simulator fed its own costs.

With ``record=True`` each rank keeps, per step, every action's start and end (relative to a
barrier that opened the step) and the ``activation`` bytes of ``needle.memory`` after each
compute action. :func:`gather_report` collects that on one rank and derives:

* measured per-op costs: the mean duration of F, B, W of each stage (the mean, so that
  predicted and measured compute time agree);
* measured message time ``comm``: the median delay from a send to the end of the matching
  receive, over receives that were already waiting when the message left; the mean time a
  send occupies its rank (``send_time``) and the mean gap between actions (``overhead``);
* measured activation bytes of one micro-batch on each stage: the median growth of the
  ``activation`` category over that stage's forwards;
* the prediction: :func:`~.simulator.simulate` of the same plan with those numbers;
* the measurement: bubble ``(p * makespan - sum of compute time) / (p * makespan)`` of each
  step (averaged), and the peak ``activation`` bytes above the step's starting level.

On the thread backend all ranks share one allocator, so per-stage bytes cannot be told
apart: the measured memory is then None.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import wire
from .schedules import COMPUTE, KINDS
from .simulator import Event, Simulation, simulate

_REPORT_TAG = (1 << 24) - 1  # below the runtime's micro-batch tags


@dataclass
class PipelineReport:
    """Prediction and measurement of one schedule's recorded steps (lists are per rank)."""

    schedule: str
    stages: int
    virtual_stages: int
    microbatches: int
    steps: int
    bubble_predicted: float
    bubble_measured: float
    makespan_predicted: float
    makespan_measured: float
    peak_activation_bytes: dict
    activation_bytes_per_microbatch: list[float]
    costs: dict
    predicted: Simulation
    measured: Simulation
    memory_note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def bubble_error(self) -> float:
        """measured - predicted (absolute, in bubble fraction)."""
        return self.bubble_measured - self.bubble_predicted

    def activation_error(self) -> list[float | None]:
        """(measured - predicted) / measured peak activation bytes of each rank."""
        got = self.peak_activation_bytes["measured"]
        want = self.peak_activation_bytes["predicted"]
        if got is None:
            return [None] * len(want)
        return [(g - w) / g if g else None for g, w in zip(got, want, strict=True)]

    def as_dict(self) -> dict:
        return {"schedule": self.schedule, "stages": self.stages,
                "virtual_stages": self.virtual_stages, "microbatches": self.microbatches,
                "steps_measured": self.steps, "bubble_predicted": self.bubble_predicted,
                "bubble_measured": self.bubble_measured, "bubble_error": self.bubble_error,
                "makespan_predicted_s": self.makespan_predicted,
                "makespan_measured_s": self.makespan_measured,
                "peak_activation_bytes": self.peak_activation_bytes,
                "peak_activation_error": self.activation_error(),
                "activation_bytes_per_microbatch": self.activation_bytes_per_microbatch,
                "costs_s": self.costs, "memory_note": self.memory_note}

    def text(self) -> str:
        lines = [f"{self.schedule}: {self.stages} stages, {self.microbatches} micro-batches, "
                 f"{self.steps} measured steps",
                 f"bubble   predicted {self.bubble_predicted:.3f}  measured "
                 f"{self.bubble_measured:.3f}  error {self.bubble_error:+.3f}",
                 f"step     predicted {self.makespan_predicted * 1e3:.2f} ms  measured "
                 f"{self.makespan_measured * 1e3:.2f} ms"]
        measured = self.peak_activation_bytes["measured"]
        for r, want in enumerate(self.peak_activation_bytes["predicted"]):
            got = "n/a" if measured is None else f"{measured[r]:,.0f}"
            lines.append(f"stage {r}  peak activation bytes predicted {want:,.0f}  "
                         f"measured {got}")
        if self.memory_note:
            lines.append(self.memory_note)
        return "\n".join(lines)


def _pack(schedule: Any, steps: list[dict]) -> np.ndarray:
    rows = [(k, KINDS.index(e[0]), e[1], e[2], e[3], e[4], e[5], step["base"])
            for k, step in enumerate(steps) for e in step["events"]]
    return np.array(rows, dtype=np.float64).reshape(-1, 8)


def gather_report(schedule: Any, root: int, skip_first: bool) -> PipelineReport | None:
    """Collective over the pipeline group: see :meth:`PipelineSchedule.report`."""
    steps = list(schedule.history)
    if skip_first and len(steps) > 1:
        steps = steps[1:]  # the first step pays for fresh allocations and warm-up
    pg, plan = schedule.group, schedule.plan
    mine = _pack(schedule, steps)
    if pg.rank != root:
        wire.send_array(pg, mine, root, _REPORT_TAG, wire.FORWARD)
        wire.outbox(pg).flush()
        return None
    per_rank = [mine if r == root else wire.recv_array(pg, r, _REPORT_TAG, wire.FORWARD)
                for r in range(pg.size)]
    if any(len(rows) == 0 for rows in per_rank):
        from .schedules import ScheduleError

        raise ScheduleError("report: no recorded steps on some rank, expected record=True "
                            "and at least one step()")
    memory_ok = pg.backend != "thread"
    return _build(plan, per_rank, memory_ok)


def _steps(per_rank: list[np.ndarray]) -> list[list[np.ndarray]]:
    count = int(min(rows[:, 0].max() for rows in per_rank)) + 1
    return [[rows[rows[:, 0] == k] for rows in per_rank] for k in range(count)]


def _kind(rows: np.ndarray, kind: str) -> np.ndarray:
    return rows[rows[:, 1] == KINDS.index(kind)]


def _costs(plan: Any, steps: list[list[np.ndarray]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for kind in COMPUTE:
        values = []
        for s in range(plan.num_stages):
            durations = [e[5] - e[4] for step in steps for e in _kind(step[plan.rank_of(s)], kind)
                         if int(e[2]) == s]
            values.append(float(np.mean(durations)) if durations else 0.0)
        out[kind] = values
    return out


def _activation_per_mb(plan: Any, steps: list[list[np.ndarray]]) -> list[float]:
    deltas: dict[int, list[float]] = {s: [] for s in range(plan.num_stages)}
    for step in steps:
        for rows in step:
            level = rows[0, 7] if len(rows) else 0.0
            for e in rows:
                if e[6] < 0:
                    continue  # a communication action: no memory sample
                if int(e[1]) == KINDS.index("F"):
                    deltas[int(e[2])].append(max(0.0, e[6] - level))
                level = e[6]
    return [float(np.median(d)) if d else 0.0 for d in deltas.values()]


def _comm(plan: Any, steps: list[list[np.ndarray]]) -> float:
    lags = []
    for step in steps:
        sends, recvs = {}, []
        for rows in step:
            for e in rows:
                kind, s, i = KINDS[int(e[1])], int(e[2]), int(e[3])
                if kind == "SEND_F":
                    sends[("F", s + 1, i)] = e[4]
                elif kind == "SEND_B":
                    sends[("B", s - 1, i)] = e[4]
                elif kind in ("RECV_F", "RECV_B"):
                    recvs.append((kind[-1], s, i, e[4], e[5]))
        for direction, s, i, start, end in recvs:
            sent = sends.get((direction, s, i))
            if sent is not None and start <= sent:
                lags.append(max(0.0, end - sent))
    return float(np.median(lags)) if lags else 0.0


def _overheads(steps: list[list[np.ndarray]]) -> tuple[float, float]:
    """Mean time a send occupies its rank, and mean gap between consecutive actions."""
    sends, gaps = [], []
    for step in steps:
        for rows in step:
            sends += [e[5] - e[4] for e in rows if KINDS[int(e[1])].startswith("SEND")]
            gaps += [max(0.0, b[4] - a[5]) for a, b in zip(rows[:-1], rows[1:], strict=True)]
    return (float(np.mean(sends)) if sends else 0.0, float(np.mean(gaps)) if gaps else 0.0)


def _measured(plan: Any, step: list[np.ndarray]) -> tuple[list[list[Event]], float, list[float]]:
    origin = min(rows[:, 4].min() for rows in step)
    timeline = [[Event(KINDS[int(e[1])], int(e[2]), int(e[3]), e[4] - origin, e[5] - origin)
                 for e in rows] for rows in step]
    makespan = max(rows[:, 5].max() for rows in step) - origin
    busy = [sum(ev.end - ev.start for ev in row if ev.kind in COMPUTE) for row in timeline]
    return timeline, makespan, busy


def _build(plan: Any, per_rank: list[np.ndarray], memory_ok: bool) -> PipelineReport:
    steps = _steps(per_rank)
    costs = _costs(plan, steps)
    act = _activation_per_mb(plan, steps)
    comm = _comm(plan, steps)
    send_time, overhead = _overheads(steps)
    predicted = simulate(plan, forward=costs["F"], backward=costs["B"],
                         weight=costs["W"] if plan.split_backward else None, comm=comm,
                         activation_bytes=act, send_time=send_time, overhead=overhead)
    p = plan.num_ranks
    bubbles, spans, last = [], [], None
    for step in steps:
        timeline, makespan, busy = _measured(plan, step)
        bubbles.append((p * makespan - sum(busy)) / (p * makespan) if makespan > 0 else 0.0)
        spans.append(makespan)
        last = (timeline, makespan, busy)
    peaks = None
    if memory_ok:
        peaks = [float(max(max(rows[rows[:, 6] >= 0, 6].max(initial=0.0) - rows[0, 7], 0.0)
                           for rows in (step[r] for step in steps)))
                 for r in range(p)]
    timeline, makespan, busy = last
    measured = Simulation(plan, timeline, makespan, busy, float(np.mean(bubbles)),
                          [(makespan - b) / makespan for b in busy],
                          predicted.peak_inflight, peaks or [0.0] * p)
    note = "" if memory_ok else ("thread backend: the ranks share one allocator, so "
                                 "per-stage activation bytes are not measured")
    return PipelineReport(
        plan.name, p, plan.virtual_stages, plan.num_microbatches, len(steps),
        predicted.bubble_fraction, float(np.mean(bubbles)), predicted.makespan,
        float(np.mean(spans)),
        {"predicted": predicted.peak_activation_bytes, "measured": peaks}, act,
        {"forward": costs["F"], "backward": costs["B"], "weight": costs["W"], "comm": comm,
         "send_time": send_time, "overhead": overhead},
        predicted, measured, note)
