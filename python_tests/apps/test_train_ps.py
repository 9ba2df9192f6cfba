"""apps/train.py --strategy ps: the sync parameter server follows ddp's loss curve, the
summary's ``ps`` block, a killed worker, bad options."""
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


def _run(*args, timeout=120):
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)

PS_KEYS = ("mode", "servers", "workers", "updates_applied", "gradients_dropped", "workers_lost",
           "workers_rejoined", "staleness_histogram", "max_staleness", "bytes_pushed",
           "bytes_pulled", "bytes_predicted")
COMMON = ("--model", "mlp", "--max-steps", "6", "--epochs", "1", "--no-progress", "--seed", "3",
          "--optimizer", "sgd")


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_ps_sync_follows_ddp_and_reports_its_block(tmp_path):
    ps = _run(*COMMON, "--strategy", "ps", "--servers", "1", "--nproc", "2", "--ps-mode", "sync",
              "--out", str(tmp_path / "ps"), timeout=200)
    assert ps.returncode == 0, ps.stdout[-3000:] + ps.stderr[-2000:]
    ddp = _run(*COMMON, "--strategy", "ddp", "--nproc", "2", "--out", str(tmp_path / "ddp"),
               timeout=200)
    assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-2000:]
    s = json.loads((tmp_path / "ps" / "summary.json").read_text())
    d = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    for key in ("accuracy", "final_loss", "strategy", "world_size", "steps", "wall_s",
                "examples_per_s", "params_sha256"):
        assert key in s, key
    assert s["strategy"] == "ps" and s["world_size"] == 3 and s["steps"] == 6
    # same seeds, same data shards: the same global-batch losses step by step
    np.testing.assert_allclose(s["losses"], d["losses"], rtol=1e-4)
    assert abs(s["accuracy"] - d["accuracy"]) <= 2 / s["test_examples"]
    block = s["ps"]
    for key in PS_KEYS:
        assert key in block, key
    assert block["mode"] == "sync" and block["servers"] == 1 and block["workers"] == 2
    assert block["updates_applied"] == 6 and block["workers_lost"] == 0
    assert block["staleness_histogram"] == {"0": 12} and block["max_staleness"] == 0
    # nobody died: measured payload bytes equal the prediction W x steps x M, each way
    assert block["bytes_pushed"] == block["bytes_predicted"]["pushed"] == 2 * 6 * sum(
        block["shard_bytes"])
    assert block["bytes_pulled"] == block["bytes_predicted"]["pulled"]


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_ps_killed_worker_is_lost_and_training_finishes(tmp_path):
    proc = _run("--model", "mlp", "--max-steps", "8", "--epochs", "1", "--no-progress",
                "--strategy", "ps", "--nproc", "3", "--ps-mode", "async", "--kill-worker", "2@3",
                "--out", str(tmp_path), timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "--kill-worker 2@3: sending SIGKILL" in proc.stdout + proc.stderr
    block = json.loads((tmp_path / "summary.json").read_text())["ps"]
    # Worker 2 pushed steps 1 and 2 asynchronously and dies as step 3 starts: its second push
    # may still sit in its socket's queue when SIGKILL lands (a real kill loses it), so the
    # server saw 1 or 2 of its clocks; every push it saw was applied, no more.
    lost = block["worker_clocks"][1]
    assert block["workers_lost"] == 1 and block["worker_clocks"][::2] == [8, 8] and lost in (1, 2)
    assert block["updates_applied"] == 16 + lost
    assert block["bytes_pushed"] < block["bytes_predicted"]["pushed"]


@pytest.mark.parametrize("args, needle", [
    (["--ps-mode", "eventual"], "unknown --ps-mode"),
    (["--ps-mode", "backup", "--wait-for", "3"], "--wait-for must be in [1, --nproc 2]"),
    (["--ps-mode", "ssp", "--staleness", "-1"], "--staleness must be >= 0"),
    (["--servers", "0"], "--servers must be >= 1"),
    # checkpoints need a sync boundary that every rank reaches
    (["--ps-mode", "async", "--save-every", "3"],
     "--save-every applies to --strategy ps with --ps-mode sync only, got --ps-mode async"),
    (["--ps-mode", "ssp", "--max-steps", "6", "--verify-resume", "3"],
     "--verify-resume applies to --strategy ps with --ps-mode sync only"),
    (["--ps-mode", "backup", "--resume", REPO],  # an existing folder
     "--resume applies to --strategy ps with --ps-mode sync only"),
    (["--ps-mode", "async", "--die-at-step", "2"], "--die-at-step applies to"),
    (["--save-every", "2", "--kill-worker", "1@3"],
     "needs every worker at each checkpoint .* got --kill-worker 1@3"),
])
def test_ps_bad_options(args, needle):
    with pytest.raises(train.UsageError, match=needle.replace("[", r"\[")):
        train.parse_args(["--strategy", "ps", "--nproc", "2", *args])


@pytest.mark.mpi
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", ["mlp", "mlp_resnet"])
def test_ps_sync_verify_resume_is_identical(tmp_path, model):
    """Saved at step 3 (round 3 applied), every rank SIGKILLed as step 4 starts, resumed:
    losses, parameters, BatchNorm buffers, the servers' state and every random draw are the
    straight run's."""
    proc = _run("--strategy", "ps", "--servers", "1", "--nproc", "2", "--ps-mode", "sync",
                "--model", model, "--epochs", "1", "--max-steps", "6", "--no-progress",
                "--out", str(tmp_path), "--verify-resume", "3", timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "resume certificate: IDENTICAL" in proc.stdout, proc.stdout[-2000:]
    cert = json.loads((tmp_path / "resume_certificate.json").read_text())
    assert cert["identical"] and cert["exit_codes"]["killed"] != 0
    # every rank's ledger is compared: the two workers are ranks 1 and 2
    assert sorted(cert["draws_compared"]) == ["0", "1", "2"]
    if model == "mlp_resnet":  # dropout draws on both workers
        assert cert["draws_compared"]["1"] > 0 and cert["draws_compared"]["2"] > 0
    # the server died too (as round 3 was applied), after writing its shard
    killed = (tmp_path / "resumed" / "log_killed.txt").read_text()
    assert "--die-at-step 4 (server): sending SIGKILL" in killed, killed[-2000:]
    step = tmp_path / "resumed" / "checkpoints" / "step-00000003"
    manifest = json.loads((step / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0", "1", "2"] and manifest["world_size"] == 3
    a = json.loads((tmp_path / "continuous" / "summary.json").read_text())
    b = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert b["resume"]["step"] == 3 and a["resume"] is None
    assert a["state_sha256"] is not None and a["state_sha256"] == b["state_sha256"]
    assert a["buffers_sha256"] == b["buffers_sha256"] and a["losses"] == b["losses"]
    for key in ("updates_applied", "worker_clocks", "bytes_pushed", "bytes_pulled",
                "buffer_bytes_pushed", "buffers_from_worker", "staleness_histogram",
                "update_delay_histogram"):
        assert a["ps"][key] == b["ps"][key], key
