"""ZeroDataParallel on real processes (mpi and tcp): equal to DDP, and every rank's
model-state bytes measured by needle.memory equal to the ledger's, category by category."""
from __future__ import annotations

import re

import pytest

from .test_multiprocess import launch

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_every_stage_equals_ddp(backend: str, n: int) -> None:
    out = launch(n, backend, "check_zero.py", "equal", timeout=200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for rank in range(n):
        assert f"[rank {rank}] ZERO EQUAL OK rank {rank} of {n} on {backend}" in out.stdout


def _totals(stdout: str) -> dict[tuple[int, int], int]:
    found = re.findall(r"\[rank (\d)\] stage (\d) rank \d: .* total ([\d,]+) ", stdout)
    return {(int(r), int(s)): int(t.replace(",", "")) for r, s, t in found}


def test_one_million_parameters_mixed_on_four_ranks() -> None:
    """The ledger of the course texts: 7,000,000 / 5,500,000 / 4,000,000 bytes of model state
    per rank for stages 1 / 2 / 3, and the allocator measures exactly that on every rank."""
    out = launch(4, "mpi", "check_zero.py", "memory", "mixed", timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    totals = _totals(out.stdout)
    want = {1: 7_000_000, 2: 5_500_000, 3: 4_000_000}
    assert totals == {(r, s): want[s] for r in range(4) for s in (1, 2, 3)}
    for rank in range(4):
        assert f"[rank {rank}] ZERO MEMORY OK rank {rank} of 4 mixed" in out.stdout


def test_fp32_memory_on_two_ranks_over_tcp() -> None:
    out = launch(2, "tcp", "check_zero.py", "memory", "fp32", timeout=200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    totals = _totals(out.stdout)
    assert totals == {(r, s): t for r in range(2) for s, t in
                      ((1, 12_000_000), (2, 10_000_000), (3, 8_000_000))}
