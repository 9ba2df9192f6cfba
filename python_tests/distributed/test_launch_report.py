"""The launcher's decisions as units: how each rank ended, whom to blame, which exit code."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from needle.distributed._launch_job import Job
from needle.distributed._launch_report import Outcome, outcome_from_records, read_record, verdict
from needle.distributed._run_rank import rank_environment, write_record


def test_every_rank_ok_is_exit_code_zero() -> None:
    assert verdict({0: Outcome(0, "ok", 0, 1.0), 1: Outcome(1, "ok", 0, 2.0)}) == (0, [])


def test_a_rank_that_ended_without_reporting_fails_the_job() -> None:
    """os._exit(0) under mpiexec: the process ended with 0, yet the script never finished."""
    vanished = outcome_from_records(1, None, {"code": 0, "time": 5.0})
    assert (vanished.kind, vanished.code) == ("vanished", 1)
    code, lines = verdict({0: Outcome(0, "vanished", 1, 5.2, "its supervisor was killed"),
                           1: vanished})
    assert code == 1
    assert lines[0].startswith("launch: rank 1 failed first: ended without reporting")
    assert lines[1] == ("launch: rank 0 ended without reporting after rank 1 failed "
                        "(mpiexec stops the other ranks)")


def test_a_signal_gives_128_plus_its_number() -> None:
    killed = outcome_from_records(1, None, {"signal": 9, "code": 137, "time": 3.0})
    assert verdict({0: Outcome(0, "ok", 0, 9.0), 1: killed}) == (
        137, ["launch: rank 1 failed first: killed by signal 9 (SIGKILL)"])


def test_own_failure_is_blamed_before_an_earlier_peer_failure() -> None:
    """Rank 0 reported 'peer rank 1 is gone' first, but rank 1 raised: rank 1 is the cause."""
    peer = Outcome(0, "peer", 1, 1.0, "PeerError: rank 1 is gone", peer=1, reason="gone")
    own = Outcome(1, "exception", 1, 2.0, "ValueError: boom", traceback="Traceback...\n  x\n")
    code, lines = verdict({0: peer, 1: own})
    assert code == 1
    assert lines[:4] == ["launch: rank 1 failed first: raised ValueError: boom",
                         "launch: traceback of rank 1:", "    Traceback...", "      x"]
    assert lines[4] == "launch: rank 0 failed because peer rank 1 is gone: PeerError: rank 1 " \
                       "is gone"


def test_earliest_own_failure_wins_and_stopped_ranks_never_headline() -> None:
    outcomes = {0: Outcome(0, "exit", 4, 7.0), 1: Outcome(1, "exit", 3, 6.0),
                2: Outcome(2, "stopped", 143, 1.0, "was stopped by the launcher (SIGTERM)")}
    code, lines = verdict(outcomes)
    assert (code, lines[0]) == (3, "launch: rank 1 failed first: exited with code 3")
    assert "launch: rank 0 also failed: exited with code 4" in lines
    assert "launch: rank 2 was stopped by the launcher (SIGTERM)" in lines


def test_only_peer_failures_name_the_peer() -> None:
    """Rank 2 hung and was stopped; the others timed out: the headline names rank 2."""
    outcomes = {r: Outcome(r, "peer", 1, float(r), f"PeerError: all_reduce from {r}", peer=2,
                           reason="timeout") for r in (0, 1)}
    outcomes[2] = Outcome(2, "stopped", 143, 9.0)
    code, lines = verdict(outcomes)
    assert code == 1
    assert lines[0] == ("launch: rank 0 failed because peer rank 2 never arrived: PeerError: "
                        "all_reduce from 0")


def test_records_are_written_atomically(tmp_path: Path, monkeypatch) -> None:
    """A reader never sees half a record (the launcher once read an empty status file as a
    failure): a write that dies midway leaves no record at all."""
    write_record(str(tmp_path), "rank0.json", {"kind": "exit", "code": 0})
    assert read_record(str(tmp_path), "rank0.json") == {"kind": "exit", "code": 0}

    import needle.serialization as serialization

    real_fsync = os.fsync

    def broken(fd):  # the bytes are half on disk when the disk fills
        os.write(fd, b'{"kind": "ex')
        real_fsync(fd)
        raise OSError("disk full")

    monkeypatch.setattr(serialization.os, "fsync", broken)
    write_record(str(tmp_path), "rank1.json", {"kind": "exit", "code": 0})
    monkeypatch.undo()
    assert not (tmp_path / "rank1.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json"]  # no temporary left
    (tmp_path / "rank2.json").write_text('{"kind": "ex')  # a torn file from elsewhere
    assert read_record(str(tmp_path), "rank2.json") is None


def test_job_notices_a_rank_whose_supervisor_vanished(tmp_path: Path) -> None:
    """A pid record whose process is gone, with no exit records: the rank vanished."""
    dead_pid = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_pid.wait()
    write_record(str(tmp_path), "rank0.pid", {"pid": dead_pid.pid})
    write_record(str(tmp_path), "rank1.json", {"kind": "exit", "code": 0, "time": 1.0})
    job = Job("mpi", [0, 1], str(tmp_path))
    job.poll()
    assert job.outcomes[0].kind == "vanished" and job.outcomes[1].kind == "ok"
    assert verdict(job.outcomes)[0] == 1


@pytest.mark.parametrize("env,want", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
      "RANK": "7", "WORLD_SIZE": "9"},  # mpiexec's own variables beat inherited ones
     {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
    ({}, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}),
])
def test_rank_environment(env: dict, want: dict) -> None:
    assert rank_environment(env) == want
