"""The step loop every strategy shares: data order, step count, faults, evaluation, history.

The loop is the same on every rank; the strategy decides what a step computes there, and
its meters (``metrics.py``) what is measured between steps: after the run's first step,
after each epoch's last step (where the epoch is logged) and at the end. Only the reporting
rank keeps the history and returns the summary (other ranks return None).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import trace
from .checkpoints import Cursor, RunCheckpoints
from .data import global_batches, load_data, replica_share, steps_per_epoch
from .debugging import ReplicaCheck, anomaly_mode
from .faults import parse_faults
from .metrics import RunMetrics
from .model_state import split_state
from .models import build_model, build_optimizer, device_by_name
from .summary import build_summary


class Interrupted(Exception):
    """Ctrl-C (SIGINT) stopped the step loop after ``steps`` steps on this rank."""

    def __init__(self, steps: int):
        super().__init__(f"interrupted at step {steps}")
        self.steps = steps


class _Stop:
    """SIGINT: inside the step loop it asks the loop to stop at the next step boundary (every
    rank stops between the same collectives, no interrupt lands in the middle of one);
    elsewhere, or asked twice, it raises KeyboardInterrupt."""

    asked = False
    soft = False

    @classmethod
    def handler(cls, _sig, _frame) -> None:
        again, cls.asked = cls.asked, True
        if again or not cls.soft:
            raise KeyboardInterrupt


def install_interrupt_handler() -> None:
    """Route SIGINT through :class:`_Stop` (main thread only)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _Stop.handler)


def interrupt_asked() -> bool:
    return _Stop.asked


class NothingToTrain(Exception):
    """``--resume`` loaded a checkpoint that is already at or past the run's last step."""


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
    _announce_resume(cfg, checkpoints, cursor, X.shape[0], replicas)
    metrics = RunMetrics(strategy.meters())
    checks = ReplicaCheck(cfg.check_replicas, strategy, rank)
    metrics.start()
    started = time.perf_counter()
    max_steps = cfg.max_steps if cfg.max_steps is not None else math.inf
    _Stop.soft = True
    try:
        _steps(cfg, strategy, rank, cursor, history, metrics, checks, checkpoints, faults,
               ledger, (X, y, Xt, yt), replicas, index, max_steps)
    except Exception:
        if _Stop.asked:  # a peer that stopped first ends a collective here
            raise Interrupted(cursor.steps) from None
        raise
    except KeyboardInterrupt:
        raise Interrupted(cursor.steps) from None
    finally:
        _Stop.soft = False
    wall = time.perf_counter() - started
    return _finish(cfg, strategy, device, history, cursor, wall, metrics, ledger, rank,
                   world_size, checkpoints, checks, X.shape[0], Xt.shape[0])


# long: the step loop itself, one visible order of every rank's collectives
def _steps(cfg, strategy, rank, cursor, history, metrics, checks, checkpoints, faults, ledger,
           data, replicas: int, index: int, max_steps) -> None:
    X, y, Xt, yt = data
    while cursor.epoch <= cfg.epochs and cursor.steps < max_steps:
        stats = _Epoch(**cursor.epoch_stats) if cursor.epoch_stats else _Epoch()
        epoch_start = time.perf_counter()
        batches = [b for b in global_batches(X.shape[0], cfg.batch_size, cfg.seed, cursor.epoch)
                   if len(b) >= replicas]  # every replica needs at least one example
        bar = _progress_bar(cfg, strategy, min(len(batches), max_steps - cursor.steps),
                            f"epoch {cursor.epoch}/{cfg.epochs}")
        ran = 0  # steps of this epoch run here (a resume may start at its very end)
        while cursor.batch_index < len(batches) and cursor.steps < max_steps:
            if _Stop.asked:
                raise Interrupted(cursor.steps)
            began = time.perf_counter()
            faults.before_step(rank, cursor.steps + 1)
            step = cursor.steps + 1
            trace.fault_delay(faults, rank, began)
            strategy.on_micro_batch = lambda done, step=step: faults.after_micro_batch(step, done)
            share = replica_share(batches[cursor.batch_index], replicas, index)
            Xs, ys = X[share], y[share]
            if ledger is not None:  # the meters' predictions draw on copies, not the run's
                ledger.stop()
            with trace.span("metrics", "metrics"):  # predictions, on copies of the model
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
            ran += 1
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
            # an epoch whose steps all ran before the checkpoint completes the history
            # quietly: this run did not train it
            _record_epoch(history, cursor.epoch, stats, evaluated, rate, show=ran > 0)
        if cursor.batch_index >= len(batches):
            cursor.epoch, cursor.batch_index, cursor.epoch_stats = cursor.epoch + 1, 0, None


def _finish(cfg, strategy, device, history, cursor, wall, metrics, ledger, rank, world_size,
            checkpoints, checks, n_train: int, n_test: int) -> dict | None:
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
                            params, n_train, n_test,
                            steps_per_epoch(n_train, cfg.batch_size), buffers)
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


def _total_steps(n: int, cfg, replicas: int) -> int:
    """The steps the whole run takes: ``--epochs`` of batches, capped by ``--max-steps``."""
    total = sum(len([b for b in global_batches(n, cfg.batch_size, cfg.seed, epoch)
                     if len(b) >= replicas]) for epoch in range(1, cfg.epochs + 1))
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


def _announce_resume(cfg, checkpoints, cursor, n: int, replicas: int) -> None:
    """After ``--resume``: say where the run continues from, or stop when nothing is left."""
    report = checkpoints.report()
    if report is None:
        return
    total = _total_steps(n, cfg, replicas)
    if cursor.steps > total:  # at the end exactly, the run reports what it holds
        limit = f"--max-steps {cfg.max_steps}" if cfg.max_steps is not None and \
            cfg.max_steps <= total else f"--epochs {cfg.epochs}"
        if checkpoints.speaks:
            print(f"resume: {report['path']} is at step {cursor.steps}; {limit} ends at step "
                  f"{total}: nothing left to train", file=sys.stderr, flush=True)
        raise NothingToTrain(report["path"])
    if checkpoints.speaks:
        print(f"resumed from {report['path']} ({cursor.steps} of {total} steps done)",
              flush=True)


def _record_epoch(history: History, epoch: int, stats: _Epoch, evaluated, rate: float,
                  show: bool = True) -> None:
    test_loss, test_acc = evaluated
    for key, value in (("epoch", epoch), ("train_loss", stats.loss_sum / stats.seen),
                       ("train_acc", stats.correct / stats.seen), ("test_loss", test_loss),
                       ("test_acc", test_acc), ("examples_per_s", rate)):
        getattr(history, key).append(value)
    if show:
        print_epoch(epoch, history.train_loss[-1], history.train_acc[-1], test_acc, rate)


def print_epoch(epoch: int, loss: float, train_acc: float, test_acc: float | None,
                rate: float) -> None:
    """The line each trained epoch prints (every strategy: the rank that has the numbers);
    ``test_acc`` None where no rank holds the whole model until the end."""
    held_out = "" if test_acc is None else f"held-out acc {test_acc:.4f}  "
    print(f"epoch {epoch:3d}  loss {loss:.4f}  train acc {train_acc:.4f}  {held_out}"
          f"{rate:,.0f} examples/s", flush=True)
