"""The project's models (the MLP-ResNet with BatchNorm1d and Dropout, the small CNN with
BatchNorm2d) trained by DDP and ZeRO over ``nccl`` on the CUDA emulator with the fake NCCL,
against the same runs over the host backend (thread ranks, the same ``cuda()`` device).

Why bitwise: with two ranks every reduction is one addition per element (``a + b`` equals
``b + a``), the gradients are weighted before they are packed on both paths, and every
kernel runs on the same emulated device, so the nccl run and the host run must agree bit for
bit: parameters, BatchNorm running statistics, evaluation outputs, resumed runs.

Dropout draws from NumPy's global generator, which thread ranks share; each Dropout call here
reseeds it from (rank, call number) under a lock, so every run makes the same masks whatever
order the threads reach their layers in (the masks differ between ranks, as their data do).
"""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import needle as ndl
import needle.distributed as dist
from needle import nn, optim
from needle.autograd import Tensor

from . import _fake_nccl, _nccl_checks
from ._zero_checks import _BUILD

WORLD = 2
MICRO = (2, 1)  # micro-batches of each step: two (accumulated under no_sync), then one
FEATURES, CLASSES = 16, 3  # 16 features: the CNN's 4x4 images
SIZES = (3, 2)  # unequal shares of the global batch: rank 0 three examples, rank 1 two


@pytest.fixture
def nccl(emulated_cuda, monkeypatch):
    """(the emulated cuda() device, the fake NCCL); the CUDA backend's ``to_numpy`` counts
    its calls per thread (``_nccl_checks._copies``)."""
    from needle.backend_ndarray import ndarray_backend_cuda as backend
    from needle.backend_ndarray._cuda import runtime

    fake = _fake_nccl.install(runtime._cupy)
    monkeypatch.setattr(backend, "to_numpy", _nccl_checks.counted(backend.to_numpy))
    yield emulated_cuda, fake
    _fake_nccl.uninstall(runtime._cupy, fake)


# ---- models, data, Dropout masks ----------------------------------------------------------
def _mlp_resnet(dev):
    from apps.mlp_resnet import MLPResNet

    return MLPResNet(FEATURES, hidden_dim=8, num_blocks=1, num_classes=CLASSES,
                     drop_prob=0.3, device=dev)


def _cnn(dev):
    from apps.training.models import SmallCNN

    return SmallCNN.build(4, CLASSES, dev)


MODELS = {"mlp_resnet": _mlp_resnet, "cnn": _cnn}


class _Calls:
    """The Dropout calls one rank has made (a checkpoint saves it, as it would an RNG)."""

    def __init__(self, start: int = 0):
        self.n = start


def _build(name, dev, rank, seed=0, calls=None):
    """The model, seeded alike on every rank, with its Dropout layers drawing per-rank masks
    in a fixed order (see the module docstring)."""
    with _BUILD:
        np.random.seed(seed)
        model = MODELS[name](dev)
    model.dropout_calls = calls or _Calls()
    for m in model._children():  # every sub-module, depth first
        if isinstance(m, nn.Dropout):
            m.forward = _seeded(m.forward, rank, model.dropout_calls)
    return model


def _seeded(forward, rank, calls):
    def call(x):
        with _BUILD:
            np.random.seed(1000 * rank + calls.n)
            calls.n += 1
            return forward(x)
    return call


def _batch(step: int, rank: int, micro: int):
    """(X, y) of one rank's micro-batch: content and size of its own."""
    rng = np.random.default_rng(100 * step + 10 * rank + micro)
    n = SIZES[rank]
    return (rng.standard_normal((n, FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, n))


def _held_out():
    return np.random.default_rng(7).standard_normal((4, FEATURES)).astype(np.float32)


def _loss(forward, dev, X, y):
    logits = forward(Tensor(X, device=dev, requires_grad=False))
    return nn.SoftmaxLoss()(logits, Tensor(y, device=dev, requires_grad=False))


def _evaluate(model, forward, dev) -> np.ndarray:
    model.eval()
    out = forward(Tensor(_held_out(), device=dev, requires_grad=False)).numpy()
    model.train()
    return out


def _broadcast_buffers(model, src: int = 0) -> None:
    """Rank ``src``'s BatchNorm running statistics onto every rank, in place (each rank's
    own statistics come from its own data: they differ between replicas by design)."""
    for _, t in model.named_buffers():
        dist.broadcast(t, src=src)


# ---- training under either wrapper ----------------------------------------------------------
class _Trainer:
    """DDP (``stage`` 0) or ZeRO (``stage`` 1-3) of one model on one rank: SGD with momentum,
    so a lost optimizer state or a wrong gradient shows in the second step."""

    def __init__(self, name, dev, rank, stage=0, seed=0, calls=None):
        self.dev, self.rank, self.stage = dev, rank, stage
        self.model = _build(name, dev, rank, seed, calls)

    def wrap(self, saved=None) -> "_Trainer":
        """Wrap the model; ``saved``: every rank's :meth:`checkpoint` (the same world size)
        to resume from (the model's own state from this rank's; ZeRO's shards from all)."""
        mine = None if saved is None else saved[self.rank]
        if mine is not None:
            self.model.load_state_dict(mine["model"], strict=not self.stage)
        if self.stage == 0:
            self.wrapper = dist.DistributedDataParallel(self.model, bucket_cap_mb=1e-4)
            self.opt = optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        else:
            self.wrapper = dist.ZeroDataParallel(
                self.model, optimizer=lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
                stage=self.stage, bucket_cap_mb=1e-4)
            self.opt = self.wrapper
        if mine is not None:
            self.opt.load_state_dict(mine["optim"] if self.stage == 0 else
                                     [s["optim"] for s in saved])
        return self

    def steps(self, first: int, last: int) -> int:
        """Steps ``first`` to ``last - 1``; returns the device-to-host copies made by the
        backward passes and the gradient sync."""
        copies = 0
        for step in range(first, last):
            self.opt.zero_grad() if self.stage else self.opt.reset_grad()
            micro = MICRO[step]
            self.wrapper.set_num_examples(micro * SIZES[self.rank])
            before = _nccl_checks._copies()
            for i in range(micro):
                sync = self.wrapper.no_sync() if i < micro - 1 else contextlib.nullcontext()
                with sync:
                    (_loss(self.wrapper, self.dev, *_batch(step, self.rank, i)) / micro
                     ).backward()
            self.wrapper.finish_gradient_sync()
            copies += _nccl_checks._copies() - before
            self.opt.step()
        return copies

    def state(self) -> dict:
        """Parameters (whole, gathered in ZeRO stage 3) and buffers, by name."""
        names = [n for n, _ in self.model.named_parameters()]
        values = (self.wrapper.full_parameters() if self.stage else
                  [p.numpy() for _, p in self.model.named_parameters()])
        out = dict(zip(names, values, strict=True))
        out.update({n: t.numpy() for n, t in self.model.named_buffers()})
        return out

    def checkpoint(self) -> dict:
        """This rank's model state (ZeRO: its buffers; the weights are in the shards), its
        optimizer state (ZeRO: its shard of weights and moments) and its Dropout count."""
        model = self.model.state_dict() if self.stage == 0 else \
            {n: t.numpy() for n, t in self.model.named_buffers()}
        return {"model": model, "optim": self.opt.state_dict(),
                "dropout_calls": self.model.dropout_calls.n}

    def finish(self) -> dict:
        """The trained state, this rank's evaluation, and the evaluation once every rank
        holds rank 0's BatchNorm statistics."""
        out = {"state": self.state(), "eval": _evaluate(self.model, self.wrapper, self.dev)}
        _broadcast_buffers(self.model)
        out["eval_synced"] = _evaluate(self.model, self.wrapper, self.dev)
        return out


def _job(name, dev, stage=0):
    def job(rank):
        trainer = _Trainer(name, dev, rank, stage).wrap()
        copies = trainer.steps(0, len(MICRO))
        return {"copies": copies, **trainer.finish()}
    return job


def _spawn(job, fake, backend):
    """``job(rank)`` on thread ranks of ``backend``, each on a stream of its own (a stream
    other than the null one, so a call issued on the wrong stream shows); each result gets
    its rank's stream and the (kind, stream) of the NCCL calls that rank made."""
    start = len(fake.calls)

    def main(rank):
        with _fake_nccl.FakeStream() as stream:
            return {"stream": stream.ptr, **job(rank)}

    kw = {"backend": backend} if backend == "nccl" else {}
    results = dist.spawn_threads(main, WORLD, timeout=120, **kw)
    calls = fake.calls[start:]
    for rank, r in enumerate(results):
        r["nccl"] = {(c["kind"], c.get("stream")) for c in calls if c["rank"] == rank and
                     c["kind"] != "destroy"}
    return results


_RUNS: dict = {}


def _run(name, dev, stage, backend, fake):
    """The results of one uninterrupted run per rank, made once per session (each costs
    seconds on the emulator; the resume test reuses the nccl run)."""
    key = (name, stage, backend)
    if key not in _RUNS:
        _RUNS[key] = _spawn(_job(name, dev, stage), fake, backend)
    return _RUNS[key]


# ---- the checks ----------------------------------------------------------------------------
def _same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


def _is_statistic(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("running_")


def _check(on_nccl, on_host, kinds):
    """nccl equals the host backend, rank by rank and bit for bit; parameters are the same
    on every rank, statistics are each rank's own until rank 0's are broadcast. Every NCCL
    call went on its rank's current stream, and no gradient went through host memory."""
    assert [r["copies"] for r in on_nccl] == [0] * WORLD
    for r in on_nccl:
        assert {kind for kind, _ in r["nccl"]} >= set(kinds), r["nccl"]
        assert {stream for _, stream in r["nccl"]} == {r["stream"]}
    for rank, (got, want) in enumerate(zip(on_nccl, on_host, strict=True)):
        _same(got["state"], want["state"], f"rank {rank}")
        np.testing.assert_array_equal(got["eval"], want["eval"])
        np.testing.assert_array_equal(got["eval_synced"], want["eval_synced"])
    first = on_nccl[0]
    stats = [k for k in first["state"] if _is_statistic(k)]
    assert stats, "the model has no BatchNorm statistics"
    for got in on_nccl[1:]:
        _same({k: v for k, v in got["state"].items() if not _is_statistic(k)},
              {k: v for k, v in first["state"].items() if not _is_statistic(k)}, "parameters")
        np.testing.assert_array_equal(got["eval_synced"], first["eval_synced"])
        # the ranks saw different data: their own statistics differ until rank 0's are sent
        assert any(not np.array_equal(got["state"][k], first["state"][k]) for k in stats)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_ddp_over_nccl_equals_ddp_over_the_host_backend(nccl, name):
    dev, fake = nccl
    _check(_run(name, dev, 0, "nccl", fake), _run(name, dev, 0, "thread", fake),
           ["allReduce", "broadcast"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_over_nccl_equals_zero_over_the_host_backend(nccl, stage):
    dev, fake = nccl
    _check(_run("mlp_resnet", dev, stage, "nccl", fake),
           _run("mlp_resnet", dev, stage, "thread", fake), ["reduce", "broadcast"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_a_resumed_nccl_run_equals_the_uninterrupted_one(nccl, tmp_path, stage):
    """DDP (stage 0) or ZeRO stage 3: each rank saves its checkpoint after the first step
    (needle's save), a fresh model (other initial weights) loads it, every rank's for ZeRO's
    shards, and takes the second step."""
    dev, fake = nccl

    def job(rank):
        first = _Trainer("mlp_resnet", dev, rank, stage).wrap()
        first.steps(0, 1)
        ndl.save(first.checkpoint(), str(tmp_path / f"rank{rank}.ndl"))
        first.wrapper.close()
        dist.barrier()  # every rank's file is written
        saved = [ndl.load(str(tmp_path / f"rank{r}.ndl")) for r in range(WORLD)]
        calls = _Calls(int(saved[rank]["dropout_calls"]))
        resumed = _Trainer("mlp_resnet", dev, rank, stage, seed=1, calls=calls).wrap(saved)
        copies = resumed.steps(1, len(MICRO))
        return {"copies": copies, **resumed.finish()}

    uninterrupted = _run("mlp_resnet", dev, stage, "nccl", fake)
    _check(_spawn(job, fake, "nccl"), uninterrupted, ["broadcast"])


# ---- apps/train.py --backend nccl ----------------------------------------------------------
SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]


def _train(backend: str, out: Path) -> tuple[dict, str]:
    """apps/train.py, default model, ddp on two ranks of ``backend`` on the emulated cuda()
    (scripts/train_emulated.py); (summary.json, the launcher's output)."""
    cmd = [sys.executable, str(SCRIPTS / "train_emulated.py"), "--device", "cuda",
           "--nproc", "2", "--backend", backend, "--strategy", "ddp", "--seed", "3",
           "--max-steps", "2", "--epochs", "1", "--batch-size", "8", "--hidden", "8",
           "--no-progress", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), run.stdout


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_py_ddp_over_nccl_reports_what_the_tcp_run_reports(tmp_path):
    """The same seed, the same emulated device: the same accuracy, losses, parameters and
    BatchNorm statistics (rank 0's), and every rank's NCCL carried the gradients."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: no CUDA emulator")
    on_nccl, out = _train("nccl", tmp_path / "nccl")
    on_tcp, _ = _train("tcp", tmp_path / "tcp")
    calls = [line.split("NCCL CALLS ", 1)[1].split() for line in out.splitlines()
             if "NCCL CALLS " in line]
    assert len(calls) == 2 and all("allReduce" in c[1:] for c in calls), out[-2000:]
    assert on_nccl["config"]["backend"] == "nccl" and on_tcp["config"]["backend"] == "tcp"
    for key in ("accuracy", "losses", "final_test_loss", "params_sha256", "buffers_sha256"):
        assert on_nccl[key] == on_tcp[key], key
