"""The parameter server on real processes through the launcher: sync equals DDP (tcp, mpi),
a SIGKILLed worker is declared dead and training finishes without it (every mode), a
restarted worker rejoins, a dead server is a CommError naming it on every worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .test_multiprocess import ROOT, SCRIPTS, launch

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _stats(out) -> dict:
    line = next(line for line in out.stdout.splitlines() if "PS STATS " in line)
    return json.loads(line.split("PS STATS ", 1)[1])


@pytest.mark.parametrize("backend", ["tcp", "mpi"])
def test_sync_equals_ddp(backend):
    out = launch(3, backend, "check_ps.py", "sync_ddp", timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    for rank in range(3):
        assert f"[rank {rank}] PS OK sync_ddp rank {rank} of 3 on {backend}" in out.stdout


@pytest.mark.parametrize("mode, updates", [("sync", 6), ("backup", None), ("async", 14),
                                           ("ssp", 14)])
def test_sigkilled_worker_is_lost_and_training_finishes(mode, updates):
    out = launch(4, "tcp", "check_ps.py", "kill", mode, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    stats = _stats(out)
    assert stats["workers_lost"] == 1 and stats["workers_rejoined"] == 0
    assert stats["worker_clocks"] == [6, 2, 6]  # rank 2 died before its third push
    if mode == "backup":  # rounds of at most k = 2 gradients; once one worker has finished
        # (it may lead by several clocks) the other's rounds hold one. Which gradients arrive
        # late is up to the scheduler, so count: 14 pushes = accepted + dropped, and every
        # round applied at least one and at most k of them.
        accepted = 14 - stats["gradients_dropped"]
        assert stats["updates_applied"] <= accepted <= 2 * stats["updates_applied"]
        assert stats["staleness_histogram"] == {"0": accepted}
    else:
        assert stats["updates_applied"] == updates
        assert stats["gradients_dropped"] == 0
    if mode == "ssp":  # s = 1: no pull let a worker run more than one clock ahead
        assert stats["max_staleness"] <= 1 and stats["max_lead"] <= 1
    if mode in ("sync", "backup"):
        assert stats["max_staleness"] == 0
    assert "worker rank 2 declared dead" in stats["events"][0]
    assert "launch: rank 2 was lost (signal: SIGKILL)" in out.stderr
    for rank in (1, 3):
        assert f"[rank {rank}] WORKER DONE rank {rank} clock 6" in out.stdout


def test_restarted_worker_rejoins(tmp_path):
    flag = tmp_path / "rejoined"
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", "4", "--backend", "tcp",
           "--timeout", "120", "--restart-workers", "1", str(SCRIPTS / "check_ps.py"),
           "restart"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT,
                         env={**os.environ, "CHECK_PS_FLAG": str(flag)})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "launch: rank 2 killed by signal 9 (SIGKILL); restarting it" in out.stderr
    # the others wait at step 4 for it, so it rejoins at the server's version 3
    assert "[rank 2] REJOINED at clock 3" in out.stdout
    stats = _stats(out)
    assert stats["workers_lost"] == 1 and stats["workers_rejoined"] == 1
    assert stats["worker_clocks"] == [6, 6, 6]
    assert stats["updates_applied"] == 6
    for rank in (1, 2, 3):
        assert f"[rank {rank}] WORKER DONE rank {rank} clock 6" in out.stdout


def test_dead_server_is_a_comm_error_on_every_worker():
    out = launch(4, "tcp", "check_ps.py", "dead_server", timeout=120)
    assert out.returncode == 137, out.stdout[-4000:] + out.stderr[-2000:]
    assert "launch: rank 1 failed first: killed by signal 9 (SIGKILL)" in out.stderr
    for rank in (2, 3):
        assert (f"[rank {rank}] WORKER CAUGHT PeerError: ParameterServer.pull: worker rank "
                f"{rank}: parameter server 1 (rank 1) is gone") in out.stdout or (
                f"[rank {rank}] WORKER CAUGHT PeerError: ParameterServer.push: worker rank "
                f"{rank}: parameter server 1 (rank 1) is gone") in out.stdout, out.stdout


def test_restarted_server_resumes_from_its_snapshot(tmp_path):
    """The server snapshots every 2 updates and is SIGKILLed at update 5; the launcher restarts
    it, it resumes from update 4, the workers wait for it and redo steps 5.. from the restored
    clock, and the final weights equal 8 plain sync steps computed in one process."""
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", "3", "--backend", "tcp",
           "--timeout", "120", "--restart-workers", "1", str(SCRIPTS / "check_ps.py"),
           "server_restart"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT,
                         env={**os.environ, "CHECK_PS_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "launch: rank 0 killed by signal 9 (SIGKILL); restarting it" in out.stderr
    stats = _stats(out)
    assert stats["restored_from"] == str(tmp_path / "ps_server0.ndl")
    assert stats["version"] == 8 and stats["worker_clocks"] == [8, 8]
    assert stats["snapshots_written"] == 2  # at updates 6 and 8, after the restore at 4
    for rank in (1, 2):
        line = next(x for x in out.stdout.splitlines() if f"[rank {rank}] WORKER RESUMED" in x)
        assert line.endswith("restarts 1")
        clocks = [int(c) for c in line.split("clocks [")[1].split("]")[0].split(",")]
        assert clocks[:5] == [0, 1, 2, 3, 4] and clocks[-4:] == [4, 5, 6, 7]
