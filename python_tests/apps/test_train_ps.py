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
])
def test_ps_bad_options(args, needle):
    with pytest.raises(train.UsageError, match=needle.replace("[", r"\[")):
        train.parse_args(["--strategy", "ps", "--nproc", "2", *args])
