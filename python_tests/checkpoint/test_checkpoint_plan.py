"""plan_checkpoints: the sqrt policy and the budget-optimal DP, against a brute force."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from needle._core.errors import MemoryArgumentError, MemoryPlanError
from needle.checkpoint import equal_segments, plan_checkpoints, predict_peak


def _simulate_peak(costs, segments, flags):
    """Bytes held while backward visits each segment, written out step by step (independent
    of the library's loop): kept outputs of earlier segments + this segment's working set."""
    peaks = []
    for j, (start, stop) in enumerate(segments):
        earlier = 0
        for (s, e), ck in zip(segments[:j], flags[:j], strict=False):
            earlier += costs[e - 1] if ck else sum(costs[s:e])
        here = sum(costs[start:stop]) + (costs[stop - 1] if flags[j] else 0)
        peaks.append(earlier + here)
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


@pytest.mark.parametrize("seed", range(6))
def test_optimal_policy_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 8))
    costs = [int(c) for c in rng.integers(1, 9, size=n)]
    compute = [int(c) for c in rng.integers(1, 4, size=n)]
    plans = [(segs, flags, _simulate_peak(costs, segs, flags)) for segs, flags in _all_plans(n)]
    least = min(p for _, _, p in plans)
    for budget in (least, (least + sum(costs)) // 2, sum(costs)):
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
