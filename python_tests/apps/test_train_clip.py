"""apps/train.py --clip-grad: every strategy clips by the whole model's gradient norm, so its
steps equal the single process's clipped steps; clipping really changes them; bad values
and the parameter server are refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)

import needle as ndl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "apps", "train.py")
# SGD: Adam's update barely depends on the gradient's scale, so clipping would hardly show.
# 0.05 is far below the mlp's gradient norm (about 1-3): every step is clipped.
BASE = ("--model", "mlp", "--max-steps", "3", "--seed", "4", "--batch-size", "63",
        "--optimizer", "sgd")
CLIP = ("--clip-grad", "0.05")


def _run(tmp_path, *args, timeout=240):
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, *BASE, *args, "--no-progress", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["_out"] = tmp_path
    return summary


def _params(summary: dict) -> dict | None:
    name = summary.get("model_file")
    return None if name is None else ndl.load(str(summary["_out"] / name))


@pytest.fixture(scope="module")
def single_clipped(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single_clipped"), *CLIP)


def _same_steps(got: dict, want: dict) -> None:
    # float rounding only: the norm's squares are added in another order, the gradients
    # reduced over ranks
    assert got["steps"] == want["steps"] == 3
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["history"]["test_loss"], want["history"]["test_loss"],
                               rtol=1e-5)  # evaluated after the last step
    mine, theirs = _params(got), _params(want)
    if mine is not None and theirs is not None:
        assert sorted(mine) == sorted(theirs)
        for key in mine:
            np.testing.assert_allclose(np.asarray(mine[key]), np.asarray(theirs[key]),
                                       rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.timeout(300)
def test_clipping_changes_the_steps(tmp_path, single_clipped):
    plain = _run(tmp_path)
    assert plain["losses"][0] == single_clipped["losses"][0]  # the same first forward
    assert not np.allclose(plain["losses"][1:], single_clipped["losses"][1:], rtol=1e-3)


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("args", [
    ("--strategy", "ddp", "--nproc", "2"),
    ("--strategy", "zero", "--zero-stage", "2", "--nproc", "2"),
    ("--strategy", "zero", "--zero-stage", "3", "--nproc", "2"),
    ("--strategy", "tp", "--nproc", "2"),
    ("--strategy", "pipeline", "--nproc", "2", "--microbatches", "3"),
], ids=["ddp", "zero2", "zero3", "tp", "pipeline"])
def test_every_strategy_clips_like_one_process(tmp_path, single_clipped, args):
    _same_steps(_run(tmp_path, *CLIP, *args), single_clipped)


@pytest.mark.timeout(300)
def test_mixed_precision_unscales_once_then_clips(tmp_path, single_clipped):
    # the default step (single, ddp, zero) under fp16-mixed; ZeRO's own unscale-then-clip is
    # checked on threads in python_tests/distributed/test_clip.py
    got = _run(tmp_path, "--precision", "fp16-mixed", *CLIP)
    assert got["scaler"]["skipped_steps"] == 0
    # float16 rounding away from the fp32 clipped steps; unscaling twice (gradients 65536
    # times too small) or not before clipping would leave the weights almost in place
    np.testing.assert_allclose(got["losses"], single_clipped["losses"], rtol=1e-3)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_3d_mesh_clips_like_one_process(tmp_path, single_clipped):
    got = _run(tmp_path, *CLIP, "--strategy", "3d", "--dp", "2", "--tp", "2", "--pp", "2",
               "--microbatches", "2", timeout=360)
    _same_steps(got, single_clipped)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_clip_grad_must_be_positive(value):
    with pytest.raises(train.UsageError, match="--clip-grad must be a positive number"):
        train.parse_args([*BASE, "--clip-grad", value, "--no-progress"])


def test_compiled_steps_refuse_clip_grad():
    with pytest.raises(train.UsageError, match="--compile runs steps without gradient clip"):
        train.parse_args([*BASE, *CLIP, "--compile", "--no-progress"])


def test_the_parameter_server_refuses_clip_grad():
    with pytest.raises(train.UsageError, match="--clip-grad does not apply to --strategy ps"):
        train.parse_args([*BASE, *CLIP, "--strategy", "ps", "--nproc", "2", "--no-progress"])
