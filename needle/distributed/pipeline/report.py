"""Measured vs replayed: a recorded pipeline run against the simulator fed the run's own costs.

With ``record=True`` each rank keeps, per step, every action's start and end (relative to a
barrier that opened the step) and the ``activation`` bytes of ``needle.memory`` after each
compute action. :func:`gather_report` collects that on one rank and derives:

* measured per-op costs: the mean duration of F, B, W of each stage (the mean, so that
  predicted and measured compute time agree);
* measured message time ``comm``: the median delay from a send to the end of the matching
  receive, over receives that were already waiting when the message left; the mean time a
  send occupies its rank (``send_time``, over every send) and the mean gap between actions
  (``overhead``); the median time a receive takes when its message was sent before it
  started (``recv_time``) and the mean time of an activation's send (``activation_send_time``:
  the runtime's ``SEND_B`` is empty, the adjoint leaves inside ``B``);
* measured activation bytes of one micro-batch on each stage: the median growth of the
  ``activation`` category over that stage's forwards;
* the replay (``bubble_predicted``): :func:`~.simulator.simulate` of the same plan with the
  mean costs, ``comm``, ``send_time`` and ``overhead``; and ``replay_terms``, the replay with
  one more term at a time: the receive's own cost, the send time per direction (an
  activation's send in ``SEND_F``, the adjoint's inside ``B``), then the run's noise
  (:func:`~.simulator.expected` over the run's own samples: every action's cost drawn from
  its stage's, every message's delays from the measured ones; on a loaded machine delays do
  not average out, a late message stalls its receiver), whose result is also
  ``bubble_replayed_noisy``. All are fitted to the run they describe: they say which terms
  explain it. A prediction made before a run comes from a calibration instead
  (``needle.plan``, ``bench/bench_time_model.py``);
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
from .simulator import Event, Simulation, expected, simulate

_REPORT_TAG = (1 << 24) - 1  # below the runtime's micro-batch tags
NOISY_DRAWS = 100  # random draws of the noisy replay


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
    #: the simulator's inputs measured in these steps (keyword arguments of
    #: :func:`~.simulator.expected`: every action's cost samples per stage, the message
    #: costs and their noise): what a calibration carries to predict this pipeline at
    #: another micro-batch count (``bench/bench_time_model.py``). Not in :meth:`as_dict`.
    inputs: dict = field(default_factory=dict)

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
                "costs_s": self.costs, "memory_note": self.memory_note, **self.extra}

    def text(self) -> str:
        lines = [f"{self.schedule}: {self.stages} stages, {self.microbatches} micro-batches, "
                 f"{self.steps} measured steps",
                 f"bubble   predicted {self.bubble_predicted:.3f}  measured "
                 f"{self.bubble_measured:.3f}  error {self.bubble_error:+.3f}"
                 + (f"  (noisy replay {self.extra['bubble_replayed_noisy']:.3f})"
                    if "bubble_replayed_noisy" in self.extra else ""),
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


def _messages(plan: Any, steps: list[list[np.ndarray]]) -> dict[str, list[float]]:
    """Samples of every message: ``flight`` (send start to the end of a receive that was
    already waiting), ``recv`` (a receive whose message left before it started), ``send``
    (an activation's send: the runtime's ``SEND_B`` is empty), ``all_sends``."""
    out: dict[str, list[float]] = {"flight": [], "recv": [], "send": [], "all_sends": []}
    for step in steps:
        sends = {}
        for rows in step:
            for e in rows:
                kind, s, i = KINDS[int(e[1])], int(e[2]), int(e[3])
                if kind.startswith("SEND"):
                    out["all_sends"].append(e[5] - e[4])
                if kind == "SEND_F":
                    sends[("F", s + 1, i)] = e[4]
                    out["send"].append(e[5] - e[4])
                elif kind == "SEND_B":
                    sends[("B", s - 1, i)] = e[4]
        for rows in step:
            for e in rows:
                kind = KINDS[int(e[1])]
                sent = sends.get((kind[-1], int(e[2]), int(e[3]))) if kind.startswith(
                    "RECV") else None
                if sent is None:
                    continue
                if e[4] <= sent:
                    out["flight"].append(max(0.0, e[5] - sent))
                else:
                    out["recv"].append(e[5] - e[4])
    return out


def _replay_terms(plan: Any, steps: list, costs: dict, msgs: dict, act: list[float],
                  overhead: float, first: Simulation, inputs: dict) -> list[dict]:
    """The replay with one more term at a time: the receive's own cost, the send time per
    direction (an activation's send is ``SEND_F``; the adjoint's is posted inside ``B``, the
    runtime's ``SEND_B`` is empty), then the run's noise (random draws of its own samples;
    the mean over :data:`NOISY_DRAWS`)."""
    med = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
    comm, recv_time = med(msgs["flight"]), med(msgs["recv"])
    send_time = float(np.mean(msgs["send"])) if msgs["send"] else 0.0
    split = plan.split_backward
    moved = [0.0 if s == 0 else send_time for s in range(plan.num_stages)]
    back = [max(0.0, b - m) for b, m in zip(costs["B"], moved, strict=True)]
    common = dict(comm=comm, overhead=overhead, activation_bytes=act)
    rows = [("mean costs, one send time", first)]
    rows.append(("+ receive cost", simulate(
        plan, forward=costs["F"], backward=costs["B"], weight=costs["W"] if split else None,
        send_time=first.costs["send_time"], recv_time=recv_time, **common)))
    # the adjoint's send is posted inside B (its autograd sends it): B keeps it as compute
    rows.append(("+ send time per direction", simulate(
        plan, forward=costs["F"], backward=back, weight=costs["W"] if split else None,
        send_time=send_time, recv_time=recv_time, adjoint_in_backward=True, **common)))
    rows.append(("+ noise (the run's own samples)", expected(plan, draws=NOISY_DRAWS,
                                                             **inputs)))
    return [{"terms": name, "bubble": sim.bubble_fraction, "makespan_s": sim.makespan}
            for name, sim in rows]


def simulator_inputs(plan: Any, steps: list, costs: dict, msgs: dict, act: list[float],
                     overhead: float) -> dict:
    """Keyword arguments of :func:`~.simulator.expected` that replay the recorded steps with
    their own noise: each action's cost drawn from its stage's samples (``B`` without the
    adjoint's send, which the simulator posts inside ``B`` itself), each message's delays
    from the measured ones. Plain lists and floats (JSON-ready)."""
    med = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
    comm, recv_time = med(msgs["flight"]), med(msgs["recv"])
    send_time = float(np.mean(msgs["send"])) if msgs["send"] else 0.0
    moved = [0.0 if s == 0 else send_time for s in range(plan.num_stages)]
    samples = {k: _samples(plan, steps, k) for k in COMPUTE}
    samples["B"] = [[max(0.0, x - m) for x in xs] for xs, m in
                    zip(samples["B"], moved, strict=True)]
    noise = {"flight": [x - comm for x in msgs["flight"]],
             "recv": [x - recv_time for x in msgs["recv"]],
             "send": [x - send_time for x in msgs["send"]]}
    return {"forward": samples["F"], "backward": samples["B"],
            "weight": samples["W"] if plan.split_backward else None, "comm": comm,
            "send_time": send_time, "recv_time": recv_time, "overhead": float(overhead),
            "activation_bytes": [float(a) for a in act], "message_noise": noise,
            "adjoint_in_backward": True}


def _overheads(steps: list[list[np.ndarray]]) -> float:
    """Mean gap between consecutive actions."""
    gaps = []
    for step in steps:
        for rows in step:
            gaps += [max(0.0, b[4] - a[5]) for a, b in zip(rows[:-1], rows[1:], strict=True)]
    return float(np.mean(gaps)) if gaps else 0.0


def _samples(plan: Any, steps: list[list[np.ndarray]], kind: str) -> list[list[float]]:
    out = []
    for s in range(plan.num_stages):
        got = [e[5] - e[4] for step in steps for e in _kind(step[plan.rank_of(s)], kind)
               if int(e[2]) == s]
        out.append(got or [0.0])
    return out


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
    msgs = _messages(plan, steps)
    comm = float(np.median(msgs["flight"])) if msgs["flight"] else 0.0
    recv_time = float(np.median(msgs["recv"])) if msgs["recv"] else 0.0
    send_time = float(np.mean(msgs["send"])) if msgs["send"] else 0.0
    overhead = _overheads(steps)
    split = plan.split_backward
    predicted = simulate(plan, forward=costs["F"], backward=costs["B"],
                         weight=costs["W"] if split else None, comm=comm,
                         activation_bytes=act, send_time=float(np.mean(msgs["all_sends"]))
                         if msgs["all_sends"] else 0.0, overhead=overhead)
    inputs = simulator_inputs(plan, steps, costs, msgs, act, overhead)
    terms = _replay_terms(plan, steps, costs, msgs, act, overhead, predicted, inputs)
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
         "send_time": predicted.costs["send_time"], "overhead": overhead,
         "recv_time": recv_time, "activation_send_time": send_time},
        predicted, measured, note,
        {"bubble_replayed_noisy": terms[-1]["bubble"],
         "makespan_replayed_noisy_s": terms[-1]["makespan_s"], "replay_terms": terms},
        inputs)
