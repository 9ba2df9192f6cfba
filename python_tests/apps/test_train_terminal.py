"""What apps/train.py tells a person at the terminal: saves, resumes, Ctrl-C."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TRAIN = str(ROOT / "apps" / "train.py")


def _train(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAIN, "--model", "mlp", "--no-progress", *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.timeout(600)
def test_saves_and_resumes_are_announced(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _train("--max-steps", "4", "--save-every", "2", "--checkpoint-dir", str(ckpt),
                   "--out", str(tmp_path / "a"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    saved = [line for line in first.stdout.splitlines() if line.startswith("saved")]
    assert saved == [f"saved checkpoint step 2 → {ckpt}/step-00000002",
                     f"saved checkpoint step 4 → {ckpt}/step-00000004"]
    more = _train("--max-steps", "6", "--resume", str(ckpt), "--out", str(tmp_path / "b"),
                  cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    assert f"resumed from {ckpt}/step-00000004 (4 of 6 steps done)" in more.stdout
    # a checkpoint already past the end: said, exit 0, nothing trained or written
    done = _train("--max-steps", "2", "--resume", str(ckpt), "--out", str(tmp_path / "c"),
                  cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith(
        f"{ckpt}/step-00000004 is at step 4; --max-steps 2 ends at step 2: nothing left to "
        "train")
    assert "held-out accuracy" not in done.stdout and not (tmp_path / "c").exists()


@pytest.mark.timeout(600)
def test_a_resume_at_an_epoch_end_does_not_print_that_epoch_again(tmp_path):
    ckpt = tmp_path / "ckpt"
    # 1,437 training examples in batches of 500: three steps an epoch, saved at its end
    common = ("--batch-size", "500", "--save-every", "3", "--checkpoint-dir", str(ckpt))
    first = _train("--epochs", "1", *common, "--out", str(tmp_path / "a"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert [ln for ln in first.stdout.splitlines() if ln.startswith("epoch")][0].startswith(
        "epoch   1")
    more = _train("--epochs", "2", *common, "--resume", str(ckpt), "--out",
                  str(tmp_path / "b"), cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    epochs = [ln.split()[1] for ln in more.stdout.splitlines() if ln.startswith("epoch")]
    assert epochs == ["2"], more.stdout


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_says_where_to_continue(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, TRAIN, "--nproc", "2", "--model", "mlp", "--epochs", "200",
         "--save-every", "2", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "out"),
         "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path, start_new_session=True,
        # tcp: the launcher itself stops the ranks (mpiexec may kill them before they speak)
        env=dict(os.environ, NEEDLE_DIST_BACKEND="tcp"))
    try:
        for _ in range(4800):  # a checkpoint on disk, whatever the machine's speed
            if list(ckpt.glob("step-*/manifest.json")) or proc.poll() is not None:
                break
            time.sleep(0.25)
        assert proc.poll() is None, "the run ended before it saved a checkpoint"
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    # rank 0 stops quietly (rank 1 may still print a traceback now and then: not asserted)
    assert "[rank 0] Traceback" not in out + err, out[-4000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("interrupted")]
    assert len(lines) == 1, err[-3000:]
    steps, newest = lines[0].split("; ")[:2]
    assert int(steps.split()[-1]) >= int(newest.split()[-1]) >= 2
    assert lines[0].endswith(f"; continue with --resume {ckpt}")
    assert (ckpt / f"step-{int(newest.split()[-1]):08d}" / "manifest.json").exists()


EPOCH_LINE = re.compile(r"^\[rank 0\] epoch +(\d+)  loss \d+\.\d{4}  train acc \d\.\d{4}  "
                        r"held-out acc \d\.\d{4}  [\d,]+ examples/s$")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [
    ("--strategy", "ps", "--nproc", "2", "--epochs", "2"),  # six steps: 3 an epoch
    ("--strategy", "3d", "--nproc", "2", "--tp", "2", "--epochs", "1", "--max-steps", "2")])
def test_every_strategy_prints_its_epochs(tmp_path, strategy):
    proc = _train("--batch-size", "500", *strategy, "--out", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    epochs = [m.group(1) for ln in proc.stdout.splitlines() if (m := EPOCH_LINE.match(ln))]
    assert epochs == (["1", "2"] if "ps" in strategy else ["1"]), proc.stdout[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_under_mpiexec_prints_the_one_line(tmp_path):
    """--backend mpi: the launcher passes Ctrl-C to the ranks, not to mpiexec; the ranks stop
    at a step boundary, quietly, and nothing of mpiexec's own reaction is shown."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, TRAIN, "--nproc", "2", "--model", "mlp", "--epochs", "200",
         "--save-every", "2", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "out"),
         "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path, start_new_session=True, env=dict(os.environ, NEEDLE_DIST_BACKEND="mpi"))
    before = []
    try:
        for line in proc.stdout:  # trained and saved: a line says so, whatever the speed
            before.append(line)
            if line.startswith("[rank 0] saved checkpoint step"):
                break
        assert proc.poll() is None, "".join(before) + proc.stderr.read()[-3000:]
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    said = err.splitlines()
    assert len(said) == 1, err[-3000:]
    steps, newest, cont = said[0].split("; ")
    assert steps.startswith("interrupted at step ") and newest.startswith("newest checkpoint")
    assert int(steps.split()[-1]) >= int(newest.split()[-1]) >= 2
    assert cont == f"continue with --resume {ckpt}"
    after = [ln for ln in out.splitlines() if ln]
    assert all(ln.startswith("[rank 0] saved checkpoint step ") for ln in after), out[-3000:]
