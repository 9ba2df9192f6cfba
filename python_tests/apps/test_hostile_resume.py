"""``--resume`` against checkpoint folders that mix runs, and outputs written past planted
temporary names."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)
from test_train_main import _quiet  # the main job's own helpers
from training.summary import write_outputs

from needle.train_state import run_id_of


def _step(directory, step) -> str:
    return os.path.join(str(directory), f"step-{step:08d}")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two runs of the same options, each with checkpoints at 2 and 4: (summary, dir) each."""
    runs = []
    for name in ("a", "b"):
        d = tmp_path_factory.mktemp(name) / "ckpt"
        summary = train.train(_quiet("--model", "mlp", "--max-steps", "4", "--save-every", "2",
                                     "--checkpoint-dir", str(d)))
        runs.append((summary, str(d)))
    return runs


def test_resume_refuses_a_step_directory_of_another_run(two_runs, tmp_path):
    (_, a), (_, b) = two_runs
    d = str(tmp_path / "ckpt")
    shutil.copytree(a, d)
    shutil.rmtree(_step(d, 4))
    shutil.copytree(_step(b, 4), _step(d, 4))  # run b's step 4 planted in run a's folder
    with pytest.raises(train.UsageError, match=f"--resume: {d} holds checkpoints of run "
                                               f"{run_id_of(a)}, got {_step(d, 4)} \\(from "
                                               f"another run.*--adopt-run"):
        train.train(_quiet("--model", "mlp", "--max-steps", "6", "--resume", d))


def test_adopt_run_resumes_it_and_saves_as_the_folders_run(two_runs, tmp_path):
    (_, a), (_, b) = two_runs
    d = str(tmp_path / "ckpt")
    shutil.copytree(a, d)
    shutil.rmtree(_step(d, 4))
    shutil.copytree(_step(b, 4), _step(d, 4))
    summary = train.train(_quiet("--model", "mlp", "--max-steps", "6", "--save-every", "2",
                                 "--resume", d, "--adopt-run"))
    assert summary["resume"]["path"] == _step(d, 4) and summary["steps"] == 6
    manifest = json.load(open(os.path.join(_step(d, 6), "manifest.json")))
    assert manifest["run_id"] == run_id_of(d) == run_id_of(a)


def test_adopt_run_needs_resume():
    with pytest.raises(train.UsageError, match="--adopt-run applies to .*--resume"):
        train.train(_quiet("--model", "mlp", "--max-steps", "2", "--adopt-run"))


def test_a_resumed_run_saving_elsewhere_keeps_its_run(two_runs, tmp_path):
    (_, a), _ = two_runs
    d = str(tmp_path / "ckpt")
    shutil.copytree(a, d)
    elsewhere = str(tmp_path / "elsewhere")
    train.train(_quiet("--model", "mlp", "--max-steps", "6", "--save-every", "2",
                       "--resume", d, "--checkpoint-dir", elsewhere))
    assert run_id_of(elsewhere) == run_id_of(a)


def test_summary_json_is_not_written_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "summary.json.tmp")  # the name the writer once used
    summary = {"history": {"epoch": [1], "test_loss": [1.0], "train_acc": [0.5],
                           "test_acc": [0.5]}, "losses": [1.0], "strategy": "single",
               "world_size": 1, "device": "cpu()", "config": {"model": "mlp", "data": "x"}}
    json_path, _ = write_outputs(summary, str(out))
    assert victim.read_text() == "precious" and not os.path.islink(json_path)
    assert json.load(open(json_path))["strategy"] == "single"
