"""The step loop every strategy shares: data order, step count, faults, evaluation, history.

The loop is the same on every rank; the strategy decides what a step computes there. Only the
reporting rank keeps the history and returns the summary (other ranks return None).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .data import global_batches, load_data, replica_share, steps_per_epoch
from .faults import parse_faults
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


def _progress_bar(cfg, strategy, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True,
                disable=not (cfg.progress and strategy.is_reporter))


def run(cfg, strategy, rank: int = 0, world_size: int = 1) -> dict | None:
    """Train as ``cfg`` says with ``strategy``; the summary on the reporting rank, else None."""
    device = device_by_name(cfg.device)
    X, y, Xt, yt = load_data(cfg)
    classes = int(max(y.max(), yt.max())) + 1
    faults = parse_faults(cfg, world_size)
    strategy.setup(RunContext(cfg, device, X.shape[1], classes, rank, world_size))
    replicas, index = strategy.data_shard()
    history, losses, steps = History(), [], 0
    started = time.perf_counter()
    max_steps = cfg.max_steps if cfg.max_steps is not None else math.inf
    for epoch in range(1, cfg.epochs + 1):
        epoch_stats, epoch_start = _Epoch(), time.perf_counter()
        batches = [b for b in global_batches(X.shape[0], cfg.batch_size, cfg.seed, epoch)
                   if len(b) >= replicas]  # every replica needs at least one example
        bar = _progress_bar(cfg, strategy, min(len(batches), max_steps - steps),
                            f"epoch {epoch}/{cfg.epochs}")
        for indices in batches:
            if steps >= max_steps:
                break
            faults.before_step(rank, steps + 1)
            share = replica_share(indices, replicas, index)
            result = strategy.train_step(X[share], y[share])
            steps += 1
            if result is not None:
                losses.append(result.loss)
                epoch_stats.loss_sum += result.loss_sum
                epoch_stats.correct += result.correct
                epoch_stats.seen += result.examples
                bar.set_postfix(loss=f"{result.loss:.4f}")
            bar.update(1)
        bar.close()
        evaluated = strategy.evaluate(Xt, yt)
        if strategy.is_reporter and epoch_stats.seen:
            rate = epoch_stats.seen / max(time.perf_counter() - epoch_start, 1e-9)
            _record_epoch(history, epoch, epoch_stats, evaluated, rate)
        if steps >= max_steps:
            break
    wall = time.perf_counter() - started
    params = strategy.full_parameters()
    if not strategy.is_reporter:
        return None
    return build_summary(cfg, strategy, device, history, losses, steps, wall, params,
                         X.shape[0], Xt.shape[0], steps_per_epoch(X.shape[0], cfg.batch_size))


def _record_epoch(history: History, epoch: int, stats: _Epoch, evaluated, rate: float) -> None:
    test_loss, test_acc = evaluated
    for key, value in (("epoch", epoch), ("train_loss", stats.loss_sum / stats.seen),
                       ("train_acc", stats.correct / stats.seen), ("test_loss", test_loss),
                       ("test_acc", test_acc), ("examples_per_s", rate)):
        getattr(history, key).append(value)
    print(f"epoch {epoch:3d}  loss {history.train_loss[-1]:.4f}  "
          f"train acc {history.train_acc[-1]:.4f}  held-out acc {test_acc:.4f}  "
          f"{rate:,.0f} examples/s", flush=True)
