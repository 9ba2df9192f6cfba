"""Fault injection for the main job: these really sleep, really SIGKILL and really SIGSTOP.

``--slow-worker RANK:MS`` makes rank RANK sleep MS milliseconds before every step (a
straggler); ``--kill-worker RANK@STEP`` makes rank RANK SIGKILL itself when step STEP is about
to start; ``--freeze-worker RANK@STEP`` makes rank RANK SIGSTOP itself then instead: its
process stays alive but silent (no heartbeat, no exit), as a rank does that hangs in the
kernel or is suspended by an operator, and only SIGKILL or SIGCONT from outside moves it on;
``--die-at-step N`` makes every rank SIGKILL itself when step N is about to start
(after N − 1 completed steps, and after any checkpoint written at step N − 1; a synchronous
parameter server dies once round N − 1 is applied, see :meth:`Faults.before_round`); with
``--die-after-micro-batches M`` it dies instead after M micro-batches of step N, in the middle
of its gradient accumulation.

Two faults corrupt numbers instead of processes, for the debugging tools (docs/debugging.md):
``--flip-bit RANK@STEP`` makes rank RANK flip one bit (the top mantissa bit) of its first
parameter's first element in place, right after step STEP's update, so its replica silently
differs (``--check-replicas`` finds it); ``--nan-at RANK@STEP`` makes rank RANK add
``log(0)`` (-inf) to its model's output during step STEP, so its loss and gradients become
NaN (``--detect-anomaly`` names the log); ``--skip-layer RANK@STEP`` makes rank RANK detach
its first layer's output during step STEP, so its backward produces no gradient for that
layer's parameters, as a rank whose code took another branch (the gradient sync names them).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from .config import UsageError


@dataclass(frozen=True)
class Faults:
    slow_rank: int | None = None
    slow_ms: float = 0.0
    kill_rank: int | None = None
    kill_step: int | None = None
    freeze_rank: int | None = None
    freeze_step: int | None = None
    die_step: int | None = None
    die_micro: int | None = None  # die after this many micro-batches of die_step instead
    flip: tuple[int, int] | None = None  # (rank, step) of --flip-bit
    nan: tuple[int, int] | None = None  # (rank, step) of --nan-at
    skip: tuple[int, int] | None = None  # (rank, step) of --skip-layer

    def before_step(self, rank: int, step: int) -> None:
        """Apply the faults that concern ``rank`` before step ``step`` (1-based) runs."""
        if self.die_step is not None and step == self.die_step and self.die_micro is None:
            _sigkill_self(f"--die-at-step {step}")
        # a worker restarted by the launcher does not die again at the same step
        if self.kill_rank == rank and step == self.kill_step and not os.environ.get(
                "NEEDLE_DIST_REJOIN"):
            _sigkill_self(f"--kill-worker {rank}@{step}")
        # likewise a restarted worker does not freeze again
        if self.freeze_rank == rank and step == self.freeze_step and not os.environ.get(
                "NEEDLE_DIST_REJOIN"):
            _sigstop_self(f"--freeze-worker {rank}@{step}")
        if self.slow_rank == rank and self.slow_ms > 0:
            time.sleep(self.slow_ms / 1000.0)

    def plant(self, rank: int, step: int, strategy) -> None:
        """Before step ``step`` on ``rank``: ``--nan-at`` and ``--skip-layer`` wrap a forward
        for it."""
        if self.nan == (rank, step):
            _wrap_forward(strategy.model, "--nan-at", _add_log_zero)
        if self.skip == (rank, step):
            _wrap_forward(strategy.model.modules[0], "--skip-layer", lambda out: out.detach())

    def after_step(self, rank: int, step: int, strategy) -> None:
        """After step ``step`` (its update done) on ``rank``: undo the wrappers, apply
        ``--flip-bit``."""
        if self.nan == (rank, step):
            strategy.model.__dict__.pop("forward", None)
        if self.skip == (rank, step):
            strategy.model.modules[0].__dict__.pop("forward", None)
        if self.flip == (rank, step):
            _flip_bit(strategy.model, rank, step)

    def before_round(self, step: int) -> None:
        """A synchronous parameter server that has applied round ``step`` − 1 (and written
        any checkpoint of it): ``--die-at-step step`` kills it too, as its workers die
        before pushing step ``step``. The workers' other faults do not concern servers."""
        if self.die_step is not None and step == self.die_step and self.die_micro is None:
            _sigkill_self(f"--die-at-step {step} (server)")

    def after_micro_batch(self, step: int, done: int) -> None:
        """``--die-after-micro-batches M``: die in step ``step`` once ``done`` == M."""
        if self.die_step == step and self.die_micro == done:
            _sigkill_self(f"--die-at-step {step} --die-after-micro-batches {done}")


# Messages a rank has already sent may still sit in the tcp transport's user-space queue
# (ZeroMQ's I/O thread writes them to the socket a moment later); the fault kills the rank
# between steps, after what it sent has left, as a crash after a kernel write would.
FLUSH_BEFORE_KILL_S = 0.5


def _sigkill_self(reason: str) -> None:
    print(f"train.py: {reason}: sending SIGKILL to myself (pid {os.getpid()})",
          file=sys.stderr, flush=True)
    time.sleep(FLUSH_BEFORE_KILL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _sigstop_self(reason: str) -> None:
    print(f"train.py: {reason}: sending SIGSTOP to myself (pid {os.getpid()})",
          file=sys.stderr, flush=True)
    # as for the kill: the freeze comes between steps, after what the rank sent has left
    # (a frozen process cannot flush the tcp transport's queue, so a push request could
    # arrive without its payload and hold the server for its whole timeout)
    time.sleep(FLUSH_BEFORE_KILL_S)
    os.kill(os.getpid(), signal.SIGSTOP)
    # Only reached after a SIGCONT from outside: carry on where the step was.
    print(f"train.py: {reason}: continued (pid {os.getpid()})", file=sys.stderr, flush=True)


def _add_log_zero(out):
    import needle as ndl

    zeros = ndl.init.zeros(*out.shape, device=out.device, dtype=out.dtype)
    return out + ndl.log(zeros)  # the planted fault: log(0) = -inf


def _wrap_forward(module, flag: str, after) -> None:
    """Make ``module``'s forward return ``after(output)`` (undone by deleting the instance
    attribute; a module whose forward is already an instance attribute is not supported)."""
    if "forward" in module.__dict__:
        raise UsageError(f"{flag}: the forward of {type(module).__name__} is already wrapped")
    original = module.forward
    module.forward = lambda *args, **kwargs: after(original(*args, **kwargs))


def _flip_bit(model, rank: int, step: int) -> None:
    """Flip the top mantissa bit of element 0 of ``model``'s first parameter, in place in its
    buffer, and check that exactly that bit changed."""
    import numpy as np

    name, param = model.named_parameters()[0]
    before = param.numpy().reshape(-1)[:1].copy()
    bits = before.view(np.dtype(f"u{before.itemsize}"))
    bit = np.finfo(before.dtype).nmant - 1
    flipped = (bits ^ bits.dtype.type(1 << bit)).view(before.dtype)
    param.realize_cached_data()[(0,) * len(param.shape)] = float(flipped[0])
    after = param.numpy().reshape(-1)[:1]
    assert (after.view(bits.dtype) ^ bits)[0] == 1 << bit, "the bit did not flip"
    print(f"train.py: --flip-bit {rank}@{step}: flipped bit {bit} of {name}[0]: "
          f"{float(before[0])!r} -> {float(after[0])!r}", file=sys.stderr, flush=True)


def _rank_at_step(spec: str, flag: str) -> tuple[int, int]:
    """``RANK@STEP`` of ``flag`` as two integers, STEP >= 1."""
    rank, sep, step = spec.partition("@")
    if not sep:
        raise UsageError(f"{flag} expects RANK@STEP, got {spec!r}")
    rank_n, step_n = _int(rank, flag, "RANK"), _int(step, flag, "STEP")
    if step_n < 1:
        raise UsageError(f"{flag}: STEP must be >= 1, got {step_n}")
    return rank_n, step_n


def _int(text: str, flag: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{flag}: {what} must be an integer, got {text!r}") from None


def parse_faults(cfg, world_size: int) -> Faults:
    """The :class:`Faults` of ``cfg`` (raises :class:`UsageError` on a malformed spec)."""
    slow_rank = kill_rank = kill_step = freeze_rank = freeze_step = None
    slow_ms = 0.0
    if cfg.slow_worker is not None:
        rank, sep, ms = cfg.slow_worker.partition(":")
        if not sep:
            raise UsageError(f"--slow-worker expects RANK:MS, got {cfg.slow_worker!r}")
        slow_rank = _int(rank, "--slow-worker", "RANK")
        try:
            slow_ms = float(ms)
        except ValueError:
            raise UsageError(f"--slow-worker: MS must be a number, got {ms!r}") from None
        if slow_ms < 0:
            raise UsageError(f"--slow-worker: MS must be >= 0, got {slow_ms}")
    if cfg.kill_worker is not None:
        kill_rank, kill_step = _rank_at_step(cfg.kill_worker, "--kill-worker")
    if getattr(cfg, "freeze_worker", None) is not None:
        freeze_rank, freeze_step = _rank_at_step(cfg.freeze_worker, "--freeze-worker")
    flip = nan = skip = None
    if getattr(cfg, "flip_bit", None) is not None:
        flip = _rank_at_step(cfg.flip_bit, "--flip-bit")
    if getattr(cfg, "nan_at", None) is not None:
        nan = _rank_at_step(cfg.nan_at, "--nan-at")
    if getattr(cfg, "skip_layer", None) is not None:
        skip = _rank_at_step(cfg.skip_layer, "--skip-layer")
    for flag, rank in (("--slow-worker", slow_rank), ("--kill-worker", kill_rank),
                       ("--freeze-worker", freeze_rank), ("--flip-bit", flip and flip[0]),
                       ("--nan-at", nan and nan[0]), ("--skip-layer", skip and skip[0])):
        if rank is not None and not 0 <= rank < world_size:
            raise UsageError(f"{flag}: RANK must be in [0, {world_size}), got {rank}")
    return Faults(slow_rank, slow_ms, kill_rank, kill_step, freeze_rank, freeze_step,
                  cfg.die_at_step, getattr(cfg, "die_after_micro_batches", None), flip, nan, skip)
