"""Model-state bytes of a ZeRO rank, measured beside predicted.

The measuring and predicting functions live in :mod:`needle.memory.accounting` (a single
process uses them too) and are re-exported here; :func:`report` reads them for a
:class:`~needle.distributed.ZeroDataParallel` rank.

Example:
    >>> optimizer_kind(type("Adam", (), {})())
    'adam'
"""
from __future__ import annotations

from typing import Any

from needle.memory.accounting import (
    MODEL_STATE,
    measured,
    optimizer_kind,
    precision_of,
    predicted,
)

__all__ = ["MODEL_STATE", "measured", "optimizer_kind", "precision_of", "predicted", "report"]


def report(zero: Any, device: Any = None, baseline: dict | None = None) -> dict:
    """Measured beside predicted for a :class:`ZeroDataParallel` rank (see
    :mod:`needle.memory.accounting`)."""
    device = device if device is not None else zero.entries[0].device
    got = measured(device, baseline)
    want = predicted(zero.module, zero.inner, zero.stage, zero.world_size, zero.rank)
    return {"rank": zero.rank, "measured": got["requested"], "allocated": got["allocated"],
            "predicted": want}
