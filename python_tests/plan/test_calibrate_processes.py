"""``python -m needle.plan calibrate`` on two real processes writes a calibration the plan reads."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from needle.plan.calibration import load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_calibrate_then_plan_with_it(tmp_path, backend):
    path = str(tmp_path / "cal.json")
    out = subprocess.run([sys.executable, "-m", "needle.plan", "calibrate", "--out", path,
                          "--backend", backend, "--repeats", "3", "--layers", "16x32,32x4",
                          "--timeout", "240"], capture_output=True, text=True, timeout=270,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "alpha" in out.stdout and f"wrote {path}" in out.stdout
    cal = load(path)
    assert cal.device.flops > 0 and cal.device.op_time >= 0 and cal.machine["cores"] >= 1
    assert len(cal.noise.flight) > 0 and len(cal.noise.compute) > 0
    assert cal.reference["ranks"] == 2 and cal.reference["model"].startswith("MLP 16x32")
    # the profiled data-parallel step: its 4 tensors cost the training thread some time
    sync = cal.reference["sync"]
    assert sync["tensors"] == 4 and sync["B_sync"] > 0 and sync["all_reduce"] > 0
    assert cal.as_dict()["device"]["sync_tensor_time"] >= 0
    plan = subprocess.run([sys.executable, "-m", "needle.plan", "--calibration", path,
                           "--layers", "16x32,32x4", "--dp", "2", "--batch", "32",
                           "--precision", "fp32", "--draws", "10"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    assert "(mean of 10 noisy draws)" in plan.stdout
