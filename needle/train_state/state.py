""":class:`TrainState`: one object holding everything a run needs to continue exactly."""
from __future__ import annotations

from typing import Any, Callable

from .. import random as _random
from .._core.errors import SerializationError, add_note
from .store import read_checkpoint, write_checkpoint

STATE_FORMAT_VERSION = 1


class TrainState:
    """Model, optimizer, loss scaler, data loader, random streams and extras, as one state.

    Every part is optional; each is saved through its own ``state_dict()`` and restored
    through ``load_state_dict()``. The random streams (all of them, NumPy's global generator
    included) are always saved. ``extra`` is a dict of plain values (step counter,
    accumulation phase, loss history, ...) restored as it was saved.

    Args:
        model, optimizer, scaler, loader: objects with ``state_dict`` / ``load_state_dict``.
        extra: free-form JSON-like values and arrays.
        parts: further named objects with ``state_dict`` / ``load_state_dict``.

    Example:
        >>> import numpy as np, needle as ndl
        >>> from needle.train_state import TrainState
        >>> ndl.random.seed(1); s = TrainState(extra={"step": 3}).state_dict()
        >>> a = ndl.random.rand(2); TrainState().load_state_dict(s)
        >>> bool((a == ndl.random.rand(2)).all())
        True
    """

    def __init__(self, model=None, optimizer=None, scaler=None, loader=None,
                 extra: dict | None = None, **parts):
        self.parts = {"model": model, "optimizer": optimizer, "scaler": scaler,
                      "loader": loader, **parts}
        self.extra = dict(extra or {})

    def state_dict(self) -> dict:
        """A nested dict of NumPy arrays and plain values (what :func:`ndl.save` holds)."""
        state: dict[str, Any] = {"format_version": STATE_FORMAT_VERSION,
                                 "rng": _random.get_state(), "extra": self.extra}
        for name, part in self.parts.items():
            if part is not None:
                state[name] = part.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore every part this TrainState holds from ``state``, all or nothing: when a
        part refuses its state, the parts already restored get back what they held (each
        part's ``state_dict()`` is taken first, one extra copy while loading) and the error
        is raised.

        Raises:
            SerializationError: for a state of a newer format, or one that lacks a part
                this TrainState holds; whatever a part's ``load_state_dict`` raises.
        """
        version = state.get("format_version")
        if not isinstance(version, int) or version > STATE_FORMAT_VERSION:
            raise SerializationError(
                f"TrainState.load_state_dict: format version {version!r} is newer than this "
                f"needle reads, expected <= {STATE_FORMAT_VERSION}")
        missing = [name for name, part in self.parts.items()
                   if part is not None and name not in state]
        if missing:
            raise SerializationError(
                f"TrainState.load_state_dict: the saved state lacks {missing}, expected "
                f"{sorted(k for k in state if k not in ('format_version', 'rng', 'extra'))}")
        held = {name: part.state_dict() for name, part in self.parts.items()
                if part is not None}
        rng = _random.get_state()
        try:
            for name in held:
                self.parts[name].load_state_dict(state[name])
            _random.set_state(state["rng"])  # last: loading parts must not move the streams
        except BaseException as exc:
            self._roll_back(held, rng, exc)
            raise
        self.extra = dict(state.get("extra", {}))

    def _roll_back(self, held: dict, rng, exc: BaseException) -> None:
        for name, part_state in held.items():
            try:
                self.parts[name].load_state_dict(part_state)
            except Exception as again:  # noqa: BLE001 - report, keep restoring the others
                add_note(exc, f"TrainState.load_state_dict: restoring {name} after the "
                              f"failure failed too: {again!r}")
        _random.set_state(rng)

    def save(self, directory: str, step: int, *, rank: int = 0, world_size: int = 1,
             keep: int | None = 3, barrier: Callable[[], None] | None = None,
             meta: dict | None = None, run_id: str | None = None) -> str:
        """Write this rank's shard of checkpoint ``step`` under ``directory`` (see
        :func:`~needle.train_state.write_checkpoint`: ``step >= 0``, ``keep >= 1`` or None,
        ``run_id`` the run the directory must belong to); returns the checkpoint directory."""
        return write_checkpoint(directory, step, self.state_dict(), rank=rank,
                                world_size=world_size, keep=keep, barrier=barrier, meta=meta,
                                run_id=run_id)

    def load(self, directory: str, *, rank: int = 0, world_size: int = 1, device=None,
             run_id: str | None = None, adopt_run: bool = False) -> dict:
        """Restore from the newest complete checkpoint under ``directory`` (or that
        checkpoint directory itself), saved by ``world_size`` ranks, all or nothing (see
        :meth:`load_state_dict`); returns its manifest. A newer checkpoint skipped is
        reported as a warning with the reason. A checkpoint of another run than the
        directory's (or than ``run_id``) is refused unless ``adopt_run``.

        Raises:
            SerializationError: see :func:`~needle.train_state.read_checkpoint`.
        """
        manifest, shard = read_checkpoint(directory, rank, device=device,
                                          world_size=world_size, run_id=run_id,
                                          adopt_run=adopt_run)
        self.load_state_dict(shard)
        return manifest
