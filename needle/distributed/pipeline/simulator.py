"""Predict a pipeline schedule's timeline, bubble and activation memory from its action lists.

The model: each rank runs its actions in order, each after ``overhead`` of bookkeeping. ``F``,
``B`` and ``W`` take their stage's cost. A message crosses a stage edge: its send occupies the
sender for ``send_time`` (posting it), and it reaches a waiting receiver ``comm`` after the
send started; a receive ends when its rank has spent ``recv_time`` taking a message that was
already there, or when the message lands, whichever is later (waiting is idle time). With a
``link`` (``needle.distributed.calibrate.Link``, the α-β model fitted by a probe) each of the
three also grows with the message's bytes: flight ``α + β·n``, send ``o_s(n)``, receive
``o_r(n)``; and a receive that waited longer than the link's ``spin`` ends its ``wake`` after
the message landed (a rank that waits long yields its core and is scheduled back late). A
micro-batch's activations on a stage are held from the end of its ``F`` until the end of its
``B`` (its ``W`` when the backward is split).

``bubble_fraction = 1 - (sum of every rank's compute time) / (ranks x makespan)``: time spent
sending, receiving or waiting is bubble. For GPipe with no communication cost this is
``(p - 1) / (m + p - 1)``: 3/11 for 4 stages and 8 micro-batches.

Costs may be measured samples; :func:`expected` averages random draws of them, the makespan a
noisy machine measures on average (longer than the makespan of the mean costs).

Example:
    >>> sim = simulate("gpipe", stages=4, microbatches=8)
    >>> round(sim.bubble_fraction, 4), sim.peak_inflight
    (0.2727, [8, 8, 8, 8])
    >>> simulate("1f1b", stages=4, microbatches=8).peak_inflight
    [4, 3, 2, 1]
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from .schedules import COMPUTE, Action, Plan, ScheduleError, canonical_name, make_plan

Number = float | int
Costs = Number | Sequence[Number] | Sequence[Sequence[Number]]


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


def _per_stage(name: str, value, num_stages: int) -> tuple[list[float], list[list[float]]]:
    """(per-stage cost, per-stage samples): ``value`` is one number, one number per stage, or
    one sequence of measured samples per stage (the cost is then their mean)."""
    if value is None:
        value = 0.0
    if isinstance(value, (int, float)):
        values: list = [float(value)] * num_stages
    else:
        values = list(value)
    samples = [[float(x) for x in v] if isinstance(v, (list, tuple)) or hasattr(v, "__len__")
               else [float(v)] for v in values]
    bad = any(not s or any(not math.isfinite(x) or x < 0 for x in s) for s in samples)
    if len(values) != num_stages or bad:
        raise ScheduleError(f"simulate: {name} must be a non-negative number, one per stage or "
                            f"one list of samples per stage, expected {num_stages} values, got "
                            f"{value!r}")
    return [sum(s) / len(s) for s in samples], samples


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _costs(plan_name: str, num_stages: int, forward, backward, weight) -> dict:
    """Per-stage cost of F, B, W, and their samples under ``"samples"``. ``weight=None``:
    ``backward`` is the whole backward (split schedules then give half of it to B and half to
    W); else B costs ``backward`` and W ``weight`` when split, and a fused backward their sum."""
    f, fs = _per_stage("forward", forward, num_stages)
    b, bs = _per_stage("backward", backward, num_stages)
    split = plan_name == "zero-bubble"
    if weight is None:
        half = [[x / 2 for x in s] for s in bs]
        w, ws = ([x / 2 for x in b], half) if split else ([0.0] * num_stages,
                                                          [[0.0]] * num_stages)
        b, bs = ([x / 2 for x in b], half) if split else (b, bs)
    else:
        w, ws = _per_stage("weight", weight, num_stages)
        if not split:
            bs = [[x + y for x in sb] for sb, y in zip(bs, w, strict=True)]
            b = [x + y for x, y in zip(b, w, strict=True)]
            w, ws = [0.0] * num_stages, [[0.0]] * num_stages
    return {"F": f, "B": b, "W": w, "samples": {"F": fs, "B": bs, "W": ws}}


def _edges(value, num_stages: int) -> list[float]:
    """Bytes of the message across each of the ``num_stages - 1`` stage edges."""
    edges = max(num_stages - 1, 1)
    values = [float(value)] * edges if isinstance(value, (int, float)) else [
        float(x) for x in value]
    if len(values) != edges or any(not math.isfinite(x) or x < 0 for x in values):
        raise ScheduleError(f"simulate: message_bytes must be a non-negative number or one per "
                            f"stage edge, expected {edges} values, got {value!r}")
    return values


class _Messages:
    """What each message costs: fixed ``comm``/``send_time``/``recv_time`` plus a link's
    ``time``/``send_time``/``recv_time`` of the edge's bytes; with a random draw, noise samples
    (``flight``, ``send``, ``recv``: seconds added, the sum clipped at zero) too."""

    def __init__(self, comm: float, send: float, recv: float, link, nbytes: list[float],
                 noise: dict | None, rng) -> None:
        self.fixed = {"flight": comm, "send": send, "recv": recv}
        self.link, self.nbytes, self.noise, self.rng = link, nbytes, noise or {}, rng

    def cost(self, what: str, edge: int) -> float:
        value = self.fixed[what]
        if self.link is not None:
            n = self.nbytes[edge]
            value += {"flight": self.link.time, "send": self.link.send_time,
                      "recv": self.link.recv_time}[what](n)
        return self._noisy(what, value)

    def wake(self, waited: float) -> float:
        """Extra delay of a receive that waited ``waited`` (the link's ``wake_time``)."""
        wake_time = getattr(self.link, "wake_time", None)
        if wake_time is None or wake_time(waited) == 0.0:
            return 0.0
        return self._noisy("wake", wake_time(waited))

    def _noisy(self, what: str, value: float) -> float:
        extra = self.noise.get(what)
        if self.rng is not None and extra:
            value = max(0.0, value + float(extra[self.rng.randrange(len(extra))]))
        return value


def simulate(schedule, stages: int | None = None, microbatches: int | None = None,
             forward: Costs = 1.0, backward: Costs = 2.0, weight: Costs | None = None,
             comm: Number = 0.0, activation_bytes: Number | Sequence[Number] = 1.0,
             virtual_stages: int | None = None, send_time: Number = 0.0,
             overhead: Number = 0.0, *, recv_time: Number = 0.0, link: Any = None,
             message_bytes: Number | Sequence[Number] = 0.0, seed: int | None = None,
             message_noise: dict | None = None, adjoint_in_backward: bool = False
             ) -> Simulation:
    """Predict the timeline of ``schedule`` on ``stages`` ranks with ``microbatches``.

    Args:
        schedule: "gpipe", "1f1b", "interleaved", "zero-bubble", a schedule class, or a
            :class:`Plan` (then ``stages``/``microbatches`` may be omitted; pass the runtime's
            own plan to predict a run: the zero-bubble order depends on the costs it was built
            for).
        forward, backward, weight: cost of one micro-batch's F, B and W on a stage: one number,
            one per stage (``stages x virtual_stages`` values), or one list of measured samples
            per stage (the cost is their mean; a ``seed`` draws one per action). ``weight=None``
            means that ``backward`` is the whole backward; split schedules then give half to B,
            half to W.
        comm: time from a send's start until a waiting receiver holds the message.
        activation_bytes: bytes one micro-batch holds on a stage between F and B/W (number or
            one per stage); the default 1 makes ``peak_activation_bytes`` a count.
        virtual_stages: chunks per rank (interleaved).
        send_time: time a send occupies its rank (posting the message), not compute.
        overhead: idle time before every action (the runtime's own bookkeeping).
        recv_time: time a receive occupies its rank when the message is already there.
        link, message_bytes: a :class:`needle.distributed.calibrate.Link`; a message of
            ``n = message_bytes[s]`` bytes across stage edge ``s`` adds ``link.time(n)`` to
            its flight, ``link.send_time(n)`` to its sender, ``link.recv_time(n)`` to a
            receiver that finds it there, ``link.wake`` to one that waited past ``spin``.
        seed: draw every cost at random (compute from its samples, messages with
            ``message_noise``) instead of using means: one sample of a noisy run.
        message_noise: ``{"flight": [...], "send": [...], "recv": [...], "wake": [...]}``,
            seconds added to a message's costs in a random draw (``LinkProbe.residuals()``).
        adjoint_in_backward: an adjoint is posted at the end of its stage's ``B``, inside it,
            as needle's runtime does it (its autograd sends it): the send's time counts as
            ``B``'s (compute, as the runtime's record measures it) and ``SEND_B`` is empty.

    Returns:
        :class:`Simulation` with ``timeline`` (per rank), ``bubble_fraction``,
        ``peak_inflight`` and ``peak_activation_bytes`` (per rank).

    Raises:
        ScheduleError: bad sizes or costs, or a plan that deadlocks (naming the stuck actions).

    Example:
        >>> round(simulate("gpipe", 4, 28).bubble_fraction, 4)
        0.0968
        >>> from needle.distributed.calibrate import Link
        >>> simulate("gpipe", 2, 1, forward=1, backward=2, link=Link(alpha=0.5)).makespan
        7.0
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
    act, _ = _per_stage("activation_bytes", activation_bytes, plan.num_stages)
    for name, value in (("comm", comm), ("send_time", send_time), ("overhead", overhead),
                        ("recv_time", recv_time)):
        if not math.isfinite(float(value)) or value < 0:
            raise ScheduleError(f"simulate: {name} must be a non-negative number, got "
                                f"{value!r}")
    rng = None if seed is None else random.Random(seed)
    messages = _Messages(float(comm), float(send_time), float(recv_time), link,
                         _edges(message_bytes, plan.num_stages), message_noise, rng)
    costs["SEND"], costs["RECV"], costs["GAP"] = float(send_time), float(recv_time), overhead
    sim = _run(plan, costs, messages, act, rng, adjoint_in_backward)
    if link is not None:
        sim.costs["link"] = link.as_dict() if hasattr(link, "as_dict") else repr(link)
        sim.costs["message_bytes"] = messages.nbytes
    return sim


def expected(schedule, stages: int | None = None, microbatches: int | None = None,
             draws: int = 200, **costs: Any) -> Simulation:
    """The mean over ``draws`` random draws of :func:`simulate` (seeds 0, 1, ...): makespan,
    busy time and bubble averaged (the timeline is the first draw's). Under noise the mean
    makespan exceeds the makespan of mean costs (a late message delays its receiver, an
    early one does not hurry it), which is what a loaded machine measures.

    Example:
        >>> sim = expected("gpipe", 2, 2, draws=50, forward=[[1, 3], [2]], backward=2)
        >>> sim.makespan > simulate("gpipe", 2, 2, forward=[2, 2], backward=2).makespan
        True
    """
    if draws < 1:
        raise ScheduleError(f"expected: draws must be positive, got {draws}")
    sims = [simulate(schedule, stages, microbatches, seed=k, **costs) for k in range(draws)]
    first = sims[0]
    p = first.plan.num_ranks
    first.makespan = _mean([s.makespan for s in sims])
    first.busy = [_mean([s.busy[r] for s in sims]) for r in range(p)]
    first.bubble_fraction = _mean([s.bubble_fraction for s in sims])
    first.bubble_per_rank = [_mean([s.bubble_per_rank[r] for s in sims]) for r in range(p)]
    first.costs["draws"] = draws
    return first


def _run(plan: Plan, costs: dict, messages: _Messages, act: list[float],
         rng: random.Random | None, adjoint_in_backward: bool = False) -> Simulation:
    p = plan.num_ranks
    clock = [0.0] * p
    pos = [0] * p
    sent: dict[tuple[str, int, int], float] = {}  # (direction, receiving stage, mb) -> arrival
    timeline: list[list[Event]] = [[] for _ in range(p)]
    held = [0.0] * p
    count, peak_count, peak_bytes = [0] * p, [0] * p, [0.0] * p
    frees_at = "W" if plan.split_backward else "B"
    samples = costs["samples"]
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
                    edge = a.stage - 1 if a.kind == "RECV_F" else a.stage
                    landed = sent[key] + messages.wake(sent[key] - start)
                    end = max(start + messages.cost("recv", edge), landed)
                elif a.kind == "SEND_B" and adjoint_in_backward:  # it left at B's end
                    end, posted = start, clock[r] - sent.pop(("posted", a.stage, a.microbatch))
                    sent[key] = posted + messages.cost("flight", a.stage - 1)
                elif a.kind.startswith("SEND"):
                    edge = a.stage if a.kind == "SEND_F" else a.stage - 1
                    end = start + messages.cost("send", edge)
                    sent[key] = start + messages.cost("flight", edge)
                else:
                    drawn = samples[a.kind][a.stage]
                    cost = costs[a.kind][a.stage] if rng is None else drawn[
                        rng.randrange(len(drawn))]
                    if a.kind == "B" and adjoint_in_backward and a.stage > 0:
                        posting = messages.cost("send", a.stage - 1)
                        sent[("posted", a.stage, a.microbatch)] = posting
                        cost += posting
                    end = start + cost
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
    return _summarise(plan, timeline, costs, messages.fixed["flight"], act, peak_count,
                      peak_bytes)


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
    used |= {"comm": comm, "send_time": costs["SEND"], "recv_time": costs["RECV"],
             "overhead": costs["GAP"], "activation_bytes": act}
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
