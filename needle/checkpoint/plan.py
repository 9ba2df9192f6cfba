"""Where to put checkpoint boundaries in a chain of layers: a pure function of byte counts.

Cost model. The chain is cut into contiguous segments; a *checkpointed* segment keeps only its
last output (the boundary) through the forward and rebuilds its layers in backward, a *stored*
segment keeps what its layers keep. Each layer ``i`` is described by a :class:`LayerCost`:

* ``output`` — bytes of its output (a boundary when a segment ends there);
* ``kept`` — bytes its forward leaves alive until its backward when run with a graph (what its
  ops save, its output when something keeps it);
* ``working`` — the most bytes alive while its forward runs, above what earlier layers keep:
  temporaries, its output, its input when nothing else keeps it, what the previous layer
  releases late;
* ``keeps_output`` — whether ``kept`` includes the output.

:func:`measure_layer_costs` measures all four on the real layers. A plain number ``c`` is the
lecture's proxy: ``LayerCost(c, kept=c, working=c, keeps_output=True)``.

Backward visits segments last to first. While it works on segment ``j`` the bytes held are what
earlier segments keep, plus segment ``j``'s forward working set (run again when checkpointed),
plus, when checkpointed, the boundary output the first forward returned (the region's node
still holds it while its backward recomputes), plus the chain's output ``b_last``, which the
caller holds (``y.backward()``, or a reference kept) until backward ends::

    peak = max_j ( sum_{m<j} keep_m + run_j + [b_j if checkpointed] + [b_last if j not last] )
    run_j  = max_{i in j} ( sum_{s_j <= i' < i} kept_i' + working_i )
    keep_m = b_m if checkpointed else sum_{i in m} kept_i + [b_m if not keeps_output(last)]

with ``b_m`` the output of segment ``m``'s last layer. The first forward of a segment holds at
most ``run_j`` above what earlier segments keep (a checkpointed one keeps nothing inside), so
the backward terms bound the whole step. With plain numbers this is the lecture's model: for N
equal layers cut into K checkpointed segments N/K + K units (65, 34, 20, 16, 20, 34, 65 for
N = 64; the held output only ties the last two segments' terms). Recompute = the compute cost
of every checkpointed layer (1 per layer unless ``compute_costs`` says otherwise).

What the budget bounds: the ``activation`` category of ``needle.memory`` during forward and
backward of the chain (the input of the chain and the gradients are not in it; a gradient in
flight is ``gradient`` memory). With measured costs the plan's peak is the allocator's to within
the allocator rounding already inside the costs: python_tests/checkpoint runs several budgets
and measures.

Example:
    >>> p = plan_checkpoints([1] * 64)
    >>> p.policy, len(p.segments), p.predicted_peak_bytes
    ('sqrt', 8, 16)
    >>> q = plan_checkpoints([1] * 64, memory_budget=40)
    >>> q.predicted_peak_bytes <= 40 and q.recompute_cost < 64
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .._core.errors import MemoryArgumentError, MemoryPlanError

__all__ = ["CheckpointPlan", "LayerCost", "plan_checkpoints", "predict_peak", "equal_segments"]


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs in memory (see the module docstring); bytes."""

    output: int
    kept: int | None = None
    working: int | None = None
    keeps_output: bool = True

    def __post_init__(self) -> None:
        if self.kept is None:
            object.__setattr__(self, "kept", self.output)
        if self.working is None:
            object.__setattr__(self, "working", self.output)


class _Costs:
    """Per-layer costs as arrays, with the segment quantities of the model precomputed."""

    def __init__(self, layers: list):
        self.n = len(layers)
        self.out = [c.output for c in layers]
        self.kept = [c.kept for c in layers]
        self.work = [c.working for c in layers]
        self.keeps = [c.keeps_output for c in layers]
        self.prefix = [0]
        for k in self.kept:
            self.prefix.append(self.prefix[-1] + k)
        self._rows: dict = {}  # start -> run(start, start + 1), run(start, start + 2), ...

    def run(self, start: int, stop: int):
        """Forward working set of layers ``start..stop-1`` run with a graph (each row of the
        table is extended on demand, so the planner's loops stay O(N^2))."""
        row = self._rows.setdefault(start, [])
        while len(row) < stop - start:
            i = start + len(row)
            last = self.prefix[i] - self.prefix[start] + self.work[i]
            row.append(last if not row else max(row[-1], last))
        return row[stop - start - 1]

    def keep(self, start: int, stop: int, ckpt: bool):
        boundary = self.out[stop - 1]
        if ckpt:
            return boundary
        stored = self.prefix[stop] - self.prefix[start]
        return stored + (0 if self.keeps[stop - 1] else boundary)

    def peak_term(self, start: int, stop: int, ckpt: bool, run=None):
        run = self.run(start, stop) if run is None else run
        # the chain's output: the caller holds it while backward works on earlier segments
        held = self.out[-1] if stop < self.n else 0
        return run + (self.out[stop - 1] if ckpt else 0) + held


@dataclass(frozen=True)
class CheckpointPlan:
    """Segments of a chain and what the cost model predicts for them.

    ``segments``: ``(start, stop)`` layer ranges covering ``range(N)``; ``checkpointed[j]``:
    whether segment ``j`` is recomputed in backward; ``boundaries``: the start of each segment;
    ``predicted_peak_bytes`` / ``no_checkpoint_peak_bytes``: the model's peak with this plan and
    with no checkpointing (= sum of the costs); ``recompute_cost``: extra forward work.
    """

    policy: str
    segments: tuple[tuple[int, int], ...]
    checkpointed: tuple[bool, ...]
    predicted_peak_bytes: int
    recompute_cost: float
    no_checkpoint_peak_bytes: int

    @property
    def boundaries(self) -> tuple[int, ...]:
        return tuple(start for start, _ in self.segments)

    @property
    def num_segments(self) -> int:
        return len(self.segments)


def _check_number(c, name: str, i: int) -> None:
    if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0 or c != c:
        raise MemoryArgumentError(
            f"plan_checkpoints: bad {name}[{i}], expected a number >= 0, got {c!r}")


def _check_costs(layer_costs: Sequence, name: str = "layer_costs") -> list:
    costs = list(layer_costs)
    if not costs:
        raise MemoryArgumentError(
            f"plan_checkpoints: {name} is empty, expected one cost per layer, got []")
    for i, c in enumerate(costs):
        if isinstance(c, LayerCost):
            for field in (c.output, c.kept, c.working):
                _check_number(field, name, i)
        else:
            _check_number(c, name, i)
    return costs


def _layer_costs(layer_costs: Sequence) -> _Costs:
    costs = _check_costs(layer_costs)
    return _Costs([c if isinstance(c, LayerCost) else LayerCost(c) for c in costs])


def equal_segments(num_layers: int, num_segments: int) -> tuple[tuple[int, int], ...]:
    """Cut ``range(num_layers)`` into ``num_segments`` contiguous pieces, sizes differing by at
    most one, larger pieces first (the order ``np.array_split`` uses).

    Example:
        >>> equal_segments(10, 3)
        ((0, 4), (4, 7), (7, 10))
    """
    if num_segments < 1 or num_segments > num_layers:
        raise MemoryArgumentError(
            f"equal_segments: bad number of segments, expected 1 <= segments <= {num_layers}, "
            f"got {num_segments}")
    base, extra = divmod(num_layers, num_segments)
    out, start = [], 0
    for j in range(num_segments):
        stop = start + base + (1 if j < extra else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


def predict_peak(layer_costs: Sequence, segments, checkpointed=None):
    """The cost model's peak bytes for ``segments`` (see the module docstring).

    ``layer_costs``: numbers or :class:`LayerCost`; ``checkpointed`` defaults to every segment.

    Example:
        >>> predict_peak([1] * 64, equal_segments(64, 4))
        20
    """
    costs = _layer_costs(layer_costs)
    flags = [True] * len(segments) if checkpointed is None else list(checkpointed)
    _check_segments(segments, costs.n, flags)
    peak, kept = 0, 0
    for (start, stop), ckpt in zip(segments, flags, strict=True):
        peak = max(peak, kept + costs.peak_term(start, stop, ckpt))
        kept += costs.keep(start, stop, ckpt)
    return peak


def _check_segments(segments, n: int, flags) -> None:
    expected = 0
    for start, stop in segments:
        if start != expected or stop <= start:
            raise MemoryArgumentError(
                f"predict_peak: segments must tile range({n}) in order, expected a segment "
                f"starting at {expected}, got ({start}, {stop})")
        expected = stop
    if expected != n or len(flags) != len(segments):
        raise MemoryArgumentError(
            f"predict_peak: segments must end at {n} with one flag each, expected end {n} and "
            f"{len(segments)} flags, got end {expected} and {len(flags)} flags")


def plan_checkpoints(layer_costs: Sequence, memory_budget=None, *, policy: str = "auto",
                     compute_costs: Sequence | None = None) -> CheckpointPlan:
    """Choose checkpoint segments for a chain with per-layer activation bytes ``layer_costs``.

    Args:
        layer_costs: per layer, a :class:`LayerCost` (measure them with
            :func:`measure_layer_costs`: then the measured activation peak of running the plan
            stays within ``memory_budget``) or a number (the bytes of its output: the lecture's
            proxy, which does not see temporaries or what layers keep besides their output).
        memory_budget: bytes the model's peak may reach; required by the ``optimal`` policy.
        policy: ``"sqrt"`` (round(√N) equal segments, all checkpointed), ``"optimal"`` (least
            recompute whose predicted peak fits the budget, by dynamic programming over segment
            ends) or ``"auto"`` (optimal when a budget is given, else sqrt).
        compute_costs: forward cost of each layer for the recompute objective (default 1 each).

    Returns:
        a :class:`CheckpointPlan`.

    Raises:
        MemoryArgumentError: empty or negative costs, unknown policy, no budget for optimal.
        MemoryPlanError: no segmentation fits the budget (the message gives the least peak).

    Example:
        >>> plan_checkpoints([4, 4, 4, 4]).segments
        ((0, 2), (2, 4))
    """
    costs = _layer_costs(layer_costs)
    if policy == "auto":
        policy = "sqrt" if memory_budget is None else "optimal"
    if policy == "sqrt":
        return _sqrt_plan(costs, compute_costs)
    if policy != "optimal":
        raise MemoryArgumentError(
            f"plan_checkpoints: unknown policy, expected 'auto', 'sqrt' or 'optimal', got "
            f"{policy!r}")
    if memory_budget is None or memory_budget < 0:
        raise MemoryArgumentError(
            f"plan_checkpoints: the optimal policy needs a budget, expected memory_budget >= 0, "
            f"got {memory_budget!r}")
    compute = _compute_costs(compute_costs, costs.n)
    return _optimal_plan(costs, compute, memory_budget)


def _compute_costs(compute_costs, n: int) -> list:
    if compute_costs is None:
        return [1] * n
    compute = _check_costs(compute_costs, "compute_costs")
    if len(compute) != n:
        raise MemoryArgumentError(
            f"plan_checkpoints: compute_costs has the wrong length, expected {n}, got "
            f"{len(compute)}")
    return compute


def _no_checkpoint_peak(costs: _Costs):
    return costs.peak_term(0, costs.n, False)


def _peak(costs: _Costs, segments, flags):
    peak, kept = 0, 0
    for (start, stop), ckpt in zip(segments, flags, strict=True):
        peak = max(peak, kept + costs.peak_term(start, stop, ckpt))
        kept += costs.keep(start, stop, ckpt)
    return peak


def _sqrt_plan(costs: _Costs, compute_costs) -> CheckpointPlan:
    n = costs.n
    segments = equal_segments(n, max(1, min(n, round(math.sqrt(n)))))
    compute = _compute_costs(compute_costs, n)
    flags = (True,) * len(segments)
    return CheckpointPlan("sqrt", segments, flags, _peak(costs, segments, flags),
                          sum(compute), _no_checkpoint_peak(costs))


def _optimal_plan(costs: _Costs, compute: list, budget) -> CheckpointPlan:
    """Pareto dynamic programming over segment ends.

    ``fronts[i]`` holds, for the prefix ``layers[:i]``, every non-dominated (bytes kept so far,
    recompute so far) pair with a back-pointer; the feasibility of the next segment depends
    only on the bytes kept before it, so the front carries all the state the future needs.
    """
    n = costs.n
    prefix_c = [0]
    for c in compute:
        prefix_c.append(prefix_c[-1] + c)
    fronts: list[list] = [[(0, 0, None)]] + [[] for _ in range(n)]
    for stop in range(1, n + 1):
        candidates = []
        for start in range(stop):
            run = costs.run(start, stop)
            recompute = prefix_c[stop] - prefix_c[start]
            for ckpt in (False, True):
                need = costs.peak_term(start, stop, ckpt, run)
                keep = costs.keep(start, stop, ckpt)
                for entry in fronts[start]:
                    kept, rec = entry[0], entry[1]
                    if kept + need <= budget:
                        candidates.append((kept + keep, rec + (recompute if ckpt else 0),
                                           (start, ckpt, entry)))
        fronts[stop] = _pareto(candidates)
    if not fronts[n]:
        least = _least_peak(costs)
        raise MemoryPlanError(
            f"plan_checkpoints: no segmentation fits the budget, expected memory_budget >= "
            f"{least} (the least peak the cost model allows), got {budget}")
    best = min(_unwind(fronts[n], n, costs), key=lambda plan: (plan[1], plan[2]))
    segments, flags = best[0]
    return CheckpointPlan("optimal", segments, flags, best[2], best[1],
                          _no_checkpoint_peak(costs))


def _least_peak(costs: _Costs):
    """The smallest peak any segmentation reaches (same Pareto DP, on (kept, peak so far))."""
    n = costs.n
    fronts: list[list] = [[(0, 0, None)]] + [[] for _ in range(n)]
    for stop in range(1, n + 1):
        candidates = []
        for start in range(stop):
            run = costs.run(start, stop)
            for ckpt in (False, True):
                need = costs.peak_term(start, stop, ckpt, run)
                keep = costs.keep(start, stop, ckpt)
                for kept, peak, _ in fronts[start]:
                    candidates.append((kept + keep, max(peak, kept + need), None))
        fronts[stop] = _pareto(candidates)
    return min(peak for _, peak, _ in fronts[n])


def _pareto(candidates: list) -> list:
    """Keep the (kept, recompute) pairs that no other pair beats on both."""
    candidates.sort(key=lambda e: (e[0], e[1]))
    front, best_rec = [], math.inf
    for entry in candidates:
        if entry[1] < best_rec:
            front.append(entry)
            best_rec = entry[1]
    return front


def _unwind(front: list, n: int, costs: _Costs):
    """(segments and flags, recompute, predicted peak) for every end state of the front."""
    for entry in front:
        segments, flags, stop, node = [], [], n, entry
        while node[2] is not None:
            start, ckpt, parent = node[2]
            segments.append((start, stop))
            flags.append(ckpt)
            stop, node = start, parent
        segments.reverse()
        flags.reverse()
        plan = (tuple(segments), tuple(flags))
        yield plan, entry[1], _peak(costs, plan[0], plan[1])
