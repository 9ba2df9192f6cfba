"""Hostile or mistaken inputs to the distributed layer: each gets a clear error or the right
result, never a hang or a wrong answer."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]


def launch(n: int, backend: str, script: str, *args: str, timeout: float = 90.0
           ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", str(n), "--backend", backend,
           "--timeout", str(timeout), str(SCRIPTS / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, cwd=ROOT)


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_recv_retried_after_a_timeout_mid_message_completes() -> None:
    """The header of a message arrives, its payload 6 s later: the first recv (2 s) times out
    waiting for the payload, the retry gets the whole message instead of waiting for a header
    that never comes."""
    out = launch(2, "tcp", "recv_retry.py")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "[rank 1] FIRST PeerError" in text and "payload receive" in text, text[-3000:]
    assert "[rank 1] SECOND [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in text, text[-3000:]


# ---- clear errors instead of wrong or unclear behaviour -------------------------------------
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import needle.distributed as dist  # noqa: E402
from needle.distributed import CommError  # noqa: E402
from needle.distributed._errors import PeerError  # noqa: E402


def _tcp_env(monkeypatch, **values: str) -> None:
    from needle.distributed.launch import free_port

    base = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                WORLD_SIZE="1", NEEDLE_DIST_SECRET="0123456789abcdef0123")
    for name, value in {**base, **values}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("NEEDLE_DIST_AUTH", raising=False)


@pytest.mark.parametrize("value", ["0", "-4", "lots"])
def test_chunk_bytes_that_is_not_a_positive_integer_is_refused(monkeypatch, value) -> None:
    monkeypatch.setenv("NEEDLE_DIST_CHUNK_BYTES", value)
    with pytest.raises(CommError, match=rf"bad NEEDLE_DIST_CHUNK_BYTES, expected an integer "
                                        rf"number of bytes >= 1, got '{value}'"):
        dist.spawn_threads(lambda rank: dist.all_reduce(np.ones(4)), 2, timeout=10)


@pytest.mark.parametrize("rank, size", [(5, 2), (-1, 2), (0, 0)])
def test_rank_outside_the_world_is_refused_at_once(monkeypatch, rank, size) -> None:
    _tcp_env(monkeypatch, RANK=str(rank), WORLD_SIZE=str(size))
    start = time.monotonic()
    with pytest.raises(CommError, match=rf"expected WORLD_SIZE >= 1 and 0 <= RANK < "
                                        rf"WORLD_SIZE, got RANK={rank} WORLD_SIZE={size}"):
        dist.init_process_group("tcp", timeout=120)
    assert time.monotonic() - start < 60  # refused, not timed out (120 s)
    assert not dist.is_initialized()


def test_short_secret_is_refused(monkeypatch) -> None:
    _tcp_env(monkeypatch, NEEDLE_DIST_SECRET="x")
    with pytest.raises(CommError, match=r"NEEDLE_DIST_SECRET too short .* expected at least "
                                        r"16 characters .* got 1"):
        dist.init_process_group("tcp", timeout=30)
    assert not dist.is_initialized()


@pytest.mark.parametrize("timeout", [-5, 0, float("nan")])
def test_timeout_that_is_not_positive_is_refused(monkeypatch, timeout) -> None:
    _tcp_env(monkeypatch)
    with pytest.raises(CommError, match=r"init_process_group: bad timeout, expected a number "
                                        r"of seconds > 0"):
        dist.init_process_group("tcp", timeout=timeout)
    with pytest.raises(CommError, match=r"spawn_threads: bad timeout"):
        dist.spawn_threads(lambda rank: rank, 2, timeout=timeout)


@pytest.mark.parametrize("args, expected", [
    (["--timeout", "-5"], "bad --timeout, expected seconds > 0, got -5"),
    (["--backend", "tcp"], "NEEDLE_DIST_SECRET too short"),
])
def test_launcher_refuses_bad_timeout_and_short_secret(args, expected) -> None:
    import os

    env = dict(os.environ, NEEDLE_DIST_SECRET="x")
    out = subprocess.run([sys.executable, "-m", "needle.distributed.launch", "-n", "1", *args,
                          str(SCRIPTS / "env_report.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert expected in out.stderr, out.stderr


def test_spawn_threads_raises_the_root_cause_not_a_peer_error() -> None:
    """Rank 1 raises; rank 0 then fails in its all-reduce because of it (a PeerError, and
    rank 0 sorts first): the ValueError is what spawn_threads raises."""
    def job(rank: int) -> None:
        if rank == 1:
            raise ValueError("boom on rank 1")
        dist.all_reduce(np.ones(4), timeout=5)

    with pytest.raises(ValueError, match="boom on rank 1"):
        dist.spawn_threads(job, 2, timeout=30)


def test_spawn_threads_with_a_stuck_rank_names_it_and_the_root_cause() -> None:
    """Rank 1 raises, rank 2 is stuck outside needle: the error names rank 2 and carries
    rank 1's exception, once the timeout (+ 5 s) is over rather than after a wait per rank."""
    release = threading.Event()

    def job(rank: int) -> None:
        if rank == 1:
            raise ValueError("boom on rank 1")
        if rank == 2:
            release.wait(120)
            return
        dist.all_reduce(np.ones(4), timeout=2)

    try:
        with pytest.raises(CommError, match=r"ranks \[2\] still running .*rank 1 failed "
                                            r"first: ValueError: boom on rank 1") as info:
            dist.spawn_threads(job, 3, timeout=2)
        assert isinstance(info.value.__cause__, ValueError)
        assert not isinstance(info.value, PeerError)
    finally:
        release.set()


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failed_mpi_job_leaves_no_shared_memory_files(how: str) -> None:
    """MPICH removes its /dev/shm files only in a clean finalize; the launcher removes the
    ones this job's ranks mapped (the ranks print their names: other jobs' files, which
    may appear meanwhile, are not this test's business, nor the launcher's)."""
    out = launch(2, "mpi", "shm_leak.py", how, timeout=90)
    assert out.returncode != 0, out.stdout[-3000:] + out.stderr[-2000:]
    files = {f for line in out.stdout.splitlines() if "SHM" in line
             for f in line.split("SHM", 1)[1].split()}
    assert files, out.stdout[-3000:]
    left = sorted(f for f in files if os.path.exists(f))
    assert not left, (left, out.stderr[-2000:])


def test_a_receive_that_completes_as_it_is_cancelled_keeps_its_message():
    """A message can land between a receive's deadline and its cancel: cancel says so, and
    the message is the caller's (a withdrawn receive says it took nothing, and the next
    receive on the key gets the next message)."""
    from needle.distributed._transport import Mailbox

    box = Mailbox()
    late = box.post(np.zeros(2, np.float32), ("c", 1, 0))
    assert not late.wait(time.monotonic() + 0.01)  # the deadline passes
    box.deliver(("c", 1, 0), np.array([1.0, 2.0], np.float32))  # ... then the message lands
    assert late.cancel() is True and late.buf.tolist() == [1.0, 2.0]
    idle = box.post(np.zeros(2, np.float32), ("c", 1, 0))
    assert idle.cancel() is False  # withdrawn before anything came
    box.deliver(("c", 1, 0), np.array([3.0, 4.0], np.float32))
    nxt = box.post(np.zeros(2, np.float32), ("c", 1, 0))
    assert nxt.wait(time.monotonic() + 5) and nxt.buf.tolist() == [3.0, 4.0]
