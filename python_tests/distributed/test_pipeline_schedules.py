"""Pipeline schedules as data and the simulator: no communication, no autograd."""
from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction

import pytest

from needle.distributed.pipeline import (
    Action,
    Plan,
    ScheduleError,
    balance,
    make_plan,
    min_microbatches,
    simulate,
    validate_plan,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpipe_bubble(p: int, m: int) -> Fraction:
    """The course's formula, written independently of the simulator."""
    return Fraction(p - 1, m + p - 1)


@pytest.mark.parametrize("p,m", [(4, 8), (2, 1), (2, 5), (3, 7), (8, 32), (1, 4)])
def test_gpipe_bubble_is_the_formula(p, m):
    sim = simulate("gpipe", p, m, forward=1.0, backward=2.0)
    assert sim.bubble_fraction == pytest.approx(float(gpipe_bubble(p, m)), abs=1e-12)
    assert sim.makespan == pytest.approx(3.0 * (m + p - 1))


def test_gpipe_4_stages_8_microbatches_is_3_over_11():
    assert round(simulate("gpipe", 4, 8).bubble_fraction, 4) == 0.2727


def test_bubble_first_drops_below_ten_percent_at_28():
    assert simulate("gpipe", 4, 27).bubble_fraction == pytest.approx(0.1, abs=1e-12)
    assert not simulate("gpipe", 4, 27).bubble_fraction < 0.1
    assert simulate("gpipe", 4, 28).bubble_fraction < 0.1
    assert min_microbatches("gpipe", 4, 0.10) == 28


@pytest.mark.parametrize("p,m", [(4, 8), (2, 6), (4, 3), (3, 9)])
def test_1f1b_holds_at_most_p_microbatches_gpipe_m(p, m):
    one = simulate("1f1b", p, m)
    assert one.peak_inflight == [min(p - r, m) for r in range(p)]
    assert simulate("gpipe", p, m).peak_inflight == [m] * p
    # same bubble as GPipe when there is no communication cost (the lecture's point)
    assert one.bubble_fraction == pytest.approx(float(gpipe_bubble(p, m)))


def test_activation_bytes_scale_the_peak():
    sim = simulate("1f1b", 2, 4, activation_bytes=[100, 10])
    assert sim.peak_activation_bytes == [200, 10]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (2, 6, 4)])
def test_interleaving_divides_the_bubble(p, m, v):
    # each of the v chunks costs 1/v of a stage: the fill/drain time shrinks v-fold
    sim = simulate("interleaved", p, m, forward=1 / v, backward=2 / v, virtual_stages=v)
    fill = Fraction(p - 1, v)
    assert sim.bubble_fraction == pytest.approx(float(fill / (m + fill)))
    assert sim.bubble_fraction < simulate("1f1b", p, m).bubble_fraction


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_beats_1f1b_within_its_memory(p, m):
    zb = simulate("zero-bubble", p, m, forward=1, backward=1, weight=1)
    one = simulate("1f1b", p, m, forward=1, backward=1, weight=1)
    assert zb.bubble_fraction < one.bubble_fraction
    assert max(zb.peak_inflight) <= p
    assert zb.busy == pytest.approx(one.busy)  # same work, rearranged


def test_communication_cost_is_on_the_critical_path():
    # p=2, m=1: F(1) + comm + F(1) + B(2) + comm + B(2), each hop adds 0.5
    sim = simulate("gpipe", 2, 1, forward=1, backward=2, comm=0.5)
    assert sim.makespan == pytest.approx(7.0)
    rank0 = [(e.kind, e.start, e.end) for e in sim.timeline[0]]
    assert rank0 == [("F", 0, 1), ("SEND_F", 1, 1), ("RECV_B", 1, 5.0), ("B", 5.0, 7.0)]


def test_send_time_and_overhead_occupy_the_rank():
    sim = simulate("gpipe", 2, 1, forward=1, backward=2, send_time=0.2, overhead=0.1)
    # by hand: rank 0 F 0.1-1.1, SEND_F 1.2-1.4 (arrives 1.2); rank 1 RECV 0.1-1.2,
    # F 1.3-2.3, B 2.4-4.4, SEND_B 4.5-4.7 (arrives 4.5); rank 0 RECV_B 1.5-4.5, B 4.6-6.6
    got = [(e.kind, round(e.start, 6), round(e.end, 6)) for e in sim.timeline[0]]
    assert got == [("F", 0.1, 1.1), ("SEND_F", 1.2, 1.4), ("RECV_B", 1.5, 4.5), ("B", 4.6, 6.6)]
    assert sim.makespan == pytest.approx(6.6)


def test_per_stage_costs():
    sim = simulate("gpipe", 2, 2, forward=[1, 3], backward=[1, 3])
    # stage 1 is the bottleneck: its 4 actions of 3 each plus stage 0's first F and last B
    assert sim.makespan == pytest.approx(1 + 12 + 1)


def test_unequal_stages_are_not_the_closed_form():
    # by hand: rank 0 F 0-1, 1-2; rank 1 F 1-3, 3-5, B 5-9, 9-13; rank 0 B 9-11, 13-15.
    # Busy 6 + 12 of 2 x 15: bubble 12/30, where (p-1)/(m+p-1) says 1/3
    sim = simulate("gpipe", 2, 2, forward=[1, 2], backward=[2, 4])
    assert sim.makespan == pytest.approx(15.0)
    assert sim.bubble_fraction == pytest.approx(0.4)
    assert sim.bubble_fraction != pytest.approx(float(gpipe_bubble(2, 2)))
    assert [(e.kind, e.start, e.end) for e in sim.timeline[0] if e.kind == "B"] == \
        [("B", 9.0, 11.0), ("B", 13.0, 15.0)]


def _link(**kw):
    from needle.distributed.calibrate import Link

    return Link(**kw)


def test_a_link_charges_flight_and_send_where_they_happen():
    # alpha 0.5 from send start to a waiting receiver; a send occupies its rank 0.25; a
    # receive whose message is there costs 0.1. By hand (gpipe, p = m = 2, F = 1, B = 2):
    # rank 0: F 0-1, SEND 1-1.25 (lands 1.5), F 1.25-2.25, SEND 2.25-2.5 (lands 2.75)
    # rank 1: RECV 0-1.5, F 1.5-2.5, RECV 2.5-2.75 (waits), F 2.75-3.75, B 3.75-5.75,
    #         SEND_B 5.75-6 (lands 6.25), B 6-8, SEND_B 8-8.25 (lands 8.5)
    # rank 0: RECV_B 2.5-6.25, B 6.25-8.25, RECV_B 8.25-8.5, B 8.5-10.5
    link = _link(alpha=0.5, send_fixed=0.25, recv_fixed=0.1)
    sim = simulate("gpipe", 2, 2, forward=1, backward=2, link=link, message_bytes=100)
    assert sim.makespan == pytest.approx(10.5)  # without the send cost: 10.2
    assert sim.bubble_fraction == pytest.approx(9 / 21)
    sends = [(e.start, e.end) for e in sim.timeline[0] if e.kind == "SEND_F"]
    assert sends == [(1.0, 1.25), (2.25, 2.5)]


def test_a_receive_whose_message_is_there_still_costs_its_rank():
    # as above with F = [1, 2], B = 2: rank 1 reaches RECV_F1.1 at 3.5, its message landed
    # at 2.75: the receive costs 0.1 (3.5-3.6), and everything after it moves by 0.1:
    # F 3.6-5.6, B 5.6-7.6, SEND_B 7.6-7.85 (lands 8.1), B 7.85-9.85, SEND_B (lands 10.35);
    # rank 0: RECV_B until 8.1, B 8.1-10.1, RECV_B 10.1-10.35, B 10.35-12.35
    link = _link(alpha=0.5, send_fixed=0.25, recv_fixed=0.1)
    sim = simulate("gpipe", 2, 2, forward=[1, 2], backward=2, link=link)
    recv = [(e.start, e.end) for e in sim.timeline[1] if e.kind == "RECV_F"]
    assert recv[1] == pytest.approx((3.5, 3.6))
    assert sim.makespan == pytest.approx(12.35)  # without the receive cost: 12.25


def test_bytes_grow_every_message_cost():
    link = _link(alpha=0.5, beta=0.01, send_per_byte=0.001, recv_per_byte=0.001)
    small = simulate("gpipe", 2, 1, forward=1, backward=2, link=link, message_bytes=0)
    big = simulate("gpipe", 2, 1, forward=1, backward=2, link=link, message_bytes=100)
    # each of the two hops: +1 flight (0.01 x 100) on the critical path
    assert small.makespan == pytest.approx(7.0) and big.makespan == pytest.approx(9.0)


def test_a_long_wait_wakes_late():
    # rank 1 waits 1.5 for its activation, rank 0 waits 4 for the adjoint: both past spin
    # 1.0, both end wake 0.3 after the message landed: 1.8, then B on rank 0 from 5.6
    sim = simulate("gpipe", 2, 1, forward=1, backward=2, link=_link(alpha=0.5, wake=0.3,
                                                                   spin=1.0))
    assert sim.makespan == pytest.approx(7.6)
    short = simulate("gpipe", 2, 1, forward=1, backward=2,
                     link=_link(alpha=0.5, wake=0.3, spin=10.0))
    assert short.makespan == pytest.approx(7.0)


def test_samples_give_means_and_noisy_draws_cost_more():
    from needle.distributed.pipeline.simulator import expected

    same = simulate("1f1b", 2, 4, forward=[[1, 3], [2]], backward=[[4], [2, 6]])
    assert same.makespan == simulate("1f1b", 2, 4, forward=[2, 2], backward=[4, 4]).makespan
    flat = expected("1f1b", 2, 4, draws=5, forward=[[2, 2], [2]], backward=4)
    assert flat.makespan == pytest.approx(same.makespan)
    noisy = expected("1f1b", 2, 4, draws=200, forward=[[1, 3], [2]], backward=[[4], [2, 6]])
    assert noisy.makespan > same.makespan and noisy.costs["draws"] == 200
    # a random draw is repeatable
    assert simulate("gpipe", 2, 2, forward=[[1, 5], [1, 5]], seed=3).makespan == \
        simulate("gpipe", 2, 2, forward=[[1, 5], [1, 5]], seed=3).makespan


def _sweep():
    for p in range(1, 6):
        for m in range(1, 13):
            for name in ("gpipe", "1f1b", "zero-bubble"):
                yield name, p, m, None
            for v in (2, 3):
                if m % p == 0:
                    yield "interleaved", p, m, v


def test_every_plan_is_valid_and_deadlock_free():
    count = 0
    for name, p, m, v in _sweep():
        plan = make_plan(name, p, m, virtual_stages=v)
        validate_plan(plan)
        sim = simulate(plan)  # raises on a deadlock
        assert sum(len(row) for row in sim.timeline) == sum(len(a) for a in plan.actions)
        count += 1
    assert count > 200


def test_a_deadlocking_plan_is_named():
    # both ranks wait for the other's activation before sending their own
    bad = Plan("custom", 2, 2, 1, False, (
        (Action("RECV_B", 0, 0), Action("F", 0, 0), Action("SEND_F", 0, 0), Action("B", 0, 0)),
        (Action("RECV_F", 1, 0), Action("F", 1, 0), Action("B", 1, 0), Action("SEND_B", 1, 0))))
    with pytest.raises(ScheduleError, match="deadlocks.*rank 0 at RECV_B0.0.*rank 1 at RECV_F1.0"):
        simulate(bad)


def test_validate_plan_rejects_malformed_plans():
    good = make_plan("gpipe", 2, 2)
    missing = Plan("gpipe", 2, 2, 2, False, (good.actions[0][:-1], good.actions[1]))
    with pytest.raises(ScheduleError, match="B0.1 is missing"):
        validate_plan(missing)
    swapped = Plan("gpipe", 2, 2, 2, False, (good.actions[1], good.actions[0]))
    with pytest.raises(ScheduleError, match="rank 0 holds"):
        validate_plan(swapped)


@pytest.mark.parametrize("call,match", [
    (lambda: make_plan("pipedream", 2, 2), "unknown schedule"),
    (lambda: make_plan("1f1b", 2, 0), "microbatches must be a positive integer"),
    (lambda: make_plan("interleaved", 4, 6, virtual_stages=2), "multiple of 4"),
    (lambda: make_plan("gpipe", 2, 2, virtual_stages=2), "needs the interleaved"),
    (lambda: simulate("gpipe", 2, 2, forward=[1, 2, 3]), "one per stage"),
    (lambda: simulate("gpipe", 2, 2, comm=-1), "comm must be"),
    (lambda: min_microbatches("gpipe", 4, 1.5), "target must be in"),
])
def test_bad_arguments_raise_schedule_errors(call, match):
    with pytest.raises(ScheduleError, match=match):
        call()


def test_balance_minimises_the_largest_stage():
    assert balance([4, 1, 1, 4, 2], 2) == [0, 3, 5]
    assert balance([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balance([10, 1, 1, 1], 2) == [0, 1, 4]
    assert balance([5], 1) == [0, 1]


def test_text_timeline_and_plot(tmp_path):
    sim = simulate("gpipe", 2, 2, forward=1, backward=1)
    text = sim.text()
    assert "stage 0  FF..BB" in text and "stage 1  .FFBB." in text
    assert "bubble 0.3333" in text
    path = sim.plot(str(tmp_path / "t.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_command_line_simulate_and_plot(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, MPLBACKEND="Agg")
    png = tmp_path / "gpipe.png"
    out = subprocess.run([sys.executable, "-m", "needle.distributed.pipeline", "simulate",
                          "--schedule", "gpipe", "--stages", "4", "--microbatches", "8",
                          "--plot", str(png)], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "bubble 0.2727" in out.stdout and out.stdout.count("\nstage ") == 4
    assert png.stat().st_size > 5000
    out = subprocess.run([sys.executable, "-m", "needle.distributed.pipeline", "simulate",
                          "--schedule", "gpipe", "--stages", "4", "--target-bubble", "0.1"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "at 28 micro-batches" in out.stdout
    out = subprocess.run([sys.executable, "-m", "needle.distributed.pipeline", "simulate",
                          "--schedule", "nope"], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "unknown schedule" in out.stderr


def test_an_adjoint_posted_inside_b_counts_as_compute():
    # the runtime's B sends its adjoint: as the first link test, but rank 1's B take 2.25
    # (3.75-6, 6-8.25) and SEND_B nothing; the adjoint still leaves 0.25 before B's end
    # (lands 6.25, 8.5): the same makespan, busy 6 + 6.5 of 21, bubble 8.5/21
    link = _link(alpha=0.5, send_fixed=0.25, recv_fixed=0.1)
    sim = simulate("gpipe", 2, 2, forward=1, backward=2, link=link, adjoint_in_backward=True)
    assert sim.makespan == pytest.approx(10.5)
    assert sim.bubble_fraction == pytest.approx(8.5 / 21)
    assert [(e.kind, e.start, e.end) for e in sim.timeline[1][4:6]] == \
        [("B", 3.75, 6.0), ("SEND_B", 6.0, 6.0)]
