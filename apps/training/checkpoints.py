"""Saving and resuming the main job: ``--save-every K --checkpoint-dir D`` and ``--resume D``.

A checkpoint holds, per rank, the strategy's state (model, optimizer, and whatever the
strategy shards), every random stream, the RNG ledger's positions and the loop's cursor
(step, epoch, next batch, the loss history so far). The data order is a pure function of
``(seed, epoch)``, so the cursor is all the data loader needs. Resuming restores all of it at
the same update boundary, so the continuation is the one the uninterrupted run computes.

``--resume D`` takes the newest *complete* checkpoint under D. Newer ones that are not complete
(no manifest, a shard missing, a checksum that differs) are skipped, each with one line on
stderr, and :meth:`RunCheckpoints.report` (``summary.json``'s ``resume``) says which one was
used and why each newer one was not.
"""
from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field

from .config import UsageError

# Options that may differ between a run and its resumption (they do not change the math).
_FREE = {"out", "progress", "resume", "checkpoint_dir", "save_every", "keep_checkpoints",
         "max_steps", "epochs", "die_at_step", "die_after_micro_batches", "kill_worker",
         "slow_worker", "rng_ledger", "verify_resume"}


@dataclass
class Cursor:
    """Where the loop stands: ``steps`` done, and the next batch of ``epoch`` to run."""

    steps: int = 0
    epoch: int = 1
    batch_index: int = 0
    losses: list = field(default_factory=list)
    history: dict | None = None
    epoch_stats: dict | None = None


def fingerprint(cfg) -> dict:
    """The options a resumed run must share with the run that saved the checkpoint."""
    return {k: v for k, v in asdict(cfg).items() if k not in _FREE}


def _without_layout(config: dict) -> dict:
    """A fingerprint without the options a resharding strategy may change on resume."""
    out = {k: v for k, v in config.items() if k != "nproc"}
    out["extra"] = {k: v for k, v in (config.get("extra") or {}).items() if k != "zero_stage"}
    return out


class RunCheckpoints:
    """Saves and restores one rank's part of the job's checkpoints."""

    def __init__(self, cfg, strategy, rank: int, world_size: int, ledger=None):
        self.cfg, self.strategy, self.rank, self.world_size = cfg, strategy, rank, world_size
        self.ledger = ledger
        self.directory = cfg.checkpoint_dir or cfg.resume or os.path.join(cfg.out, "checkpoints")
        self._report: dict | None = None

    def _state(self, cursor: Cursor | None = None, without_strategy: bool = False):
        from needle.train_state import TrainState

        parts = {} if without_strategy else {"strategy": self.strategy}
        if self.ledger is not None:
            parts["ledger"] = self.ledger
        return TrainState(extra={"cursor": asdict(cursor)} if cursor else None, **parts)

    def _barrier(self):
        if self.world_size == 1:
            return None
        import needle.distributed as dist

        return dist.barrier

    def maybe_save(self, cursor: Cursor) -> None:
        every = self.cfg.save_every
        if not every or cursor.steps % every:
            return
        if self.ledger is not None:  # the draws up to this checkpoint are on disk with it
            from .loop import ledger_path

            self.ledger.flush(ledger_path(self.cfg.rng_ledger, self.rank, self.world_size))
        self._state(cursor).save(self.directory, cursor.steps, rank=self.rank,
                                 world_size=self.world_size, keep=self.cfg.keep_checkpoints,
                                 barrier=self._barrier(),
                                 meta={"config": fingerprint(self.cfg),
                                       "strategy": self.strategy.name})

    def restore(self) -> Cursor | None:
        """Load the newest complete checkpoint of ``--resume`` (None without ``--resume``).

        A strategy that can reshard (zero) reads every rank's shard of the saved run and
        rebuilds its own pieces from them, so the run may have another number of ranks;
        this rank's random streams, buffers and cursor come from the saved rank it continues
        (``rank % saved ranks``). Others read their own shard only.
        """
        if not self.cfg.resume:
            return None
        from needle.train_state import read_all_shards, read_checkpoint, resolve_checkpoint

        try:
            # resolved once, then read by path: the report names the checkpoint that was read
            path, skipped = resolve_checkpoint(self.cfg.resume, "--resume")
        except Exception as exc:  # SerializationError and friends: a usage problem here
            raise UsageError(str(exc)) from None
        self._log(*(f"skipped {p}: {why}" for p, why in skipped))
        try:
            if self.strategy.can_reshard:
                manifest, shards = read_all_shards(path)
                shard = shards[self.rank % len(shards)]
            else:
                manifest, shard = read_checkpoint(path, self.rank)
        except Exception as exc:
            raise UsageError(f"--resume {self.cfg.resume}: {exc}") from None
        self._check_compatible(manifest)
        if self.strategy.can_reshard:
            self.strategy.load_sharded_state([s["strategy"] for s in shards],
                                             shard["strategy"])
            state = self._state(without_strategy=True)
        else:
            state = self._state()
        state.load_state_dict(shard)
        self._report = {"step": int(manifest["step"]), "path": path,
                        "skipped": [{"path": p, "reason": why} for p, why in skipped]}
        self._log(f"from step {manifest['step']}: {path}")
        return Cursor(**state.extra["cursor"])

    def report(self) -> dict | None:
        """``summary.json``'s ``resume``: ``{"step", "path", "skipped": [{"path", "reason"}]}``
        of the checkpoint :meth:`restore` loaded, the newer ones it skipped newest first;
        None without ``--resume``."""
        return self._report

    def _log(self, *lines: str) -> None:
        # every rank resolves the same directory to the same checkpoint: one rank says so
        if self.rank == 0:
            for line in lines:
                print(f"resume: {line}", file=sys.stderr, flush=True)

    def _check_compatible(self, manifest: dict) -> None:
        reshard = self.strategy.can_reshard
        if manifest["world_size"] != self.world_size and not reshard:
            raise UsageError(
                f"--resume: the checkpoint was saved by {manifest['world_size']} ranks, "
                f"expected {self.world_size} (this strategy cannot reshard)")
        saved = manifest.get("meta", {}).get("config", {})
        now = fingerprint(self.cfg)
        if reshard:  # pieces are saved the same way by every stage and number of ranks
            saved, now = _without_layout(saved), _without_layout(now)
        differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if differ:
            detail = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)!r} -> {now.get(k)!r}"
                               for k in differ)
            raise UsageError(f"--resume: options differ from the saved run: {detail}")
