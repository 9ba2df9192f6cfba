"""Training state: everything a run needs to continue exactly, saved atomically per rank.

* :class:`TrainState` gathers the model, optimizer, loss scaler, data-loader position, every
  random stream and free-form extras (step counter, accumulation phase, ...) into one state
  dict with a format version.
* :mod:`~needle.train_state.store` writes one file per rank and a manifest last, keeps the
  newest K checkpoints, and finds the newest *complete* one after a crash
  (:func:`~needle.train_state.store.latest_checkpoint_report` says why each newer one was
  skipped).
* :mod:`~needle.train_state.ledger` records every random draw (stream, offset, count, site,
  rank) so that two runs can be compared draw by draw.

Example:
    >>> import tempfile, numpy as np, needle as ndl
    >>> from needle import nn, optim
    >>> from needle.train_state import TrainState, latest_checkpoint
    >>> np.random.seed(0); model = nn.Linear(2, 1); opt = optim.SGD(model.parameters(), lr=0.1)
    >>> state = TrainState(model=model, optimizer=opt, extra={"step": 5})
    >>> d = tempfile.mkdtemp(); path = state.save(d, step=5)
    >>> restored = TrainState(model=model, optimizer=opt); manifest = restored.load(d)
    >>> manifest["step"], restored.extra["step"]
    (5, 5)
"""
from __future__ import annotations

from .ledger import RNGLedger
from .state import STATE_FORMAT_VERSION, TrainState
from .store import (
    incomplete_reason,
    latest_checkpoint,
    latest_checkpoint_report,
    list_checkpoints,
    read_all_shards,
    read_checkpoint,
    read_manifest,
    resolve_checkpoint,
    run_id_of,
    write_checkpoint,
)

__all__ = ["TrainState", "STATE_FORMAT_VERSION", "RNGLedger", "incomplete_reason",
           "latest_checkpoint", "latest_checkpoint_report", "list_checkpoints",
           "read_all_shards", "read_checkpoint", "read_manifest", "resolve_checkpoint",
           "run_id_of", "write_checkpoint"]
