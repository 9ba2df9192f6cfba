"""The nccl backend on real GPUs: one rank per GPU (two where there are two or more, else a
one-rank group on the one GPU), through the launcher. Skipped without CuPy, NCCL and a GPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]


def _gpus() -> int:
    from needle.backend_ndarray._cuda import runtime

    if not runtime.available():
        return 0
    cupy = runtime.cupy_module()
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:  # noqa: BLE001 - a CuPy without NCCL raises various errors
        return 0
    return int(cupy.cuda.runtime.getDeviceCount())


def test_every_nccl_check_on_the_gpus():
    gpus = _gpus()
    if gpus == 0:
        pytest.skip("needs CuPy with NCCL and a GPU")
    n = min(gpus, 2)
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", str(n), "--backend", "nccl",
           "--timeout", "240", str(SCRIPTS / "check_nccl.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    for rank in range(n):
        assert f"[rank {rank}] NCCL OK rank {rank} of {n} on nccl" in out.stdout, out.stdout
