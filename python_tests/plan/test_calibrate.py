"""The α-β link model: the fit, collective times, the probe (threads: it runs, it times out)."""
from __future__ import annotations

import time

import numpy as np
import pytest

import needle.distributed as dist
from needle.distributed import CommError
from needle.distributed.calibrate import (
    Link,
    collective_rounds,
    collective_time,
    fit_alpha_beta,
    probe_link,
)
from needle.plan.calibration import Calibration, load, probe_table
from needle.plan.model import Device, Noise


def test_the_fit_recovers_alpha_and_beta_from_synthetic_timings():
    alpha, beta = 40e-6, 0.25e-9  # 40 us, 4 GB/s
    sizes = [0, 1_000, 16_000, 262_144, 1_000_000, 4_000_000]
    wobble = [1.01, 0.99, 1.02, 0.98, 1.005, 0.995]  # +-2%, not centred on the line
    times = [(alpha + beta * n) * w for n, w in zip(sizes, wobble, strict=True)]
    a, b = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(alpha, rel=0.05) and b == pytest.approx(beta, rel=0.02)
    exact = fit_alpha_beta([0, 10, 20], [3.0, 5.0, 7.0])
    assert exact == pytest.approx((3.0, 0.2))


def test_the_fit_needs_two_sizes_and_never_goes_negative():
    with pytest.raises(CommError):
        fit_alpha_beta([8, 8], [1.0, 2.0])
    assert fit_alpha_beta([0, 10], [2.0, 1.0]) == (1.5, 0.0)  # falling: all latency
    a, b = fit_alpha_beta([10, 20], [1.0, 3.0])  # would cross zero: through the origin
    assert a == 0.0 and b > 0


def test_collective_times_follow_the_ring_rounds():
    link = Link(alpha=1e-5, beta=1e-9)
    assert collective_rounds("all_reduce", 4) == 7  # 2(n-1) + the call check
    assert collective_time("all_reduce", 4e6, 4, link) == pytest.approx(7e-5 + 6e6 * 1e-9)
    assert collective_time("reduce_scatter", 4e6, 4, link) == pytest.approx(4e-5 + 3e6 * 1e-9)
    assert collective_time("send", 100, 2, link) == pytest.approx(1e-5 + 1e-7)
    assert collective_time("all_reduce", 4e6, 1, link) == 0.0
    with pytest.raises(CommError):
        collective_time("all_to_all", 1, 2, link)


def test_a_link_refuses_negative_costs_and_waits_past_spin():
    with pytest.raises(CommError):
        Link(alpha=-1.0)
    link = Link(wake=0.3, spin=1.0)
    assert link.wake_time(0.5) == 0.0 and link.wake_time(1.5) == 0.3
    assert Link.from_dict(link.as_dict()) == link


def test_the_probe_fits_a_link_between_two_ranks():
    def job(rank):
        got = probe_link(sizes=(0, 4096, 65536), repeats=3, timeout=30)
        return None if got is None else (got.link, probe_table(got.as_dict(), got.link),
                                         got.residuals())

    first, second = dist.spawn_threads(job, 2, timeout=120)
    link, text, residuals = first
    assert second is None and isinstance(link, Link)
    assert all(v >= 0 for v in link.as_dict().values())
    assert "alpha" in text and len(residuals["flight"]) == 9


def test_the_probe_times_out_instead_of_hanging():
    def job(rank):
        if rank == 0:
            return probe_link(repeats=2, timeout=1.0)
        return None  # rank 1 never joins

    start = time.monotonic()
    with pytest.raises(CommError):
        dist.spawn_threads(job, 2, timeout=30)
    assert time.monotonic() - start < 20


def test_a_calibration_file_round_trips(tmp_path):
    cal = Calibration(Link(alpha=1e-4, beta=2e-10, wake=3e-3), Device(flops=5e10, cores=2),
                      Noise(compute=[1.0, 1.5], flight=[0.0, 1e-4]), {"cpu": "x"})
    again = load(cal.save(str(tmp_path / "c.json")))
    assert again.link == cal.link and again.device == cal.device
    assert again.noise.compute == [1.0, 1.5] and again.noise.compute_mean() == 1.25
    assert np.isclose(again.link.beta, 2e-10)
