"""``--backend nccl`` through the launcher, in real processes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]


def _gpu() -> bool:
    from needle.backend_ndarray._cuda import runtime

    return runtime.available()


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_launcher_starts_nccl_ranks_over_tcp_and_each_names_the_refusal():
    if _gpu():
        pytest.skip("a GPU is present: the ranks would join, not refuse")
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", "2", "--backend", "nccl",
           "--timeout", "60", str(SCRIPTS / "nccl_refusal.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    lines = [line.split("REFUSED ", 1)[1] for line in out.stdout.splitlines()
             if "REFUSED " in line]
    assert len(lines) == 2, out.stdout
    for line in lines:
        got = json.loads(line)
        assert got["NEEDLE_DIST_BACKEND"] == "nccl" and got["NEEDLE_DIST_NCCL_HOST"] == "tcp"
        assert "backend 'nccl' needs CuPy with NCCL and a GPU, got none on any rank" in \
            got["error"]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_run_the_nccl_checks_on_the_emulator():
    """launch --backend nccl: two ranks, each a process with cuda() on the CUDA emulator and
    the fake NCCL exchanging the bytes over the host transport."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("g++ not found: no CUDA emulator")
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", "2", "--backend", "nccl",
           "--timeout", "200", str(SCRIPTS / "check_nccl_emulated.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    for rank in range(2):
        assert f"[rank {rank}] NCCL OK rank {rank} of 2 on nccl (emulated)" in out.stdout
