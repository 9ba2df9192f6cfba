"""Checkpoint directories that lie: manifests naming files outside the checkpoint, step
directories of another run, checkpoints of another world size, bad save arguments, states
that fit one part and not the next, and optimizer states that do not fit the optimizer."""
from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim
from needle._core.errors import SerializationError, ShapeError
from needle.train_state import (
    TrainState,
    incomplete_reason,
    latest_checkpoint_report,
    list_checkpoints,
    read_all_shards,
    read_checkpoint,
    resolve_checkpoint,
    run_id_of,
    write_checkpoint,
)


def _step(d, step: int) -> str:
    return os.path.join(str(d), f"step-{step:08d}")


def _edit_manifest(path: str, change) -> None:
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    change(manifest)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def _model_and_adam(seed: int = 0):
    np.random.seed(seed)
    model = nn.Linear(3, 2)
    opt = optim.Adam(model.parameters(), lr=0.1)
    x = ndl.Tensor(np.random.randn(4, 3).astype(np.float32), requires_grad=False)
    (model(x) ** 2).sum().backward()
    opt.step()
    return model, opt


# ---- save arguments -------------------------------------------------------------------------
def test_keep_zero_is_refused_before_anything_is_written(tmp_path):
    state = TrainState(extra={"step": 1})
    with pytest.raises(SerializationError, match=r"keep must be an int >= 1 \(or None to keep "
                                                 r"every checkpoint\), got 0"):
        state.save(str(tmp_path), step=1, keep=0)
    assert os.listdir(tmp_path) == []
    state.save(str(tmp_path), step=1, keep=1)  # keep=1 keeps what it wrote
    assert [s for s, _, ok in list_checkpoints(str(tmp_path)) if ok] == [1]


@pytest.mark.parametrize("kwargs, what", [
    ({"step": -1}, "step must be >= 0, got -1"),
    ({"step": 1.5}, "step must be an int, got 1.5"),
    ({"step": 1, "rank": 2, "world_size": 2}, r"rank must be in \[0, world_size\)"),
])
def test_bad_steps_and_ranks_are_refused(tmp_path, kwargs, what):
    with pytest.raises(SerializationError, match=what):
        write_checkpoint(str(tmp_path), shard={}, barrier=lambda: None, **kwargs)
    assert os.listdir(tmp_path) == []


# ---- paths inside the checkpoint ------------------------------------------------------------
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    outside = tmp_path / "outside"
    write_checkpoint(str(outside), 1, {"secret": 1})
    d = tmp_path / "ckpt"
    path = write_checkpoint(str(d), 1, {"mine": 1})
    stolen = os.path.join("..", "..", "outside", "step-00000001", "rank-00000.ndl")
    sha = json.load(open(os.path.join(outside, "step-00000001", "manifest.json")))[
        "shards"]["0"]["sha256"]
    _edit_manifest(path, lambda m: m["shards"]["0"].update(file=stolen, sha256=sha))
    assert incomplete_reason(path) == (f"manifest.json entry of rank0 names file {stolen!r}, "
                                       f"expected rank-00000.ndl inside the checkpoint")
    with pytest.raises(SerializationError, match="no complete checkpoint"):
        read_checkpoint(path)
    with pytest.raises(SerializationError, match="no complete checkpoint"):
        TrainState().load(str(d))


def test_a_shard_symlinked_outside_the_checkpoint_is_refused(tmp_path):
    outside = tmp_path / "outside.ndl"
    ndl.save({"secret": 1}, str(outside))
    path = write_checkpoint(str(tmp_path / "ckpt"), 1, {"secret": 1})
    shard = os.path.join(path, "rank-00000.ndl")
    os.unlink(shard)
    os.symlink(outside, shard)  # same bytes, so the checksum alone would accept it
    assert incomplete_reason(path) == "shard rank0 rank-00000.ndl resolves outside the checkpoint"
    with pytest.raises(SerializationError, match="resolves outside the checkpoint"):
        read_checkpoint(path)


def test_a_fifo_for_a_shard_or_manifest_is_a_reason_not_a_hang(tmp_path):
    path = write_checkpoint(str(tmp_path), 1, {"w": 1})
    os.unlink(os.path.join(path, "rank-00000.ndl"))
    os.mkfifo(os.path.join(path, "rank-00000.ndl"))
    assert incomplete_reason(path).startswith("shard rank0 unreadable: ")
    os.unlink(os.path.join(path, "manifest.json"))
    os.mkfifo(os.path.join(path, "manifest.json"))
    assert incomplete_reason(path).startswith("unreadable manifest.json: ")


def test_a_manifest_of_another_step_is_refused(tmp_path):
    d = str(tmp_path)
    write_checkpoint(d, 2, {"w": 2})
    shutil.copytree(_step(d, 2), _step(d, 9))  # an old checkpoint renamed to look newer
    assert latest_checkpoint_report(d) == (_step(d, 2), [
        (_step(d, 9), "manifest.json is of step 2, expected 9 (its directory's)")])


# ---- malformed manifests of old checkpoints -------------------------------------------------
@pytest.mark.parametrize("manifest", [
    {"shards": {"0": {"file": 5, "sha256": "x"}}, "world_size": 1, "step": 1},
    {"shards": {"0": {"file": ["a"], "sha256": 1}}, "world_size": 1, "step": 1},
    {"shards": {"0": []}, "world_size": "1", "step": 1},
    {"shards": {"x": {}}, "world_size": 1, "step": 1},
    [1, 2],
])
def test_a_malformed_old_manifest_blocks_neither_resume_nor_save(tmp_path, manifest):
    d = str(tmp_path)
    write_checkpoint(d, 1, {"w": 1}, keep=None)
    write_checkpoint(d, 2, {"w": 2}, keep=None)
    with open(os.path.join(_step(d, 1), "manifest.json"), "w") as f:
        json.dump(manifest, f)
    assert isinstance(incomplete_reason(_step(d, 1)), str)
    assert [ok for _, _, ok in list_checkpoints(d)] == [False, True]
    assert read_checkpoint(d)[1] == {"w": 2}
    write_checkpoint(d, 3, {"w": 3}, keep=1)  # pruning reads the old manifest too
    assert [s for s, _, ok in list_checkpoints(d) if ok] == [3]


# ---- run identity ---------------------------------------------------------------------------
def test_a_step_directory_of_another_run_is_refused_unless_adopted(tmp_path):
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    write_checkpoint(mine, 2, {"who": "mine"})
    write_checkpoint(theirs, 9, {"who": "theirs"})
    assert run_id_of(mine) != run_id_of(theirs)
    shutil.copytree(_step(theirs, 9), _step(mine, 9))
    with pytest.raises(SerializationError, match=f"holds checkpoints of run {run_id_of(mine)}"
                                                 f".*step-00000009.*from another run.*"
                                                 f"adopt_run=True"):
        TrainState().load(mine)
    with pytest.raises(SerializationError, match="is a checkpoint of run .*adopt_run=True"):
        read_checkpoint(_step(mine, 9))  # named directly, its folder still says whose it is
    path, skipped = resolve_checkpoint(mine, adopt_run=True)
    assert path == _step(mine, 9) and skipped == []
    assert read_checkpoint(mine, adopt_run=True)[1] == {"who": "theirs"}
    assert read_all_shards(mine, adopt_run=True)[1] == [{"who": "theirs"}]


def test_saving_into_a_folder_of_another_run_is_refused(tmp_path):
    d = str(tmp_path)
    write_checkpoint(d, 1, {}, run_id="run-a")
    with pytest.raises(SerializationError, match="holds the checkpoints of run run-a, expected "
                                                 "run run-b"):
        write_checkpoint(d, 2, {}, run_id="run-b")
    assert [s for s, _, _ in list_checkpoints(d)] == [1]
    with pytest.raises(SerializationError, match="holds the checkpoints of run run-a, "
                                                 "expected run run-b"):
        read_checkpoint(d, run_id="run-b")
    assert json.load(open(os.path.join(_step(d, 1), "manifest.json")))["run_id"] == "run-a"


def test_pruning_never_deletes_another_runs_checkpoint(tmp_path):
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    write_checkpoint(theirs, 50, {"who": "theirs"})
    shutil.copytree(_step(theirs, 50), _step(mine, 50))
    for step in (1, 2, 3):
        write_checkpoint(mine, step, {"step": step}, keep=2)
    assert sorted(os.listdir(mine)) == ["run.json", "step-00000002", "step-00000003",
                                        "step-00000050"]


# ---- skipped checkpoints are reported -------------------------------------------------------
def test_a_tampered_newest_checkpoint_is_skipped_with_a_warning(tmp_path):
    d = str(tmp_path)
    TrainState(extra={"step": 1}).save(d, step=1)
    TrainState(extra={"step": 2}).save(d, step=2)
    with open(os.path.join(_step(d, 2), "rank-00000.ndl"), "ab") as f:
        f.write(b"tampered")
    state = TrainState()
    with pytest.warns(UserWarning, match=r"skipped .*step-00000002: sha256 mismatch in "
                                         r"rank-00000.ndl.*using .*step-00000001"):
        manifest = state.load(d)
    assert manifest["step"] == 1 and state.extra == {"step": 1}


# ---- world size -----------------------------------------------------------------------------
def test_a_two_rank_checkpoint_is_not_loaded_by_one_rank(tmp_path):
    d = str(tmp_path)
    for rank in (1, 0):  # rank 0 last: it writes the manifest once both shards exist
        TrainState(extra={"rank": rank}).save(d, step=4, rank=rank, world_size=2,
                                              barrier=lambda: None)
    with pytest.raises(SerializationError, match="saved by 2 ranks, expected world_size 1.*"
                                                 "read_all_shards"):
        TrainState().load(d)
    state = TrainState()
    state.load(d, rank=1, world_size=2)
    assert state.extra == {"rank": 1}


# ---- all or nothing -------------------------------------------------------------------------
def test_load_restores_every_part_or_none(tmp_path):
    model, opt = _model_and_adam(seed=0)
    TrainState(model=model, optimizer=opt, extra={"step": 7}).save(str(tmp_path), step=7)
    other_model = nn.Linear(3, 2)
    sgd = optim.SGD(other_model.parameters(), lr=0.5)  # another optimizer type
    before = {k: v.copy() for k, v in other_model.state_dict().items()}
    ndl.random.seed(3)
    rng_before = ndl.random.get_state()
    state = TrainState(model=other_model, optimizer=sgd, extra={"mine": True})
    with pytest.raises(SerializationError, match="optimiser type differs, expected SGD, got "
                                                 "'Adam'"):
        state.load(str(tmp_path))
    after = other_model.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # the model untouched
    assert state.extra == {"mine": True} and sgd.lr == 0.5
    drawn = ndl.random.rand(4)  # the streams are where they were before the load
    ndl.random.set_state(rng_before)
    assert np.array_equal(drawn, ndl.random.rand(4))


# ---- optimizer states -----------------------------------------------------------------------
def test_optimizer_hyper_parameters_cannot_replace_the_parameters():
    model, opt = _model_and_adam()
    state = opt.state_dict()
    state["hyper"] = {"params": []}
    with pytest.raises(SerializationError, match=r"hyper-parameters differ, expected \['beta1', "
                                                 r"'beta2', 'eps', 'lr', 'weight_decay'\], got "
                                                 r"\['params'\]"):
        opt.load_state_dict(state)
    assert len(opt.params) == 2
    state = opt.state_dict()
    state["hyper"]["params"] = []
    with pytest.raises(SerializationError, match="hyper-parameters differ"):
        opt.load_state_dict(state)
    assert len(opt.params) == 2


def test_an_adam_state_without_its_first_moments_is_refused():
    model, opt = _model_and_adam()
    m = {p: a.numpy().copy() for p, a in opt.m.items()}
    state = opt.state_dict()
    del state["state"]["m"]
    with pytest.raises(SerializationError, match=r"slots differ, expected \['m', 'v', "
                                                 r"'master'\], got \['master', 'v'\]"):
        opt.load_state_dict(state)
    assert all(np.array_equal(opt.m[p].numpy(), m[p]) for p in m)  # nothing reset


@pytest.mark.parametrize("change, what", [
    (lambda s: s["state"]["m"].pop(1), "slots cover different parameters"),
    (lambda s: s["state"]["m"].update({5: s["state"]["m"][0]}), "parameter index 5"),
    (lambda s: s["state"]["v"].update({"-1": s["state"]["v"][0]}), "parameter index '-1'"),
    (lambda s: s["state"].update(u={}), r"slots differ"),
    (lambda s: s["hyper"].update(lr="0.1"), "hyper-parameter 'lr' is not a number"),
    (lambda s: s.update(state=[]), "slots differ"),
])
def test_optimizer_states_that_do_not_fit_are_refused_whole(change, what):
    model, opt = _model_and_adam()
    state = opt.state_dict()
    change(state)
    lr, m = opt.lr, dict(opt.m)
    with pytest.raises(SerializationError, match=what):
        opt.load_state_dict(state)
    assert opt.lr == lr and opt.m == m


def test_an_optimizer_state_of_the_wrong_shape_changes_nothing():
    model, opt = _model_and_adam()
    state = opt.state_dict()
    state["state"]["v"][1] = np.zeros((7,), np.float32)
    m = dict(opt.m)
    with pytest.raises(ShapeError, match=r"state 'v' of parameter 1 has the wrong shape"):
        opt.load_state_dict(state)
    assert opt.m == m  # m was not replaced before v's shape was found wrong


def test_a_good_optimizer_state_still_round_trips():
    model, opt = _model_and_adam(seed=1)
    state = opt.state_dict()
    _, fresh = _model_and_adam(seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(state)
    assert fresh.t == opt.t
    for p, q in zip(opt.params, fresh.params, strict=True):
        np.testing.assert_array_equal(opt.m[p].numpy(), fresh.m[q].numpy())
