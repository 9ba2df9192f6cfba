"""The call check: ranks that issue different collectives fail at once, before any data
moves, with both calls named (op, dtype, shape, group, sequence number, source line)."""
from __future__ import annotations

import numpy as np
import pytest

import needle.distributed as dist

from .test_multiprocess import launch


def test_a_mismatch_names_both_calls_and_their_lines_on_threads() -> None:
    def job(rank: int) -> str:
        x = np.zeros(3 + rank, np.float32)
        try:
            dist.all_reduce(x, timeout=30)  # the line both errors name
        except dist.CommError as exc:
            return str(exc)
        return "no error"

    line = job.__code__.co_firstlineno + 3
    for rank, text in enumerate(dist.spawn_threads(job, 2)):
        me, other = (f"float32 ({3 + r},) op=sum algorithm=ring group=[0,1]" for r in
                     (rank, 1 - rank))
        assert text == (
            f"all_reduce: ranks called different collectives, expected 'all_reduce {me}' "
            f"(rank {rank}, collective 1 at test_call_check.py:{line}), got 'all_reduce {other}' "
            f"(rank {1 - rank}, collective 1 at test_call_check.py:{line})"), text


def test_equal_calls_from_different_lines_pass() -> None:
    def job(rank: int) -> list:
        x = np.ones(2, np.float32)
        if rank == 0:
            dist.all_reduce(x)
        else:
            dist.all_reduce(x)
        return x.tolist()

    assert dist.spawn_threads(job, 2) == [[2.0, 2.0], [2.0, 2.0]]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
@pytest.mark.parametrize("mode", ["shape", "op"])
def test_a_mismatch_fails_the_job_at_once_naming_both_lines(backend: str, mode: str) -> None:
    # the group's timeout is 120 s and the job's 100 s: only the call check can end it
    out = launch(2, backend, "mismatch.py", mode, timeout=100)
    text = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 1, text
    headline = next(x for x in out.stderr.splitlines() if x.startswith("launch: rank"))
    assert "ranks called different collectives" in headline, text
    zero = ("'all_reduce float32 (4,) op=sum algorithm=ring group=[0,1]'" if mode == "shape"
            else "'broadcast float32 (8,) src=0 group=[0,1]'")
    one = "'all_reduce float32 (8,) op=sum algorithm=ring group=[0,1]'"
    line0 = "mismatch.py:21" if mode == "shape" else "mismatch.py:23"
    assert f"{zero} (rank 0, collective 2 at {line0})" in headline, text
    assert f"{one} (rank 1, collective 2 at mismatch.py:25)" in headline, text
    assert "no mismatch found" not in out.stdout, text
