"""An RNG ledger: every draw through ``needle.random``, recorded so two runs can be compared.

Each entry holds the stream the draw came from, its ``offset`` (how many values that stream
had produced before, as this ledger counts), ``count`` (how many it produced now), the draw
function, the shape, the ``site`` (first caller outside needle's random and init code, as
``file:line function``), the rank, and a short hash of the values. Offsets continue across a
resume when the ledger's :meth:`RNGLedger.state_dict` travels with the checkpoint, so a
continuous run and a killed-and-resumed run produce the same ledger exactly when their
randomness agrees; :func:`first_divergence` names the first draw where two ledgers differ.

Example:
    >>> import needle as ndl
    >>> from needle.train_state import RNGLedger
    >>> with RNGLedger() as ledger:
    ...     _ = ndl.random.rand(3); _ = ndl.random.permutation(4)
    >>> [(e["kind"], e["offset"], e["count"]) for e in ledger.entries]
    [('rand', 0, 3), ('permutation', 3, 4)]
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

from .. import random as _random

_SKIP = (os.sep + os.path.join("needle", "random"), os.sep + os.path.join("needle", "init"),
         os.sep + os.path.join("needle", "backend_ndarray"), os.sep + os.path.join(
             "needle", "train_state", "ledger"))


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in _SKIP):
        frame = frame.f_back
    if frame is None:
        return "?"
    owner = frame.f_locals.get("self")
    name = frame.f_code.co_name
    if owner is not None:
        name = f"{type(owner).__name__}.{name}"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {name}"


class RNGLedger:
    """Records every ``needle.random`` draw while started (a context manager, too)."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.entries: list[dict] = []
        self.offsets: dict[str, int] = {}
        self._handle = None

    def start(self) -> "RNGLedger":
        if self._handle is None:
            self._handle = _random.add_draw_observer(self._record)
        return self

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> "RNGLedger":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _record(self, kind: str, stream: str, value) -> None:
        values = np.asarray(value)
        offset = self.offsets.get(stream, 0)
        self.offsets[stream] = offset + int(values.size)
        self.entries.append({
            "stream": stream, "offset": offset, "count": int(values.size), "kind": kind,
            "shape": list(values.shape), "site": _site(), "rank": self.rank,
            "digest": hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()[:16]})

    # ---- travels with a checkpoint ---------------------------------------------------------
    def state_dict(self) -> dict:
        """The stream positions (entries stay in the run's own ledger file)."""
        return {"offsets": dict(self.offsets), "entries_before": len(self.entries)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's positions; draws recorded before (re-initialising
        what the checkpoint replaces) are dropped."""
        self.offsets = {str(k): int(v) for k, v in state.get("offsets", {}).items()}
        self.entries, self._written = [], 0

    _written = 0

    def flush(self, path: str) -> None:
        """Append the entries not yet written to ``path`` (JSON lines), then fsync."""
        with open(path, "a") as f:
            for entry in self.entries[self._written:]:
                f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._written = len(self.entries)


def read_ledger(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


_COMPARED = ("stream", "offset", "count", "kind", "shape", "digest")


def first_divergence(expected: list[dict], got: list[dict]) -> str | None:
    """None when both ledgers record the same draws; else a sentence naming the first one
    that differs (by stream, offset, kind, shape or values) and where it was drawn."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        diff = [k for k in _COMPARED if a.get(k) != b.get(k)]
        if diff:
            return (f"draw {i} differs in {', '.join(diff)}: expected "
                    f"{a['kind']}{tuple(a['shape'])} at {a['stream']}+{a['offset']} from "
                    f"{a['site']} (rank {a['rank']}), got "
                    f"{b['kind']}{tuple(b['shape'])} at {b['stream']}+{b['offset']} from "
                    f"{b['site']} (rank {b['rank']})")
    if len(expected) != len(got):
        longer, name = (expected, "expected") if len(expected) > len(got) else (got, "got")
        extra = longer[min(len(expected), len(got))]
        return (f"the ledgers differ in length, expected {len(expected)} draws, got {len(got)}; "
                f"the first unmatched draw ({name}) is {extra['kind']}{tuple(extra['shape'])} "
                f"from {extra['site']}")
    return None
