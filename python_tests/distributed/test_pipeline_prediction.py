"""A pipeline measured at one micro-batch count predicts another: the report's simulator inputs
(``PipelineReport.inputs``, what ``bench/bench_time_model.py`` calibrates from) carry each
action's own cost, without the adjoint's send that the simulator posts inside ``B`` again."""
from __future__ import annotations

import numpy as np
import pytest

from needle.distributed.pipeline import make_plan, simulate
from needle.distributed.pipeline.report import _build
from needle.distributed.pipeline.schedules import KINDS

# unequal stages and a send that costs its rank: symmetric costs would hide a wrong B
FORWARD, BACKWARD, SEND = [1.0, 2.0], [2.0, 4.0], 0.5


def recorded(schedule: str, m: int, steps: int = 2) -> list[np.ndarray]:
    """Per rank, the report's rows (step, kind, stage, micro-batch, start, end, activation
    bytes, base) of ``steps`` identical steps, from the simulator's timeline of the true
    costs: what a run with exactly these costs records."""
    plan = make_plan(schedule, 2, m)
    sim = simulate(plan, forward=FORWARD, backward=BACKWARD, send_time=SEND,
                   adjoint_in_backward=True)
    return [np.array([(k, KINDS.index(e.kind), e.stage, e.microbatch, e.start, e.end, 0.0, 0.0)
                      for k in range(steps) for e in row], dtype=np.float64)
            for row in sim.timeline]


def test_gpipe_measured_at_two_microbatches_predicts_four():
    report = _build(make_plan("gpipe", 2, 2), recorded("gpipe", 2), memory_ok=False)
    inputs = report.inputs
    assert inputs["send_time"] == pytest.approx(SEND)
    # stage 1's recorded B holds the adjoint's send; the inputs give it back to the send
    assert [np.mean(x) for x in inputs["backward"]] == pytest.approx(BACKWARD)
    four = simulate(make_plan("gpipe", 2, 4), **{**inputs, "message_noise": None})
    # by hand: stage 0 sends its forwards at 1, 2.5, 4, 5.5; stage 1 runs its four F from 1
    # to 9 and its four B (4 + 0.5 posting) to 27; the last adjoint lands at 26.5 and
    # stage 0's last B ends at 28.5. Busy: 4 x (1 + 2) + 4 x (2 + 4.5) = 38 of 2 x 28.5
    assert four.makespan == pytest.approx(28.5)
    assert four.bubble_fraction == pytest.approx(1 / 3)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_other_schedules_predict_the_true_costs_timeline(schedule):
    report = _build(make_plan(schedule, 2, 2), recorded(schedule, 2), memory_ok=False)
    inputs = {**report.inputs, "message_noise": None}
    got = simulate(make_plan(schedule, 2, 6), **inputs)
    truth = simulate(make_plan(schedule, 2, 6), forward=FORWARD, backward=BACKWARD,
                     send_time=SEND, adjoint_in_backward=True)
    assert got.makespan == pytest.approx(truth.makespan)
    assert got.bubble_fraction == pytest.approx(truth.bubble_fraction)
