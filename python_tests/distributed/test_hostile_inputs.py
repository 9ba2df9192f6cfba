"""Hostile or mistaken inputs to the distributed layer: each gets a clear error or the right
result, never a hang or a wrong answer."""
from __future__ import annotations

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
    """The header of a message arrives, its payload 3 s later: the first recv (1 s) times out
    waiting for the payload, the retry gets the whole message instead of waiting for a header
    that never comes."""
    out = launch(2, "tcp", "recv_retry.py")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "[rank 1] FIRST PeerError" in text and "payload receive" in text, text[-3000:]
    assert "[rank 1] SECOND [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in text, text[-3000:]
