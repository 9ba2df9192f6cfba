"""The step loop every strategy shares: data order, step count, faults, evaluation, history.

The loop is the same on every rank; the strategy decides what a step computes there, and
its meters (``metrics.py``) what is measured between steps: after the run's first step,
after each epoch's last step (where the epoch is logged) and at the end. Only the reporting
rank keeps the history and returns the summary (other ranks return None).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from needle.distributed import tracing

from . import trace
from .checkpoints import Cursor, RunCheckpoints
from .data import global_batches, load_data, replica_share, steps_per_epoch
from .debugging import ReplicaCheck, anomaly_mode
from .faults import parse_faults
from .metrics import RunMetrics
from .model_state import split_state
from .models import build_model, build_optimizer, device_by_name
from .summary import build_summary


@dataclass
class RunContext:
    """What a strategy may use to build its part of the job."""

    cfg: object
    device: object
    in_features: int
    classes: int
    rank: int
    world_size: int

    def new_model(self):
        """The configured model, initialised from ``--seed`` (identical on every rank)."""
        import needle as ndl

        np.random.seed(self.cfg.seed)
        ndl.random.seed(self.cfg.seed)
        return build_model(self.cfg.model, self.in_features, self.classes, self.cfg.hidden,
                           self.device)

    def new_optimizer(self, params):
        cfg = self.cfg
        return build_optimizer(cfg.optimizer, params, cfg.learning_rate, cfg.weight_decay)


@dataclass
class History:
    epoch: list = field(default_factory=list)
    train_loss: list = field(default_factory=list)
    train_acc: list = field(default_factory=list)
    test_loss: list = field(default_factory=list)
    test_acc: list = field(default_factory=list)
    examples_per_s: list = field(default_factory=list)


@dataclass
class _Epoch:
    loss_sum: float = 0.0
    correct: int = 0
    seen: int = 0

    def add(self, result) -> None:
        self.loss_sum += result.loss_sum
        self.correct += result.correct
        self.seen += result.examples


def _progress_bar(cfg, strategy, total: int, desc: str):
    """One process: a tqdm bar (off with --no-progress). Under the launcher: rank 0 draws the
    bar, the other ranks log a few plain lines (needle.distributed.progress)."""
    if strategy.distributed:
        from needle.distributed.progress import progress_bar

        return progress_bar(total=total, desc=desc, enabled=cfg.progress)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True,
                disable=not cfg.progress)


# long: the step loop; every rank's collectives (meters, checks, saves) in one visible order
def run(cfg, strategy, rank: int = 0, world_size: int = 1) -> dict | None:
    """Train as ``cfg`` says with ``strategy``; the summary on the reporting rank, else None."""
    device = device_by_name(cfg.device)
    X, y, Xt, yt = load_data(cfg)
    classes = int(max(y.max(), yt.max())) + 1
    faults = parse_faults(cfg, world_size)
    strategy.setup(RunContext(cfg, device, X.shape[1], classes, rank, world_size))
    if strategy.serving:
        return strategy.run_server(X, Xt, yt, device)
    ledger = _start_ledger(cfg, rank)
    checkpoints = RunCheckpoints(cfg, strategy, rank, world_size, ledger)
    cursor = checkpoints.restore() or Cursor()
    replicas, index = strategy.data_shard()
    _skip_to(cursor, strategy.start_step(), X.shape[0], cfg, replicas)
    history = History(**cursor.history) if cursor.history else History()
    metrics = RunMetrics(strategy.meters())
    checks = ReplicaCheck(cfg.check_replicas, strategy, rank)
    metrics.start()
    started = time.perf_counter()
    max_steps = cfg.max_steps if cfg.max_steps is not None else math.inf
    while cursor.epoch <= cfg.epochs and cursor.steps < max_steps:
        stats = _Epoch(**cursor.epoch_stats) if cursor.epoch_stats else _Epoch()
        epoch_start = time.perf_counter()
        batches = [b for b in global_batches(X.shape[0], cfg.batch_size, cfg.seed, cursor.epoch)
                   if len(b) >= replicas]  # every replica needs at least one example
        bar = _progress_bar(cfg, strategy, min(len(batches), max_steps - cursor.steps),
                            f"epoch {cursor.epoch}/{cfg.epochs}")
        while cursor.batch_index < len(batches) and cursor.steps < max_steps:
            began = time.perf_counter()
            faults.before_step(rank, cursor.steps + 1)
            step = cursor.steps + 1
            trace.fault_delay(faults, rank, began)
            strategy.on_micro_batch = lambda done, step=step: faults.after_micro_batch(step, done)
            share = replica_share(batches[cursor.batch_index], replicas, index)
            Xs, ys = X[share], y[share]
            if ledger is not None:  # the meters' predictions draw on copies, not the run's
                ledger.stop()
            with tracing.span("metrics", "metrics"):  # predictions, on copies of the model
                metrics.before_step(Xs, ys)
            if ledger is not None:
                ledger.start()
            faults.plant(rank, step, strategy)
            with anomaly_mode(cfg, rank, step):
                result = strategy.train_step(Xs, ys)
            faults.after_step(rank, step, strategy)
            trace.step_done(began, step)
            cursor.steps += 1
            cursor.batch_index += 1
            metrics.after_step(last=cursor.batch_index >= len(batches)
                               or cursor.steps >= max_steps)
            checks.after_step(step)
            if result is not None:
                cursor.losses.append(result.loss)
                stats.add(result)
                bar.set_postfix(loss=f"{result.loss:.4f}")
            bar.update(1)
            cursor.epoch_stats, cursor.history = asdict(stats), asdict(history)
            checkpoints.maybe_save(cursor)
        bar.close()
        evaluated = strategy.evaluate(Xt, yt)
        if strategy.is_reporter and stats.seen:
            rate = stats.seen / max(time.perf_counter() - epoch_start, 1e-9)
            _record_epoch(history, cursor.epoch, stats, evaluated, rate)
        if cursor.batch_index >= len(batches):
            cursor.epoch, cursor.batch_index, cursor.epoch_stats = cursor.epoch + 1, 0, None
    wall = time.perf_counter() - started
    state = strategy.model_state()  # collective where the model is sharded
    state_digest = strategy.state_sha256()
    strategy.collect_reports()
    metrics.finish()  # collective where distributed
    if ledger is not None:
        ledger.stop()
        ledger.flush(ledger_path(cfg.rng_ledger, rank, world_size))
    if not strategy.is_reporter:
        return None
    params, buffers = split_state(strategy.template, state)
    summary = build_summary(cfg, strategy, device, history, cursor.losses, cursor.steps, wall,
                            params, X.shape[0], Xt.shape[0],
                            steps_per_epoch(X.shape[0], cfg.batch_size), buffers)
    summary.update(metrics.summary_blocks())
    summary["state_sha256"] = state_digest
    summary["model_state"] = state
    summary["resume"] = checkpoints.report()
    summary.update(checks.blocks())
    return summary


def _skip_to(cursor, steps: int, n: int, cfg, replicas: int) -> None:
    """Advance ``cursor`` by whole steps, without running them, until ``steps`` are done."""
    while cursor.steps < steps and cursor.epoch <= cfg.epochs:
        count = len([b for b in global_batches(n, cfg.batch_size, cfg.seed, cursor.epoch)
                     if len(b) >= replicas])
        take = min(count - cursor.batch_index, steps - cursor.steps)
        cursor.steps += take
        cursor.batch_index += take
        if cursor.batch_index >= count:
            cursor.epoch, cursor.batch_index = cursor.epoch + 1, 0


def ledger_path(base: str, rank: int, world_size: int) -> str:
    """The RNG ledger file of ``rank`` (``base`` itself for a single process)."""
    return base if world_size == 1 else f"{base}.rank{rank}"


def _start_ledger(cfg, rank: int):
    if not cfg.rng_ledger:
        return None
    from needle.train_state import RNGLedger

    return RNGLedger(rank).start()


def _record_epoch(history: History, epoch: int, stats: _Epoch, evaluated, rate: float) -> None:
    test_loss, test_acc = evaluated
    for key, value in (("epoch", epoch), ("train_loss", stats.loss_sum / stats.seen),
                       ("train_acc", stats.correct / stats.seen), ("test_loss", test_loss),
                       ("test_acc", test_acc), ("examples_per_s", rate)):
        getattr(history, key).append(value)
    print(f"epoch {epoch:3d}  loss {history.train_loss[-1]:.4f}  "
          f"train acc {history.train_acc[-1]:.4f}  held-out acc {test_acc:.4f}  "
          f"{rate:,.0f} examples/s", flush=True)
