"""The wait-for graph: a timeout names a deadlock's cycle, or the rank that never arrived and
where it was, on real processes (mpi, tcp) and as a pure function of the wait records."""
from __future__ import annotations

import pytest

from needle.distributed._waits import explain, follow

from .test_multiprocess import launch


def _hop(r: int, peer: int, op: str = "recv") -> dict:
    return {"op": op, "peer": peer, "site": f"a.py:{10 + r}"}


def test_a_cycle_is_printed_once_from_its_smallest_rank() -> None:
    records = {2: _hop(2, 0), 0: _hop(0, 1), 1: _hop(1, 2), 3: _hop(3, 1)}
    assert follow(records, 3) == [3, 1, 2, 0, 1]
    assert explain(records) == ["deadlock: rank 0 recv from 1 (a.py:10) → rank 1 recv from 2 "
                                "(a.py:11) → rank 2 recv from 0 (a.py:12) → rank 0"]


def test_a_chain_ends_at_the_rank_that_never_arrived() -> None:
    records = {0: _hop(0, 1), 1: _hop(1, 2, "all_reduce"), 3: _hop(3, 2)}
    assert explain(records, {2: "b.py:7"}) == [
        "rank 2 never arrived (it was at b.py:7): rank 0 recv from 1 (a.py:10) → rank 1 "
        "all_reduce from 2 (a.py:11) → rank 2"]
    assert explain({}) == []


def _launch_lines(backend: str, mode: str) -> tuple[int, list[str], str]:
    out = launch(3, backend, "wait_cycle.py", mode, timeout=120)
    lines = [x for x in out.stderr.splitlines() if x.startswith("launch: ")]
    return out.returncode, lines, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_a_receive_cycle_is_reported_as_a_deadlock(backend: str) -> None:
    code, lines, text = _launch_lines(backend, "cycle")
    assert code == 1, text
    site = "wait_cycle.py:27"
    assert lines[0] == (f"launch: deadlock: rank 0 recv from 1 ({site}) → rank 1 recv from 2 "
                        f"({site}) → rank 2 recv from 0 ({site}) → rank 0"), text
    assert not any("never arrived" in x for x in lines), text
    # every rank arrived, and each one's own error names the cycle too
    assert all("is stuck in a deadlock" in x for x in lines[1:] if "failed because" in x), text


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_a_rank_that_never_arrived_is_named_with_where_it_was(backend: str) -> None:
    code, lines, text = _launch_lines(backend, "absent")
    assert code == 1, text
    assert lines[0] == ("launch: rank 2 never arrived (it was at wait_cycle.py:24): rank 0 recv "
                        "from 1 (wait_cycle.py:27) → rank 1 recv from 2 (wait_cycle.py:27) → "
                        "rank 2"), text


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_collective_waiting_on_a_receive_is_a_deadlock() -> None:
    code, lines, text = _launch_lines("tcp", "collective")
    assert code == 1, text
    assert lines[0] == ("launch: deadlock: rank 0 all_reduce from 2 (wait_cycle.py:26) → rank 2 "
                        "recv from 0 (wait_cycle.py:27) → rank 0"), text
