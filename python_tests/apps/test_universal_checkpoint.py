"""A checkpoint saved by one strategy resumes under another (apps/training/universal.py).

``--model mlp`` has no BatchNorm and no dropout, so every strategy computes the same steps:
a run saved under A at step 3 and resumed under B to step 6 must continue exactly as B's own
run does (losses after the resume point within rtol 1e-5; ddp and zero sum gradients in the
same order, so their parameters are bitwise equal; the others differ from single by float
summation order, ~1e-7). What changes the math is refused, naming the difference.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "apps", "train.py")
COMMON = ("--model", "mlp", "--max-steps", "6", "--no-progress")
LAYOUTS = {"single": (), "ddp": ("--strategy", "ddp", "--nproc", "2"),
           "zero": ("--strategy", "zero", "--nproc", "2"),
           "tp": ("--strategy", "tp", "--nproc", "2"),
           "pipeline": ("--strategy", "pipeline", "--nproc", "2")}
BITWISE = {"ddp", "zero"}  # the same reduction order: bitwise-equal parameters


def _run(*args, timeout=240):
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _train(out, *args) -> dict:
    proc = _run(*COMMON, *args, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    import needle as ndl

    summary["model"] = ndl.load(str(out / "model.ndl"))
    return summary


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Every strategy's own 6-step run, saving at steps 3 and 6."""
    root = tmp_path_factory.mktemp("straight")
    runs = {}
    for name, layout in LAYOUTS.items():
        runs[name] = _train(root / name, *layout, "--save-every", "3",
                            "--checkpoint-dir", str(root / f"{name}_ckpt"))
        runs[name]["step3"] = str(root / f"{name}_ckpt" / "step-00000003")
    return runs


PAIRS = [("zero", "ddp"), ("ddp", "zero"), ("ddp", "single"), ("zero", "single"),
         ("tp", "single"), ("pipeline", "single"),
         # the mesh strategies also resume what others saved
         ("single", "tp"), ("zero", "pipeline"), ("tp", "pipeline")]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("saver,resumer", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_resume_under_another_strategy_continues_its_run(straight, tmp_path, saver, resumer):
    saved, want = straight[saver], straight[resumer]
    got = _train(tmp_path, *LAYOUTS[resumer], "--resume", saved["step3"])
    assert got["steps"] == 6 and got["strategy"] == resumer
    assert got["resume"]["step"] == 3 and got["resume"]["converted_from"] == saver
    assert got["losses"][:3] == saved["losses"][:3]  # the saved history, as it was
    np.testing.assert_allclose(got["losses"][3:], want["losses"][3:], rtol=1e-5)
    if {saver, resumer} <= BITWISE:
        assert got["params_sha256"] == want["params_sha256"]
    assert sorted(got["model"]) == sorted(want["model"])
    for name, value in want["model"].items():
        np.testing.assert_allclose(got["model"][name], value, rtol=0, atol=1e-6,
                                   err_msg=name)


def test_resume_refuses_another_learning_rate_across_strategies(straight):
    with pytest.raises(train.UsageError, match=r"options differ.*--lr None -> 0\.01"):
        train.train(train.parse_args([*COMMON, "--lr", "0.01", "--resume",
                                      straight["ddp"]["step3"]]))


def test_resume_refuses_another_batch_size_across_strategies(straight):
    with pytest.raises(train.UsageError, match="--batch-size 64 -> 32"):
        train.train(train.parse_args([*COMMON, "--batch-size", "32", "--resume",
                                      straight["zero"]["step3"]]))


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_batchnorm_model_refuses_another_cut_of_the_batch(tmp_path):
    """mlp_resnet normalises each replica's share with its own statistics: one process and
    two ddp replicas compute different steps, so the conversion is refused, saying why."""
    ckpt = tmp_path / "ckpt"
    train.train(train.parse_args(["--model", "mlp_resnet", "--max-steps", "2", "--save-every",
                                  "2", "--checkpoint-dir", str(ckpt), "--no-progress"]))
    proc = _run("--model", "mlp_resnet", "--max-steps", "4", "--no-progress", "--strategy",
                "ddp", "--nproc", "2", "--resume", str(ckpt), "--out", str(tmp_path / "o"))
    out = proc.stdout + proc.stderr  # the launcher relays the ranks' lines
    assert proc.returncode != 0
    assert "has BatchNorm" in out and "into 1 pieces" in out and "into 2" in out, out[-2000:]
