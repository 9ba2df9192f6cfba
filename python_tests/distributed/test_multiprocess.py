"""Real processes through the launcher (mpi via mpiexec, tcp via pyzmq), always with timeouts."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from needle.distributed.launch import find_mpiexec

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(180)]


def launch(n: int, backend: str, script: str, *args: str, timeout: float = 60.0
           ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", str(n), "--backend", backend,
           "--timeout", str(timeout), str(SCRIPTS / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30, cwd=ROOT)


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_every_collective_and_p2p(backend: str, n: int) -> None:
    out = launch(n, backend, "check_collectives.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for rank in range(n):
        assert f"[rank {rank}] ALL OK rank {rank} of {n} on {backend}" in out.stdout


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_ddp_matches_single_process(backend: str) -> None:
    out = launch(2, backend, "check_ddp.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for rank in range(2):
        assert f"[rank {rank}] DDP OK rank {rank} of 2 on {backend}" in out.stdout


@pytest.mark.parametrize("backend,mode", [("mpi", "clean"), ("tcp", "clean"), ("tcp", "crash")])
def test_rank_exiting_early_gives_comm_error(backend: str, mode: str) -> None:
    start = time.monotonic()
    out = launch(2, backend, "early_exit.py", "3", mode)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "[rank 0] CommError after" in out.stdout and "rank 1" in out.stdout
    assert time.monotonic() - start < 40  # 3 s comm timeout, not the 60 s job timeout


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_launcher_stops_job_and_names_failed_rank(backend: str) -> None:
    start = time.monotonic()
    out = launch(2, backend, "fail_or_hang.py", "fail")
    assert out.returncode == 3
    assert "rank 1 failed with exit code 3" in out.stderr
    assert time.monotonic() - start < 40  # rank 0 sleeps 60 s unless stopped


def test_launcher_timeout_stops_hung_job() -> None:
    out = launch(2, "tcp", "fail_or_hang.py", "hang", timeout=3)
    assert out.returncode == 124
    assert "timed out after 3 s" in out.stderr


def test_plain_mpiexec_runs_a_script() -> None:
    cmd = [find_mpiexec(), "-n", "2", sys.executable, str(SCRIPTS / "check_collectives.py")]
    env = dict(os.environ)
    env.pop("NEEDLE_DIST_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert out.stdout.count("ALL OK") == 2
