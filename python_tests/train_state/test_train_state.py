"""TrainState, the checkpoint store and the RNG ledger."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim
from needle._core.errors import SerializationError
from needle.data import DataLoader, NDArrayDataset
from needle.train_state import (
    RNGLedger,
    TrainState,
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint,
    write_checkpoint,
)
from needle.train_state.ledger import first_divergence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup(seed=0):
    np.random.seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    opt = optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(NDArrayDataset(np.arange(20.0).reshape(10, 2)), 3, shuffle=True)
    return model, opt, loader


def _train(model, opt, steps):
    losses = []
    for _ in range(steps):
        x = ndl.Tensor(ndl.random.randn(5, 3), requires_grad=False)
        opt.reset_grad()
        loss = (model(x) ** 2).sum()
        loss.backward()
        opt.step()
        losses.append(float(loss.numpy()))
    return losses


def test_train_state_continues_exactly(tmp_path):
    model, opt, loader = _setup()
    _train(model, opt, 3)
    it = iter(loader)
    next(it)
    state = TrainState(model=model, optimizer=opt, loader=loader, extra={"step": 3})
    state.save(str(tmp_path), step=3)
    expected = _train(model, opt, 4)
    expected_batches = [b[0].numpy().tolist() for b in it]

    model2, opt2, loader2 = _setup(seed=9)  # different init and RNG position
    restored = TrainState(model=model2, optimizer=opt2, loader=loader2)
    manifest = restored.load(str(tmp_path))
    assert manifest["step"] == 3 and restored.extra == {"step": 3}
    assert _train(model2, opt2, 4) == expected  # dropout masks and inputs included
    assert [b[0].numpy().tolist() for b in iter(loader2)] == expected_batches
    assert opt2.t == opt.t


def test_state_of_a_newer_format_or_lacking_a_part_is_refused():
    model, opt, _ = _setup()
    state = TrainState(model=model).state_dict()
    with pytest.raises(SerializationError, match="lacks \\['optimizer'\\]"):
        TrainState(model=model, optimizer=opt).load_state_dict(state)
    state["format_version"] = 99
    with pytest.raises(SerializationError, match="newer"):
        TrainState(model=model).load_state_dict(state)


def test_store_keeps_the_newest_k_and_skips_incomplete(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30, 40):
        write_checkpoint(d, step, {"step": step}, keep=2)
    assert [s for s, _, ok in list_checkpoints(d) if ok] == [30, 40]
    # a crash mid-save: shard written, manifest never
    os.makedirs(os.path.join(d, "step-00000050"))
    ndl.save({"step": 50}, os.path.join(d, "step-00000050", "rank-00000.ndl"))
    assert latest_checkpoint(d).endswith("step-00000040")
    manifest, shard = read_checkpoint(d)
    assert manifest["step"] == 40 and shard == {"step": 40}


def test_a_shard_that_changed_after_the_manifest_is_refused(tmp_path):
    path = write_checkpoint(str(tmp_path), 5, {"w": np.ones(3)})
    ndl.save({"w": np.zeros(3)}, os.path.join(path, "rank-00000.ndl"))
    assert latest_checkpoint(str(tmp_path)) is None
    with pytest.raises(SerializationError, match="checksum"):
        read_checkpoint(path)
    with pytest.raises(SerializationError, match="no complete checkpoint"):
        read_checkpoint(str(tmp_path))


def test_multi_rank_store_needs_a_barrier_and_names_missing_ranks(tmp_path):
    with pytest.raises(SerializationError, match="need a barrier"):
        write_checkpoint(str(tmp_path), 1, {}, world_size=2)
    path = write_checkpoint(str(tmp_path), 1, {"r": 0})
    with pytest.raises(SerializationError, match="no shard for rank 3"):
        read_checkpoint(path, rank=3)


def test_thread_ranks_write_one_checkpoint(tmp_path):
    import needle.distributed as dist

    def job(rank):
        write_checkpoint(str(tmp_path), 7, {"rank": rank}, rank=rank, world_size=2,
                         barrier=dist.barrier)
        return read_checkpoint(str(tmp_path), rank)[1]["rank"]

    assert dist.spawn_threads(job, 2) == [0, 1]
    manifest = json.loads((tmp_path / "step-00000007" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and sorted(manifest["shards"]) == ["0", "1"]


_SAVER = r"""
import sys, numpy as np
sys.path.insert(0, {repo!r})
from needle.train_state import write_checkpoint
step = 0
while True:
    step += 1
    write_checkpoint({d!r}, step, {{"step": step, "w": np.full(1_000_000, step, np.float32)}},
                     keep=2)
"""


def _wait_for_a_checkpoint(d: str, proc: subprocess.Popen, seconds: float = 60.0) -> None:
    """Until the saver's first checkpoint is complete (the state the kill needs)."""
    deadline = time.monotonic() + seconds
    while latest_checkpoint(d) is None:
        assert proc.poll() is None, f"the saver exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"no complete checkpoint in {d} after {seconds} s"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_during_checkpointing_leaves_the_previous_one_loadable(tmp_path):
    for delay in (0.0, 0.1, 0.3, 0.6):
        d = str(tmp_path / f"after-{delay}")
        proc = subprocess.Popen([sys.executable, "-c", _SAVER.format(repo=REPO, d=d)])
        try:
            _wait_for_a_checkpoint(d, proc)
            time.sleep(delay)  # somewhere in a later write: any moment must do
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        manifest, shard = read_checkpoint(d)
        assert shard["step"] == manifest["step"] >= 1
        assert (shard["w"] == shard["step"]).all()


def test_ledger_offsets_sites_and_divergence():
    with RNGLedger(rank=1) as a:
        ndl.random.seed(0)
        ndl.random.rand(2, 3)
        ndl.random.permutation(5)
    assert [(e["offset"], e["count"], e["shape"]) for e in a.entries] == [
        (0, 6, [2, 3]), (6, 5, [5])]
    assert "test_train_state.py" in a.entries[0]["site"] and a.entries[0]["rank"] == 1
    with RNGLedger() as b:
        ndl.random.seed(0)
        ndl.random.rand(2, 3)
        ndl.random.seed(1)  # the same kind of draw, other values
        ndl.random.permutation(5)
    assert first_divergence(a.entries, a.entries) is None
    message = first_divergence(a.entries, b.entries)
    assert message.startswith("draw 1 differs in digest") and "permutation(5,)" in message
    assert "differ in length" in first_divergence(a.entries, a.entries[:1])


def test_ledger_positions_travel_with_the_state():
    with RNGLedger() as ledger:
        ndl.random.rand(4)
        saved = ledger.state_dict()
        ndl.random.rand(1)
    resumed = RNGLedger()
    resumed.load_state_dict(saved)
    with resumed:
        ndl.random.rand(2)
    assert resumed.entries[0]["offset"] == 4 and ledger.entries[1]["offset"] == 4
