"""The pipeline simulator where stages cost differently, and zero-bubble's activation peak.

With equal stages several wrong bubble formulas agree with the right one
(``(p - 1) / (m + p - 1)``, one rank's idle share, idle over each rank's own span); here the
expected numbers are worked out by hand from the timelines in the comments. Zero-bubble splits
the backward in B (input gradient) and W (weight gradient): a micro-batch's activations stay
until its W, so the per-rank peak counts F's not yet matched by a W, not by a B.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from needle.distributed.pipeline import simulate

COMPUTE = ("F", "B", "W")


def _compute(sim, rank):
    return [(e.kind, e.microbatch, e.start, e.end) for e in sim.timeline[rank]
            if e.kind in COMPUTE]


def test_gpipe_three_unequal_stages_by_hand():
    # F = [1, 3, 2], B = [2, 1, 4], m = 2, no communication cost:
    # rank 0: F 0-1, 1-2;            B 14-16, 18-20   busy 6
    # rank 1: F 1-4, 4-7;            B 13-14, 17-18   busy 8
    # rank 2: F 4-6, 7-9; B 9-13, 13-17               busy 12
    # makespan 20: bubble (3*20 - 26) / 60 = 34/60; per rank 14/20, 12/20, 8/20.
    # (p-1)/(m+p-1) says 1/2; idle over each rank's own span (20, 18, 17) says 29/55.
    sim = simulate("gpipe", 3, 2, forward=[1, 3, 2], backward=[2, 1, 4])
    assert _compute(sim, 1) == [("F", 0, 1, 4), ("F", 1, 4, 7), ("B", 0, 13, 14),
                                ("B", 1, 17, 18)]
    assert sim.makespan == pytest.approx(20.0)
    assert sim.busy == pytest.approx([6.0, 8.0, 12.0])
    assert sim.bubble_fraction == pytest.approx(34 / 60)
    assert sim.bubble_per_rank == pytest.approx([0.7, 0.6, 0.4])


def test_1f1b_three_unequal_stages_by_hand():
    # The same costs under 1F1B: rank 2 runs F0 4-6, B0 6-10, F1 10-12, B1 12-16; rank 1
    # F 1-4, 4-7, B 10-11, 16-17; rank 0 F 0-1, 1-2, B 11-13, 17-19. Makespan 19 (GPipe: 20),
    # bubble (57 - 26) / 57; ranks 0 and 1 hold two micro-batches, the last rank one.
    sim = simulate("1f1b", 3, 2, forward=[1, 3, 2], backward=[2, 1, 4])
    assert _compute(sim, 2) == [("F", 0, 4, 6), ("B", 0, 6, 10), ("F", 1, 10, 12),
                                ("B", 1, 12, 16)]
    assert sim.makespan == pytest.approx(19.0)
    assert sim.bubble_fraction == pytest.approx(31 / 57)
    assert sim.bubble_per_rank == pytest.approx([13 / 19, 11 / 19, 7 / 19])
    assert sim.peak_inflight == [2, 2, 1]


def test_zero_bubble_frees_activations_at_w_by_hand():
    # p = 2, m = 3, F = B = W = 1; a micro-batch holds 10 bytes on stage 0, 1 on stage 1.
    # rank 0: F0 0-1, F1 1-2 (holds 2 = p: no third F), B0 3-4, W0 4-5, B1 5-6, F2 6-7,
    #         W1 7-8, B2 9-10, W2 10-11
    # rank 1: F0 1-2, B0 2-3, F1 3-4, B1 4-5, W0 5-6, W1 6-7, F2 7-8, B2 8-9, W2 9-10
    # rank 1 holds micro-batches 0 and 1 from 3 to 6 (their W's come after both B's): peak
    # 2 there, where freeing at B would say 1. Busy 9 of 11 on each rank: bubble 4/22.
    sim = simulate("zero-bubble", 2, 3, forward=1, backward=1, weight=1,
                   activation_bytes=[10, 1])
    assert [k + str(i) for k, i, _, _ in _compute(sim, 1)] == \
        ["F0", "B0", "F1", "B1", "W0", "W1", "F2", "B2", "W2"]
    assert [k + str(i) for k, i, _, _ in _compute(sim, 0)] == \
        ["F0", "F1", "B0", "W0", "B1", "F2", "W1", "B2", "W2"]
    assert sim.peak_inflight == [2, 2]
    assert sim.peak_activation_bytes == [20.0, 2.0]
    assert sim.bubble_fraction == pytest.approx(4 / 22)


def test_zero_bubble_last_rank_holds_p_microbatches():
    # p = 3, m = 4, equal costs: the last rank runs F B F B F B before its first W, so it
    # holds 3 micro-batches (1F1B's last rank holds 1); every rank peaks at p.
    sim = simulate("zero-bubble", 3, 4, forward=1, backward=1, weight=1,
                   activation_bytes=[4, 2, 1])
    assert [k for k, *_ in _compute(sim, 2)][:7] == ["F", "B", "F", "B", "F", "B", "W"]
    assert sim.peak_inflight == [3, 3, 3]
    assert sim.peak_activation_bytes == [12.0, 6.0, 3.0]
    assert simulate("1f1b", 3, 4).peak_inflight == [3, 2, 1]


def _held_peak(sim, rank, frees_at):
    """The most micro-batches whose F ran and whose ``frees_at`` had not, from the timeline."""
    held = peak = 0
    for kind, *_ in _compute(sim, rank):
        held += (kind == "F") - (kind == frees_at)
        peak = max(peak, held)
    return peak


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 4), m=st.integers(1, 6), data=st.data())
def test_bubble_and_peaks_follow_from_the_timeline(p, m, data):
    """For random per-stage costs: the bubble is (p * makespan - sum of compute) / (p *
    makespan) of the timeline, each rank's is its own idle share, and the activation peak
    counts F's not yet freed (at W for zero-bubble, at B otherwise) times the stage's bytes."""
    ints = st.lists(st.integers(1, 5), min_size=p, max_size=p)
    forward, backward, weight, act = (data.draw(ints) for _ in range(4))
    schedule = data.draw(st.sampled_from(["gpipe", "1f1b", "zero-bubble"]))
    sim = simulate(schedule, p, m, forward=forward, backward=backward, weight=weight,
                   activation_bytes=act)
    makespan = max(e.end for row in sim.timeline for e in row)
    busy = [sum(e - s for _, _, s, e in _compute(sim, r)) for r in range(p)]
    assert sim.makespan == pytest.approx(makespan)
    assert sim.bubble_fraction == pytest.approx((p * makespan - sum(busy)) / (p * makespan))
    assert sim.bubble_per_rank == pytest.approx([(makespan - b) / makespan for b in busy])
    frees_at = "W" if schedule == "zero-bubble" else "B"
    peaks = [_held_peak(sim, r, frees_at) for r in range(p)]
    assert sim.peak_inflight == peaks
    want = [n * a for n, a in zip(peaks, act, strict=True)]
    assert sim.peak_activation_bytes == pytest.approx(want)
