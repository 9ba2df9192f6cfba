"""plan_checkpoints: the sqrt policy and the budget-optimal DP, against a brute force."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from needle._core.errors import MemoryArgumentError, MemoryPlanError
from needle.checkpoint import LayerCost, equal_segments, plan_checkpoints, predict_peak


def _simulate_peak(costs, segments, flags):
    """Bytes held while backward visits each segment, written out layer by layer (independent
    of the library's loops): what earlier segments keep, this segment's layers run with a graph
    (what the earlier layers of the segment keep + the working set of the running one), the
    first forward's boundary when the segment is recomputed, the chain's output held by the
    caller while earlier segments are worked on."""
    c = [x if isinstance(x, LayerCost) else LayerCost(x) for x in costs]
    n = len(c)
    keeps = []
    for (s, e), ck in zip(segments, flags, strict=True):
        if ck:
            keeps.append(c[e - 1].output)
        else:
            keeps.append(sum(c[i].kept for i in range(s, e))
                         + (0 if c[e - 1].keeps_output else c[e - 1].output))
    peaks = []
    for j, ((s, e), ck) in enumerate(zip(segments, flags, strict=True)):
        held = sum(keeps[:j]) + (c[e - 1].output if ck else 0) + (c[-1].output if e < n else 0)
        inside = 0
        for i in range(s, e):
            peaks.append(held + inside + c[i].working)
            inside += c[i].kept
    return max(peaks)


def _all_plans(n):
    for cuts in itertools.product([False, True], repeat=n - 1):
        starts = [0] + [i + 1 for i, c in enumerate(cuts) if c]
        segments = [(s, e) for s, e in zip(starts, starts[1:] + [n], strict=False)]
        for flags in itertools.product([False, True], repeat=len(segments)):
            yield segments, list(flags)


@pytest.mark.parametrize("k, expected", [(1, 65), (2, 34), (4, 20), (8, 16), (16, 20),
                                         (32, 34), (64, 65)])
def test_uniform_chain_matches_lecture_proxy(k, expected):
    assert predict_peak([1] * 64, equal_segments(64, k)) == expected
    assert expected == 64 // k + k


def test_sqrt_policy_on_known_vectors():
    plan = plan_checkpoints([1] * 64)
    assert plan.policy == "sqrt"
    assert plan.segments == tuple((8 * i, 8 * i + 8) for i in range(8))
    assert plan.predicted_peak_bytes == 16 and plan.no_checkpoint_peak_bytes == 64
    assert plan.boundaries == tuple(range(0, 64, 8)) and all(plan.checkpointed)
    for n in (1, 2, 5, 10, 17, 100):
        p = plan_checkpoints([3] * n)
        sizes = [e - s for s, e in p.segments]
        assert len(sizes) == max(1, round(math.sqrt(n)))
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
        assert p.predicted_peak_bytes == _simulate_peak([3] * n, p.segments, p.checkpointed)


def test_predict_peak_on_a_hand_computed_vector():
    # segment (0,2): 0 kept + boundary 1 + layers 5 = 6; segment (2,4): 1 + 4 + 5 = 10
    assert predict_peak([4, 1, 1, 4], [(0, 2), (2, 4)]) == 10
    # storing the first segment: 5; then 5 + 4 + 5 = 14
    assert predict_peak([4, 1, 1, 4], [(0, 2), (2, 4)], [False, True]) == 14


def _random_costs(rng, n, rich):
    if not rich:
        return [int(c) for c in rng.integers(1, 9, size=n)]
    out = []
    for _ in range(n):
        output = int(rng.integers(1, 9))
        keeps = bool(rng.random() < 0.6)
        kept = int(rng.integers(0, 6)) + (output if keeps else 0)
        out.append(LayerCost(output, kept=kept, working=kept + int(rng.integers(0, 9)),
                             keeps_output=keeps))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rich", [False, True], ids=["numbers", "layer_costs"])
def test_optimal_policy_equals_brute_force(seed, rich):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 8))
    costs = _random_costs(rng, n, rich)
    compute = [int(c) for c in rng.integers(1, 4, size=n)]
    plans = [(segs, flags, _simulate_peak(costs, segs, flags)) for segs, flags in _all_plans(n)]
    least = min(p for _, _, p in plans)
    top = max(p for _, _, p in plans)
    for budget in (least, (least + top) // 2, top):
        fits = [sum(compute[i] for (s, e), ck in zip(segs, flags, strict=True) if ck
                    for i in range(s, e))
                for segs, flags, peak in plans if peak <= budget]
        plan = plan_checkpoints(costs, memory_budget=budget, compute_costs=compute)
        assert plan.policy == "optimal"
        assert plan.recompute_cost == min(fits)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_peak_bytes == _simulate_peak(costs, plan.segments,
                                                           plan.checkpointed)
    with pytest.raises(MemoryPlanError, match=f"memory_budget >= {least}"):
        plan_checkpoints(costs, memory_budget=least - 1)


def test_budget_above_total_needs_no_recompute():
    plan = plan_checkpoints([5, 6, 7], memory_budget=18)
    assert plan.recompute_cost == 0 and plan.predicted_peak_bytes == 18


def test_optimal_under_the_sqrt_peak_recomputes_no_more_than_sqrt():
    costs = [1] * 64
    plan = plan_checkpoints(costs, memory_budget=16)
    assert plan.predicted_peak_bytes <= 16 and plan.recompute_cost <= 64


@pytest.mark.parametrize("bad, kwargs", [([], {}), ([1, -1], {}), ([1, "x"], {}),
                                         ([1, 2], {"policy": "fast"}),
                                         ([1, 2], {"policy": "optimal"}),
                                         ([1, 2], {"memory_budget": 9, "compute_costs": [1]})])
def test_bad_arguments(bad, kwargs):
    with pytest.raises(MemoryArgumentError):
        plan_checkpoints(bad, **kwargs)


def test_equal_segments_rejects_bad_counts():
    with pytest.raises(MemoryArgumentError):
        equal_segments(4, 5)
    with pytest.raises(MemoryArgumentError):
        predict_peak([1, 1], [(0, 1)])
