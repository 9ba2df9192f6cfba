"""Pipeline schedules as data: per-rank lists of actions, with no communication and no autograd.

A schedule for ``p`` ranks, ``v`` model chunks per rank (``S = p * v`` stages; stage ``k`` lives
on rank ``k % p``) and ``m`` micro-batches is a :class:`Plan`: for each rank the ordered list of
:class:`Action` it performs. Compute actions are ``F`` (forward), ``B`` (backward; with
``split_backward`` only the input gradient) and ``W`` (the weight gradient of a split
backward). Communication actions are ``RECV_F`` / ``SEND_F`` (an activation to the next stage)
and ``RECV_B`` / ``SEND_B`` (its adjoint back to the previous stage). The runtime
(``runtime.py``) executes exactly these lists; the simulator (``simulator.py``) reads them.

Sends are nonblocking and receives block, so a plan is deadlock-free when some global order
of its actions respects every rank's order and every message dependency; ``simulate`` checks
that and raises :class:`ScheduleError` naming the stuck actions otherwise.

Example:
    >>> plan = make_plan("1f1b", 2, 3)
    >>> [str(a) for a in plan.compute_actions(0)]
    ['F0.0', 'F0.1', 'B0.0', 'F0.2', 'B0.1', 'B0.2']
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .._errors import NeedleError

COMPUTE = ("F", "B", "W")
KINDS = COMPUTE + ("RECV_F", "SEND_F", "RECV_B", "SEND_B")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
_ALIASES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved",
            "interleaved-1f1b": "interleaved", "interleaved1f1b": "interleaved",
            "zero-bubble": "zero-bubble", "zerobubble": "zero-bubble", "zb": "zero-bubble",
            "zb-h1": "zero-bubble"}


class ScheduleError(NeedleError, ValueError):
    """A schedule that cannot be built or run: bad sizes, a deadlock, a malformed plan."""


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on ``stage`` for ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclass(frozen=True)
class Plan:
    """A whole schedule: ``actions[r]`` is what rank ``r`` does, in order."""

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.num_ranks))

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMPUTE]

    def describe(self) -> str:
        return (f"{self.name} ({self.num_ranks} ranks, {self.num_stages} stages, "
                f"{self.num_microbatches} micro-batches)")


def canonical_name(schedule: object) -> str:
    """'gpipe', '1f1b', 'interleaved' or 'zero-bubble' for a name, a schedule class or a Plan."""
    if isinstance(schedule, Plan):
        return schedule.name
    name = getattr(schedule, "name", schedule)
    if not isinstance(name, str) or name.lower() not in _ALIASES:
        raise ScheduleError(f"pipeline: unknown schedule, expected one of {SCHEDULES}, "
                            f"got {schedule!r}")
    return _ALIASES[name.lower()]


def _check_sizes(op: str, ranks: int, microbatches: int, virtual: int) -> None:
    for what, value in (("stages", ranks), ("microbatches", microbatches),
                        ("virtual_stages", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{op}: {what} must be a positive integer, got {value!r}")


# ---- compute orders (F/B/W only), one list per rank ----------------------------------------
def gpipe_order(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Every forward, then every backward (in micro-batch order)."""
    return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
            for r in range(p)]


def interleaved_order(p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """1F1B over ``v`` chunks per rank (Megatron's interleaved schedule); ``v == 1`` is 1F1B.

    Forwards run groups of ``p`` micro-batches through chunk 0, then the same group through
    chunk 1, and so on; backwards mirror that with the chunks reversed. Rank ``r`` first runs
    ``p - r - 1`` forwards (``2 (p - r - 1) + (v - 1) p`` when interleaving), then alternates
    one forward and one backward, then drains the remaining backwards.
    """
    orders = []
    for r in range(p):
        fwd, bwd = [], []
        for start in range(0, m, p):
            group = range(start, min(start + p, m))
            fwd += [(c * p + r, i) for c in range(v) for i in group]
            bwd += [(c * p + r, i) for c in reversed(range(v)) for i in group]
        total = m * v
        warmup = p - r - 1 if v == 1 else 2 * (p - r - 1) + (v - 1) * p
        warmup = min(warmup, total)
        order = [("F", s, i) for s, i in fwd[:warmup]]
        for k in range(total - warmup):
            order.append(("F",) + fwd[warmup + k])
            order.append(("B",) + bwd[k])
        order += [("B", s, i) for s, i in bwd[total - warmup:]]
        orders.append(order)
    return orders


def zero_bubble_order(p: int, m: int, forward: float = 1.0, backward: float = 1.0,
                      weight: float = 1.0, comm: float = 0.0) -> list[list[tuple[str, int, int]]]:
    """A ZB-H1-style schedule: backward split into B (input gradient) and W (weight gradient).

    Built by list scheduling on the cost model, in time order: each rank, whenever free, runs
    a ready B, else a ready F (while it holds fewer than ``p`` micro-batches' activations,
    the peak of 1F1B's first stage), else a pending W: weight gradients fill the time 1F1B
    spends waiting. Deterministic, so every rank computes the same plan. It is a greedy
    schedule: at F = B = W, p = 4, m = 8 its bubble is 0.172 (1F1B: 0.273; the hand-built
    ZB-H1 of Qi et al. reaches 0.111); ``simulate`` reports what it achieves.
    """
    if min(forward, backward, weight) <= 0:
        raise ScheduleError(f"zero_bubble_order: costs must be positive, got forward={forward}, "
                            f"backward={backward}, weight={weight}")
    z = _ZeroBubble(p, m, {"F": forward, "B": backward, "W": weight}, comm)
    while not all(z.done):
        now = min(z.free[r] for r in range(p) if not z.done[r])
        idle = [r for r in range(p) if not z.done[r] and z.free[r] == now and not z.act(r, now)]
        for r in idle:
            later = [z.free[x] for x in range(p) if not z.done[x] and z.free[x] > now]
            known = [t for t in z.ready_times(r) if t > now]
            if not later and not known:
                raise ScheduleError(f"zero_bubble_order: no progress possible on rank {r} "
                                    f"at t={now:g} (p={p}, m={m})")
            z.free[r] = min(later + known)
    return z.orders


class _ZeroBubble:
    """State of the list scheduler behind :func:`zero_bubble_order`."""

    def __init__(self, p: int, m: int, cost: dict, comm: float):
        self.p, self.m, self.cost, self.comm = p, m, cost, comm
        self.free = [0.0] * p
        self.next_f, self.next_b = [0] * p, [0] * p
        self.pending: list[list[int]] = [[] for _ in range(p)]
        self.held = [0] * p
        self.ready_f = {(0, i): 0.0 for i in range(m)}  # (stage, mb) -> input arrival
        self.ready_b: dict[tuple[int, int], float] = {}  # (stage, mb) -> adjoint arrival
        self.orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
        self.done = [False] * p

    def ready_times(self, r: int) -> list[float]:
        times = []
        if self.next_b[r] < self.m and (r, self.next_b[r]) in self.ready_b:
            times.append(self.ready_b[(r, self.next_b[r])])
        if (self.next_f[r] < self.m and self.held[r] < self.p
                and (r, self.next_f[r]) in self.ready_f):
            times.append(self.ready_f[(r, self.next_f[r])])
        return times

    def act(self, r: int, now: float) -> bool:
        """Schedule rank r's next action at ``now`` if one can start; False when it must wait."""
        b, f = self.next_b[r], self.next_f[r]
        if b < self.m and self.ready_b.get((r, b), now + 1) <= now:
            kind, i = "B", b
        elif (f < self.m and self.held[r] < self.p
              and self.ready_f.get((r, f), now + 1) <= now):
            kind, i = "F", f
        elif self.pending[r]:
            kind, i = "W", self.pending[r][0]
        else:
            return False
        end = now + self.cost[kind]
        self.free[r] = end
        self.orders[r].append((kind, r, i))
        getattr(self, "_did_" + kind)(r, i, end)
        self.done[r] = self.next_b[r] == self.m and not self.pending[r]
        return True

    def _did_F(self, r: int, i: int, end: float) -> None:  # noqa: N802 - named after the kind
        self.next_f[r] += 1
        self.held[r] += 1
        if r + 1 < self.p:
            self.ready_f[(r + 1, i)] = end + self.comm
        else:
            self.ready_b[(r, i)] = end

    def _did_B(self, r: int, i: int, end: float) -> None:  # noqa: N802
        self.next_b[r] += 1
        self.pending[r].append(i)
        if r > 0:
            self.ready_b[(r - 1, i)] = end + self.comm

    def _did_W(self, r: int, i: int, end: float) -> None:  # noqa: N802
        self.pending[r].pop(0)
        self.held[r] -= 1


# ---- communication ---------------------------------------------------------------------------
def with_communication(orders: Sequence[Sequence[tuple[str, int, int]]], num_stages: int
                       ) -> tuple[tuple[Action, ...], ...]:
    """Insert RECV before and SEND after every compute action that crosses a stage edge."""
    plan = []
    for order in orders:
        actions: list[Action] = []
        for kind, stage, i in order:
            if kind == "F" and stage > 0:
                actions.append(Action("RECV_F", stage, i))
            if kind == "B" and stage < num_stages - 1:
                actions.append(Action("RECV_B", stage, i))
            actions.append(Action(kind, stage, i))
            if kind == "F" and stage < num_stages - 1:
                actions.append(Action("SEND_F", stage, i))
            if kind == "B" and stage > 0:
                actions.append(Action("SEND_B", stage, i))
        plan.append(tuple(actions))
    return tuple(plan)


def make_plan(schedule: object, stages: int, microbatches: int, virtual_stages: int | None = None,
              forward: float = 1.0, backward: float = 1.0, weight: float = 1.0,
              comm: float = 0.0) -> Plan:
    """The :class:`Plan` of ``schedule`` for ``stages`` ranks and ``microbatches``.

    Args:
        schedule: "gpipe", "1f1b", "interleaved" or "zero-bubble" (or a schedule class).
        stages: pipeline ranks ``p``.
        virtual_stages: model chunks per rank (interleaved only; default 2 there, else 1).
        forward, backward, weight, comm: the cost model the zero-bubble schedule is built
            for (B and W costs of a split backward); ignored by the other schedules.

    Raises:
        ScheduleError: unknown schedule or sizes that are not positive.

    Example:
        >>> make_plan("gpipe", 2, 2).actions[1]  # doctest: +NORMALIZE_WHITESPACE
        (Action(kind='RECV_F', stage=1, microbatch=0), Action(kind='F', stage=1, microbatch=0),
         Action(kind='RECV_F', stage=1, microbatch=1), Action(kind='F', stage=1, microbatch=1),
         Action(kind='B', stage=1, microbatch=0), Action(kind='SEND_B', stage=1, microbatch=0),
         Action(kind='B', stage=1, microbatch=1), Action(kind='SEND_B', stage=1, microbatch=1))
    """
    name = canonical_name(schedule)
    v = virtual_stages if virtual_stages is not None else (2 if name == "interleaved" else 1)
    _check_sizes("make_plan", stages, microbatches, v)
    if v != 1 and name != "interleaved":
        raise ScheduleError(f"make_plan: virtual_stages > 1 needs the interleaved schedule, "
                            f"got schedule {name!r} with virtual_stages={v}")
    if v > 1 and microbatches % stages:
        # Megatron's condition too: with a partial last group the chunk order deadlocks
        # for some sizes (simulate() finds e.g. p=4, m=5, v=3)
        raise ScheduleError(f"make_plan: the interleaved schedule needs microbatches to be a "
                            f"multiple of stages, expected a multiple of {stages}, got "
                            f"{microbatches}")
    if name == "gpipe":
        orders = gpipe_order(stages, microbatches)
    elif name in ("1f1b", "interleaved"):
        orders = interleaved_order(stages, microbatches, v)
    else:
        orders = zero_bubble_order(stages, microbatches, forward, backward, weight, comm)
    num_stages = stages * v
    return Plan(name, stages, num_stages, microbatches, name == "zero-bubble",
                with_communication(orders, num_stages))


def validate_plan(plan: Plan) -> None:
    """Check that every rank runs only its stages, every (stage, micro-batch) gets exactly one
    F, one B (and one W when split) in that order, and each message has one SEND and one RECV.

    Raises:
        ScheduleError: naming the first violation.
    """
    seen: dict[tuple[str, int, int], int] = {}
    for rank, actions in enumerate(plan.actions):
        for a in actions:
            if a.kind not in KINDS or plan.rank_of(a.stage) != rank:
                raise ScheduleError(f"validate_plan: rank {rank} holds {a}, expected only "
                                    f"actions of stages {plan.stages_of(rank)}")
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise ScheduleError(f"validate_plan: {a} appears twice on rank {rank}")
            seen[key] = len(seen)
            if a.kind == "B" and ("F", a.stage, a.microbatch) not in seen:
                raise ScheduleError(f"validate_plan: {a} before its forward on rank {rank}")
            if a.kind == "W" and ("B", a.stage, a.microbatch) not in seen:
                raise ScheduleError(f"validate_plan: {a} before its B on rank {rank}")
    kinds = ("F", "B", "W") if plan.split_backward else ("F", "B")
    for kind in kinds:
        for s in range(plan.num_stages):
            for i in range(plan.num_microbatches):
                if (kind, s, i) not in seen:
                    raise ScheduleError(f"validate_plan: {kind}{s}.{i} is missing")
