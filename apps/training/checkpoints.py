"""Saving and resuming the main job: ``--save-every K --checkpoint-dir D`` and ``--resume D``.

A checkpoint holds, per rank, the strategy's state (model, optimizer, and whatever the
strategy shards), every random stream, the RNG ledger's positions and the loop's cursor
(step, epoch, next batch, the loss history so far). The data order is a pure function of
``(seed, epoch)``, so the cursor is all the data loader needs. Resuming restores all of it at
the same update boundary, so the continuation is the one the uninterrupted run computes.

A checkpoint resumes under another strategy or number of ranks when only the layout differs
(``universal.py``): the saved shards become the single-process training state, which the
resuming strategy cuts its own way; what changes the math is still refused, by name.

``--resume D`` takes the newest *complete* checkpoint under D. Newer ones that are not complete
(no manifest, a shard missing, a checksum that differs) are skipped, each with one line on
stderr, and :meth:`RunCheckpoints.report` (``summary.json``'s ``resume``) says which one was
used and why each newer one was not.
"""
from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field

from . import trace
from .config import UsageError

# Options that may differ between a run and its resumption (they do not change the math).
_FREE = {"out", "progress", "resume", "adopt_run", "checkpoint_dir", "save_every",
         "keep_checkpoints", "max_steps", "epochs", "die_at_step", "die_after_micro_batches",
         "kill_worker", "slow_worker", "freeze_worker", "rng_ledger", "verify_resume"}


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


class RunCheckpoints:
    """Saves and restores one rank's part of the job's checkpoints."""

    def __init__(self, cfg, strategy, rank: int, world_size: int, ledger=None):
        self.cfg, self.strategy, self.rank, self.world_size = cfg, strategy, rank, world_size
        self.ledger = ledger
        self.directory = cfg.checkpoint_dir or cfg.resume or os.path.join(cfg.out, "checkpoints")
        self._report: dict | None = None
        self.run_id: str | None = None  # the resumed run's, which later saves continue

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
        with trace.span("checkpoint save", "checkpoint", step=cursor.steps):
            path = self._state(cursor).save(self.directory, cursor.steps, rank=self.rank,
                                     world_size=self.world_size,
                                     keep=self.cfg.keep_checkpoints, barrier=self._barrier(),
                                     meta={"config": fingerprint(self.cfg),
                                           "strategy": self.strategy.name},
                                     run_id=self.run_id)
        if self.speaks:
            print(f"saved checkpoint step {cursor.steps} → {path}", flush=True)

    @property
    def speaks(self) -> bool:
        """Whether this rank announces saves and resumes: the first rank that saves (a
        parameter server's servers save nothing; its first worker speaks)."""
        return self.rank == getattr(self.strategy, "servers", 0)

    def restore(self) -> Cursor | None:
        """Load the newest complete checkpoint of ``--resume`` (None without ``--resume``).

        The same strategy on the same ranks reads this rank's own shard. A strategy that can
        reshard (zero) reads every rank's shard of a zero run and rebuilds its own pieces
        from them, so the run may have another number of ranks. Any other change of layout
        (strategy, ranks, stage, schedule...) converts: every saved shard is read, turned
        into the single-process training state (``universal.to_full``) and cut again by this
        strategy (``universal.load_full``). In both cases this rank's random streams,
        data-parallel buffers and cursor come from the saved rank it continues
        (``rank % saved ranks``).
        """
        if not self.cfg.resume:
            return None
        from needle.train_state import (
            read_all_shards,
            read_checkpoint,
            read_manifest,
            resolve_checkpoint,
        )

        try:
            # resolved once, then read by path: the report names the checkpoint that was read
            path, skipped = resolve_checkpoint(self.cfg.resume, "--resume",
                                               adopt_run=self.cfg.adopt_run)
        except Exception as exc:  # SerializationError and friends: a usage problem here
            raise UsageError(str(exc)) from None
        self._log(*(f"skipped {p}: {why}" for p, why in skipped))
        try:
            # the run was checked once, above: these reads take the checkpoint resolved
            mode = self._mode(read_manifest(path, adopt_run=True))
            if mode == "own":
                manifest, shard = read_checkpoint(path, self.rank, adopt_run=True)
            else:
                manifest, shards = read_all_shards(path, adopt_run=True)
                continued = self.rank % len(shards)
                shard = shards[continued]
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(f"--resume {self.cfg.resume}: {exc}") from None
        self._check_compatible(manifest, mode)
        if not self.cfg.adopt_run:  # an adopted checkpoint joins the saving folder's run
            self.run_id = manifest.get("run_id")
        if mode == "convert":
            from .universal import load_full, template_model, to_full

            full = to_full(self._saved_strategy(manifest), manifest,
                           [s["strategy"] for s in shards], template_model(self.strategy),
                           continued)
            load_full(self.strategy, full)
            state = self._state(without_strategy=True)
        elif mode == "reshard":
            self.strategy.load_sharded_state([s["strategy"] for s in shards],
                                             shard["strategy"])
            state = self._state(without_strategy=True)
        else:
            state = self._state()
        state.load_state_dict(shard)
        self._report = {"step": int(manifest["step"]), "path": path,
                        "skipped": [{"path": p, "reason": why} for p, why in skipped]}
        if mode == "convert":
            self._report["converted_from"] = self._saved_strategy(manifest)
        self._log(f"from step {manifest['step']}: {path}" + (
            f" (converted from --strategy {self._saved_strategy(manifest)} on "
            f"{manifest['world_size']} ranks)" if mode == "convert" else ""))
        return Cursor(**state.extra["cursor"])

    @staticmethod
    def _saved_strategy(manifest: dict) -> str | None:
        meta = manifest.get("meta", {})
        return meta.get("strategy") or meta.get("config", {}).get("strategy")

    def _mode(self, manifest: dict) -> str:
        """How this rank loads the checkpoint: ``own`` (this rank's shard, same layout),
        ``reshard`` (zero from zero: its own pieces path) or ``convert`` (another layout
        through the full state)."""
        from .universal import LAYOUT_EXTRA

        saved = manifest.get("meta", {}).get("config", {})
        now = fingerprint(self.cfg)
        if self._saved_strategy(manifest) == self.strategy.name and self.strategy.can_reshard:
            return "reshard"
        layout = [(saved.get("extra") or {}).get(k) != (now.get("extra") or {}).get(k)
                  for k in LAYOUT_EXTRA]
        same = (self._saved_strategy(manifest) == self.strategy.name
                and manifest["world_size"] == self.world_size and not any(layout))
        return "own" if same else "convert"

    def report(self) -> dict | None:
        """``summary.json``'s ``resume``: ``{"step", "path", "skipped": [{"path", "reason"}]}``
        of the checkpoint :meth:`restore` loaded, the newer ones it skipped newest first
        (plus ``converted_from``, the saving strategy, when it was converted);
        None without ``--resume``."""
        return self._report

    def _log(self, *lines: str) -> None:
        # every rank resolves the same directory to the same checkpoint: one rank says so
        if self.rank == 0:
            for line in lines:
                print(f"resume: {line}", file=sys.stderr, flush=True)

    def _check_compatible(self, manifest: dict, mode: str) -> None:
        """Refuse a checkpoint whose run computed other steps: any option but the layout
        differs, a strategy whose state does not convert yet, or a BatchNorm model whose
        batches would be cut into another number of normalised pieces."""
        from .universal import (
            CONVERTIBLE,
            batch_pieces,
            has_batchnorm,
            layout_words,
            template_model,
            without_layout,
        )

        saved = manifest.get("meta", {}).get("config", {})
        now = fingerprint(self.cfg)
        if mode == "own":
            self._refuse_differences(saved, now)
            return
        was = self._saved_strategy(manifest)
        for name, role in ((was, "saved by"), (self.strategy.name, "resumed under")):
            if name not in CONVERTIBLE:
                raise UsageError(
                    f"--resume: the checkpoint was saved by --strategy {was} on "
                    f"{manifest['world_size']} ranks, resumed under --strategy "
                    f"{self.strategy.name} on {self.world_size}: a state {role} --strategy "
                    f"{name} cannot be converted, expected the same strategy and ranks or "
                    f"strategies among {', '.join(CONVERTIBLE)}")
        self._refuse_differences(without_layout(saved), without_layout(now))
        if batch_pieces(saved) != batch_pieces(now) and has_batchnorm(template_model(
                self.strategy)):
            raise UsageError(
                f"--resume: --model {now.get('model')} has BatchNorm, which normalises each "
                f"piece of a step's batch with that piece's statistics; the saved run "
                f"({layout_words(saved)}) cut each batch into {batch_pieces(saved)} pieces, "
                f"this one ({layout_words(now)}) into {batch_pieces(now)}: the steps would "
                f"differ, expected the same number of data-parallel replicas x pipeline "
                f"micro-batches")

    @staticmethod
    def _refuse_differences(saved: dict, now: dict) -> None:
        differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if "extra" in differ:  # name the strategy option, not the dict that holds it
            differ.remove("extra")
            a, b = saved.get("extra") or {}, now.get("extra") or {}
            differ += sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            saved, now = {**saved, **a}, {**now, **b}
        if differ:
            detail = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)!r} -> {now.get(k)!r}"
                               for k in differ)
            raise UsageError(f"--resume: options differ from the saved run: {detail}")


def interrupted_line(cfg, steps: int | None) -> str:
    """The one line a run stopped by Ctrl-C prints: where it stood and how to go on."""
    from needle.train_state import latest_checkpoint_report

    # steps is None when no rank could say (mpiexec may kill ranks before they can)
    at = "interrupted" if steps is None else f"interrupted at step {steps}"
    directory = cfg.checkpoint_dir or cfg.resume or os.path.join(cfg.out, "checkpoints")
    newest = None
    if (cfg.save_every or cfg.resume) and os.path.isdir(directory):
        try:
            newest, _ = latest_checkpoint_report(directory)
        except Exception:  # noqa: BLE001 - an unreadable folder: say nothing was found
            newest = None
    if newest is None:
        return f"{at}; no checkpoint was saved"
    step = int(os.path.basename(newest.rstrip(os.sep)).rsplit("-", 1)[-1])
    return f"{at}; newest checkpoint step {step}; continue with --resume {directory}"
