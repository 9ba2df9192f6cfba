"""apps/train.py with --strategy pipeline, tp and 3d: the same steps as one process, the
summary's pipeline block, single-process accuracy, and argument checks."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "apps", "train.py")
EXACT = ("--model", "mlp", "--max-steps", "12", "--seed", "4", "--batch-size", "63")


def _run(tmp_path, *args, timeout=240):
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, *args, "--no-progress", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return json.loads((tmp_path / "summary.json").read_text())


@pytest.fixture(scope="module")
def single():
    return train.train(train.parse_args([*EXACT, "--no-progress"]))


def _same_steps(got: dict, want: dict) -> None:
    assert got["steps"] == want["steps"] == 12
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=2e-4, atol=2e-5)
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1 / 359 + 1e-9)


def _check_pipeline_block(block: dict, schedule: str, stages: int, microbatches: int) -> None:
    assert (block["schedule"], block["stages"], block["microbatches"]) == \
        (schedule, stages, microbatches)
    assert 0.0 <= block["bubble_predicted"] < 1.0 and 0.0 <= block["bubble_measured"] < 1.0
    peaks = block["peak_activation_bytes"]
    assert len(peaks["predicted"]) == stages and len(peaks["measured"]) == stages
    assert all(b > 0 for b in peaks["measured"])  # one allocator per process: measured
    assert block["steps_measured"] == 11  # every step but the first


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero-bubble"])
def test_pipeline_steps_equal_the_single_process_steps(tmp_path, single, schedule):
    got = _run(tmp_path, *EXACT, "--strategy", "pipeline", "--nproc", "2", "--schedule",
               schedule, "--microbatches", "4")
    _same_steps(got, single)
    assert got["strategy"] == "pipeline" and got["world_size"] == 2
    _check_pipeline_block(got["pipeline"], schedule, 2, 4)
    assert got["pipeline"]["batchnorm_per_microbatch"] is False


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_tensor_parallel_steps_equal_the_single_process_steps(tmp_path, single):
    got = _run(tmp_path, *EXACT, "--strategy", "tp", "--nproc", "2")
    _same_steps(got, single)
    assert got["mesh"] == {"dp": 1, "tp": 2, "pp": 1, "layers_per_stage": [3]}
    assert "pipeline" not in got


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mesh", [("1", "2", "2"), ("2", "1", "2")])
def test_3d_mesh_steps_equal_the_single_process_steps(tmp_path, single, mesh):
    dp, tp, pp = mesh
    got = _run(tmp_path, *EXACT, "--strategy", "3d", "--dp", dp, "--tp", tp, "--pp", pp,
               timeout=360)
    _same_steps(got, single)
    assert got["world_size"] == 4 and got["mesh"]["pp"] == 2
    _check_pipeline_block(got["pipeline"], "1f1b", 2, 4)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("args", [
    ("--strategy", "pipeline", "--nproc", "2", "--schedule", "1f1b", "--microbatches", "4"),
    ("--strategy", "tp", "--nproc", "2"),
])
def test_default_model_reaches_single_process_accuracy(tmp_path, args):
    got = _run(tmp_path, "--epochs", "8", *args)
    assert got["accuracy"] >= 0.95  # what one process reaches (test_train_main.py)
    if "pipeline" in args:
        assert got["pipeline"]["batchnorm_per_microbatch"] is True


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_interleaved_schedule_on_the_default_model(tmp_path):
    got = _run(tmp_path, "--max-steps", "20", "--strategy", "pipeline", "--nproc", "2",
               "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4")
    block = got["pipeline"]
    assert block["schedule"] == "interleaved" and block["virtual_stages"] == 2
    assert len(got["mesh"]["layers_per_stage"]) == 4  # 6 layers in 4 chunks
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.parametrize("args,message", [
    (["--strategy", "pipeline", "--nproc", "1"], "needs --nproc >= 2"),
    (["--strategy", "pipeline", "--nproc", "2", "--schedule", "pipedream"],
     "--schedule must be one of"),
    (["--strategy", "pipeline", "--nproc", "2", "--microbatches", "100"],
     "smaller than --microbatches 100"),
    (["--strategy", "pipeline", "--nproc", "2", "--schedule", "interleaved",
      "--microbatches", "3"], "multiple of the 2 pipeline stages"),
    (["--strategy", "tp"], "needs --nproc >= 2"),
    (["--strategy", "3d", "--dp", "2", "--tp", "2", "--nproc", "3"],
     "expected 4, got --nproc 3"),
    (["--strategy", "3d"], "expected 1, got --nproc 1"),
])
def test_model_parallel_arguments_are_checked(args, message):
    with pytest.raises(train.UsageError, match=re.escape(message)):
        train.parse_args(args)


def test_3d_starts_the_whole_mesh_by_default():
    cfg = train.parse_args(["--strategy", "3d", "--dp", "2", "--tp", "2", "--pp", "2"])
    assert cfg.nproc == 8
