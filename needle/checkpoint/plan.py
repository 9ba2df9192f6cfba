"""Where to put checkpoint boundaries in a chain of layers: a pure function of byte counts.

Cost model (the lecture's uniform-chain model, generalised to unequal layers). Layer ``i``
produces ``a[i]`` activation bytes. The chain is cut into contiguous segments; a *checkpointed*
segment keeps only its last output (the boundary) through the forward and rebuilds its layers in
backward, a *stored* segment keeps every output. Backward visits segments last to first; while it
works on segment ``j`` the bytes held are everything kept by segments before ``j`` plus segment
``j`` itself (boundary + rebuilt layers when checkpointed, as the lecture's proxy counts it)::

    peak = max_j ( sum_{m<j} kept_m + (b_j + s_j if checkpointed else s_j) )
    kept_m = b_m if checkpointed else s_m,   s_j = sum of a over segment j,  b_j = a[last of j]

For N equal layers cut into K checkpointed segments this is N/K + K units (65, 34, 20, 16, 20,
34, 65 for N = 64). Recompute = the compute cost of every checkpointed layer (1 per layer unless
``compute_costs`` says otherwise).

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

__all__ = ["CheckpointPlan", "plan_checkpoints", "predict_peak", "equal_segments"]


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


def _check_costs(layer_costs: Sequence, name: str = "layer_costs") -> list:
    costs = list(layer_costs)
    if not costs:
        raise MemoryArgumentError(
            f"plan_checkpoints: {name} is empty, expected one cost per layer, got []")
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0 or c != c:
            raise MemoryArgumentError(
                f"plan_checkpoints: bad {name}[{i}], expected a number >= 0, got {c!r}")
    return costs


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

    ``checkpointed`` defaults to every segment.

    Example:
        >>> predict_peak([1] * 64, equal_segments(64, 4))
        20
    """
    costs = _check_costs(layer_costs)
    flags = [True] * len(segments) if checkpointed is None else list(checkpointed)
    _check_segments(segments, len(costs), flags)
    peak, kept = 0, 0
    for (start, stop), ckpt in zip(segments, flags, strict=True):
        seg = sum(costs[start:stop])
        boundary = costs[stop - 1]
        peak = max(peak, kept + (boundary + seg if ckpt else seg))
        kept += boundary if ckpt else seg
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
        layer_costs: activation bytes of each layer's output (e.g. from ``ndl.memory.trace``).
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
    costs = _check_costs(layer_costs)
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
    compute = _compute_costs(compute_costs, len(costs))
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


def _sqrt_plan(costs: list, compute_costs) -> CheckpointPlan:
    n = len(costs)
    segments = equal_segments(n, max(1, min(n, round(math.sqrt(n)))))
    compute = _compute_costs(compute_costs, n)
    flags = (True,) * len(segments)
    return CheckpointPlan("sqrt", segments, flags, predict_peak(costs, segments, flags),
                          sum(compute), sum(costs))


def _optimal_plan(costs: list, compute: list, budget) -> CheckpointPlan:
    """Pareto dynamic programming over segment ends.

    ``fronts[i]`` holds, for the prefix ``layers[:i]``, every non-dominated (bytes kept so far,
    recompute so far) pair with a back-pointer; the feasibility of the next segment depends
    only on the bytes kept before it, so the front carries all the state the future needs.
    """
    n = len(costs)
    prefix_a, prefix_c = [0], [0]
    for a, c in zip(costs, compute, strict=True):
        prefix_a.append(prefix_a[-1] + a)
        prefix_c.append(prefix_c[-1] + c)
    fronts: list[list] = [[(0, 0, None)]] + [[] for _ in range(n)]
    for stop in range(1, n + 1):
        candidates = []
        for start in range(stop):
            seg = prefix_a[stop] - prefix_a[start]
            boundary = costs[stop - 1]
            recompute = prefix_c[stop] - prefix_c[start]
            for entry in fronts[start]:
                kept, rec = entry[0], entry[1]
                if kept + seg <= budget:
                    candidates.append((kept + seg, rec, (start, False, entry)))
                if kept + boundary + seg <= budget:
                    candidates.append((kept + boundary, rec + recompute, (start, True, entry)))
        fronts[stop] = _pareto(candidates)
    if not fronts[n]:
        least = _least_peak(costs)
        raise MemoryPlanError(
            f"plan_checkpoints: no segmentation fits the budget, expected memory_budget >= "
            f"{least} (the least peak the cost model allows), got {budget}")
    best = min(_unwind(fronts[n], n, costs), key=lambda plan: (plan[1], plan[2]))
    segments, flags = best[0]
    return CheckpointPlan("optimal", segments, flags, best[2], best[1], sum(costs))


def _least_peak(costs: list):
    """The smallest peak any segmentation reaches (same Pareto DP, on (kept, peak so far))."""
    n = len(costs)
    fronts: list[list] = [[(0, 0, None)]] + [[] for _ in range(n)]
    for stop in range(1, n + 1):
        candidates = []
        for start in range(stop):
            seg = sum(costs[start:stop])
            boundary = costs[stop - 1]
            for kept, peak, _ in fronts[start]:
                candidates.append((kept + seg, max(peak, kept + seg), None))
                candidates.append((kept + boundary, max(peak, kept + boundary + seg), None))
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


def _unwind(front: list, n: int, costs: list):
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
        yield plan, entry[1], predict_peak(costs, plan[0], plan[1])
