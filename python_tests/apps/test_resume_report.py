"""``--resume D`` says which checkpoint it used and why each newer one was skipped.

The store's :func:`latest_checkpoint_report` gives the choice and the reasons; the main job
prints one line per skipped checkpoint and one naming the checkpoint used (stderr, rank 0),
and writes the same as ``summary.json``'s ``resume`` block.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)
from test_train_main import _quiet, _run  # the main job's own helpers

import needle as ndl
from needle._core.errors import SerializationError
from needle.train_state import (
    latest_checkpoint,
    latest_checkpoint_report,
    list_checkpoints,
    read_checkpoint,
    write_checkpoint,
)

SHARD0 = "rank-00000.ndl"


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _flip_a_byte(path) -> tuple[str, str]:
    """Corrupt ``path`` in place; (the manifest's sha256, the file's sha256 now)."""
    manifest = json.loads(open(os.path.join(os.path.dirname(path), "manifest.json")).read())
    expected = next(info["sha256"] for info in manifest["shards"].values()
                    if info["file"] == os.path.basename(path))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    return expected, _sha256(path)


def _step(directory, step) -> str:
    return os.path.join(str(directory), f"step-{step:08d}")


def _resume_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("resume: ")]


# ---- the store ---------------------------------------------------------------------------------
def _two_rank_checkpoint(d, step):
    """A checkpoint as two ranks write it (rank 1's shard first, then rank 0's and the manifest)."""
    for rank in (1, 0):
        write_checkpoint(d, step, {"rank": rank, "w": np.full(4, step)}, rank=rank,
                         world_size=2, keep=None, barrier=lambda: None)


def test_report_names_every_newer_broken_checkpoint_and_why(tmp_path):
    d = str(tmp_path)
    write_checkpoint(d, 2, {"w": np.full(4, 2)}, keep=None)
    write_checkpoint(d, 4, {"w": np.full(4, 4)}, keep=None)
    _two_rank_checkpoint(d, 6)
    os.unlink(os.path.join(_step(d, 6), "rank-00001.ndl"))          # a shard lost
    write_checkpoint(d, 8, {"w": np.full(4, 8)}, keep=None)
    expected, actual = _flip_a_byte(os.path.join(_step(d, 8), SHARD0))  # a shard changed
    write_checkpoint(d, 9, {"w": np.full(4, 9)}, keep=None)
    with open(os.path.join(_step(d, 9), "manifest.json"), "w") as f:
        f.write('{"shards": ')                                           # a torn manifest
    os.makedirs(_step(d, 10))                                            # killed mid-save
    ndl.save({"w": np.full(4, 10)}, os.path.join(_step(d, 10), SHARD0))
    _two_rank_checkpoint(d, 12)  # a manifest that lists fewer ranks than it says ran
    manifest_path = os.path.join(_step(d, 12), "manifest.json")
    manifest = json.loads(open(manifest_path).read())
    del manifest["shards"]["1"]
    open(manifest_path, "w").write(json.dumps(manifest))

    path, skipped = latest_checkpoint_report(d)
    assert path == _step(d, 4)
    assert [p for p, _ in skipped] == [_step(d, s) for s in (12, 10, 9, 8, 6)]  # newest first
    reasons = [why for _, why in skipped]
    assert reasons[0] == ("manifest.json lists shards of ranks ['0'], expected ranks 0..1 "
                          "(world_size 2)")
    assert reasons[1] == "no manifest"
    assert reasons[2].startswith("unreadable manifest.json: ")
    assert reasons[3] == f"sha256 mismatch in {SHARD0}: expected {expected}, got {actual}"
    assert expected != actual
    assert reasons[4] == "shard rank1 missing: rank-00001.ndl"
    # the older entry points agree with the report
    assert latest_checkpoint(d) == path
    assert [s for s, _, ok in list_checkpoints(d) if ok] == [2, 4]
    manifest, shard = read_checkpoint(d)
    assert manifest["step"] == 4 and (shard["w"] == 4).all()


def test_no_complete_checkpoint_lists_what_was_skipped_and_why(tmp_path):
    d = str(tmp_path)
    write_checkpoint(d, 2, {"w": 1}, keep=None)
    write_checkpoint(d, 4, {"w": 1}, keep=None)
    os.unlink(os.path.join(_step(d, 4), "manifest.json"))
    expected, actual = _flip_a_byte(os.path.join(_step(d, 2), SHARD0))
    assert latest_checkpoint_report(d) == (None, [
        (_step(d, 4), "no manifest"),
        (_step(d, 2), f"sha256 mismatch in {SHARD0}: expected {expected}, got {actual}")])
    with pytest.raises(SerializationError) as info:
        read_checkpoint(d)
    message = str(info.value)
    assert "no complete checkpoint" in message and "skipped 2" in message
    assert f"{_step(d, 4)} (no manifest)" in message
    assert f"{_step(d, 2)} (sha256 mismatch in {SHARD0}: expected {expected}" in message
    # a step directory named on purpose says what is wrong with it
    with pytest.raises(SerializationError, match=r"step-00000004 \(no manifest\)"):
        read_checkpoint(_step(d, 4))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert latest_checkpoint_report(str(empty)) == (None, [])
    with pytest.raises(SerializationError, match="found no step-NNNNNNNN directory"):
        read_checkpoint(str(empty))


# ---- the main job ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One single-process run to step 6 with checkpoints at 2, 4 and 6; (its summary, dir)."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    summary = train.train(_quiet("--model", "mlp", "--max-steps", "6", "--save-every", "2",
                                 "--checkpoint-dir", str(ckpt)))
    assert sorted(os.listdir(ckpt)) == ["run.json", "step-00000002", "step-00000004",
                                        "step-00000006"]
    return summary, str(ckpt)


def _copy(saved, tmp_path) -> str:
    d = str(tmp_path / "ckpt")
    shutil.copytree(saved[1], d)
    return d


def _resume(d, capsys):
    summary = train.train(_quiet("--model", "mlp", "--max-steps", "6", "--resume", d))
    return summary, _resume_lines(capsys.readouterr().err)


def test_a_run_without_resume_reports_null(saved):
    assert "resume" in saved[0] and saved[0]["resume"] is None


def test_resume_of_intact_checkpoints_skips_nothing(saved, tmp_path, capsys):
    d = _copy(saved, tmp_path)
    summary, lines = _resume(d, capsys)
    assert summary["resume"] == {"step": 6, "path": _step(d, 6), "skipped": []}
    assert lines == [f"resume: from step 6: {_step(d, 6)}"]
    assert summary["losses"] == saved[0]["losses"]


def test_resume_skips_a_checkpoint_without_manifest(saved, tmp_path, capsys):
    d = _copy(saved, tmp_path)
    os.unlink(os.path.join(_step(d, 6), "manifest.json"))
    summary, lines = _resume(d, capsys)
    assert summary["resume"] == {"step": 4, "path": _step(d, 4),
                                 "skipped": [{"path": _step(d, 6), "reason": "no manifest"}]}
    assert lines == [f"resume: skipped {_step(d, 6)}: no manifest",
                     f"resume: from step 4: {_step(d, 4)}"]
    # it really continued from step 4: steps 5 and 6 are recomputed bit for bit
    assert summary["steps"] == 6 and summary["losses"] == saved[0]["losses"]
    assert summary["params_sha256"] == saved[0]["params_sha256"]


def test_resume_skips_a_missing_shard_and_an_older_changed_one(saved, tmp_path, capsys):
    d = _copy(saved, tmp_path)
    os.unlink(os.path.join(_step(d, 6), SHARD0))
    expected, actual = _flip_a_byte(os.path.join(_step(d, 4), SHARD0))
    summary, lines = _resume(d, capsys)
    mismatch = f"sha256 mismatch in {SHARD0}: expected {expected}, got {actual}"
    assert summary["resume"] == {"step": 2, "path": _step(d, 2), "skipped": [
        {"path": _step(d, 6), "reason": f"shard rank0 missing: {SHARD0}"},
        {"path": _step(d, 4), "reason": mismatch}]}
    assert lines == [f"resume: skipped {_step(d, 6)}: shard rank0 missing: {SHARD0}",
                     f"resume: skipped {_step(d, 4)}: {mismatch}",
                     f"resume: from step 2: {_step(d, 2)}"]
    assert summary["losses"] == saved[0]["losses"]


def test_resume_with_no_complete_checkpoint_names_each_and_why(saved, tmp_path):
    d = _copy(saved, tmp_path)
    for step in (2, 4, 6):
        os.unlink(os.path.join(_step(d, step), "manifest.json"))
    with pytest.raises(train.UsageError) as info:
        train.train(_quiet("--model", "mlp", "--max-steps", "6", "--resume", d))
    message = str(info.value)
    assert message.startswith(f"--resume: {d}: no complete checkpoint")
    assert "skipped 3: " + "; ".join(f"{_step(d, s)} (no manifest)" for s in (6, 4, 2)) in message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_summary_json_and_log_of_a_resumed_command(saved, tmp_path):
    d = _copy(saved, tmp_path)
    expected, actual = _flip_a_byte(os.path.join(_step(d, 6), SHARD0))
    out = tmp_path / "out"
    proc = _run("--model", "mlp", "--max-steps", "6", "--no-progress", "--resume", d,
                "--out", str(out), timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    mismatch = f"sha256 mismatch in {SHARD0}: expected {expected}, got {actual}"
    assert _resume_lines(proc.stderr) == [f"resume: skipped {_step(d, 6)}: {mismatch}",
                                          f"resume: from step 4: {_step(d, 4)}"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resume"] == {"step": 4, "path": _step(d, 4),
                                 "skipped": [{"path": _step(d, 6), "reason": mismatch}]}


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_skip_a_checkpoint_missing_rank1s_shard(tmp_path):
    d = str(tmp_path / "ckpt")
    first = _run("--nproc", "2", "--model", "mlp", "--max-steps", "4", "--save-every", "2",
                 "--no-progress", "--checkpoint-dir", d, "--out", str(tmp_path / "a"),
                 timeout=280)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    os.unlink(os.path.join(_step(d, 4), "rank-00001.ndl"))
    resumed = _run("--nproc", "2", "--model", "mlp", "--max-steps", "4", "--no-progress",
                   "--resume", d, "--out", str(tmp_path / "b"), timeout=280)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    reason = "shard rank1 missing: rank-00001.ndl"
    assert summary["resume"] == {"step": 2, "path": _step(d, 2),
                                 "skipped": [{"path": _step(d, 4), "reason": reason}]}
    # both ranks chose step 2 (rank 1 would fail on its missing shard otherwise); one says so
    lines = [line for line in (resumed.stdout + resumed.stderr).splitlines()
             if "resume: " in line]
    assert len(lines) == 2, lines
    assert lines[0].endswith(f"resume: skipped {_step(d, 4)}: {reason}")
    assert lines[1].endswith(f"resume: from step 2: {_step(d, 2)}")
    first_losses = json.loads((tmp_path / "a" / "summary.json").read_text())["losses"]
    assert summary["losses"] == first_losses
