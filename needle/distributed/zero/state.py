"""ZeRO checkpoints: every rank saves its own pieces; any world size can load them.

A rank's state holds, for every parameter, the element range it owns (``lo``, ``hi``), its
piece of the working weights and its pieces of the optimizer state (moments, float32 master
weights), plus the optimizer's hyper-parameters and counters. Loading takes the states of
*all* ranks of the saved run, rebuilds every parameter's whole vectors by concatenating the
pieces in element order, and cuts this run's pieces out of them: the same world size gives
back the very same bytes; another one (4 -> 2, 2 -> 1 ranks) reshards.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from needle._core.errors import SerializationError

FORMAT = "needle.zero-shard"
VERSION = 1


def _shard_index(entries: list) -> dict[int, int]:
    """entry index -> position of its shard parameter in the shard optimizer."""
    out, k = {}, 0
    for e in entries:
        if e.shard is not None:
            out[e.index] = k
            k += 1
    return out


def local_state(zero: Any) -> dict:
    """This rank's pieces (see the module docstring)."""
    inner = zero.inner.state_dict()
    slots = inner["state"]
    index = _shard_index(zero.entries)
    pieces = {}
    for e in zero.entries:
        rec: dict[str, Any] = {"lo": e.lo, "hi": e.hi, "shape": list(e.shape), "dtype": e.dtype}
        if e.shard is not None:
            rec["weight"] = np.asarray(e.shard.numpy()).reshape(-1)
            k = index[e.index]
            rec["state"] = {name: np.asarray(slot[k]).reshape(-1)
                            for name, slot in slots.items() if k in slot}
        else:
            rec["weight"] = np.zeros(0, dtype=e.dtype)
            rec["state"] = {}
        pieces[str(e.index)] = rec
    return {"format": FORMAT, "version": VERSION, "stage": zero.stage, "rank": zero.rank,
            "world_size": zero.world_size, "pieces": pieces,
            "optimizer": {"type": inner["type"], "hyper": inner["hyper"],
                          "extra": inner["extra"]}}


def _check_ranks(states: list[dict]) -> int:
    """The saved run's world size, once every rank's state is there in a format read here."""
    if not states:
        raise SerializationError("ZeroDataParallel.load_state_dict: no shard states, expected "
                                 "the states of every rank of the saved run")
    for s in states:
        if s.get("format") != FORMAT or int(s.get("version", 0)) > VERSION:
            raise SerializationError(
                f"ZeroDataParallel.load_state_dict: not a ZeRO shard of a version this needle "
                f"reads, expected format {FORMAT!r} version <= {VERSION}, got "
                f"{s.get('format')!r} version {s.get('version')!r}")
    world = int(states[0]["world_size"])
    ranks = sorted(int(s["rank"]) for s in states)
    if ranks != list(range(world)):
        raise SerializationError(
            f"ZeroDataParallel.load_state_dict: shards of ranks {ranks}, expected one per rank "
            f"0..{world - 1} of the saved run")
    return world


def _check(states: list[dict], entries: list) -> int:
    world = _check_ranks(states)
    shapes = [tuple(states[0]["pieces"][str(e.index)]["shape"]) if str(e.index) in
              states[0]["pieces"] else None for e in entries]
    wrong = [(e.name, e.shape, s) for e, s in zip(entries, shapes, strict=True) if s != e.shape]
    if wrong or len(states[0]["pieces"]) != len(entries):
        raise SerializationError(
            f"ZeroDataParallel.load_state_dict: the saved model differs, expected "
            f"{len(entries)} parameters with this model's shapes, got "
            f"{len(states[0]['pieces'])}; mismatches (name, expected, got): {wrong[:5]}")
    return world


def _whole(states: list[dict], key: str, index: int, name: str | None = None):
    """Concatenate every rank's piece of parameter ``index`` (None if no rank saved it)."""
    parts = []
    for s in sorted(states, key=lambda s: s["pieces"][str(index)]["lo"]):
        rec = s["pieces"][str(index)]
        if rec["hi"] == rec["lo"]:
            continue
        value = rec[key] if name is None else rec["state"].get(name)
        if value is None:
            return None
        parts.append(np.asarray(value).reshape(-1))
    return np.concatenate(parts) if parts else None


def assemble(states: list[dict]) -> tuple[list[np.ndarray], dict]:
    """The whole training state in the states of every rank of a saved run (any world size):
    ``(weights, optimizer)``, the weights in ``parameters()`` order with their saved shapes
    and dtypes, and the ``state_dict()`` an optimizer over those whole parameters would give
    (each slot, master weights included, reshaped to its parameter's shape).

    A slot that some rank with a non-empty piece did not save (a step not taken yet) is left
    out, as :func:`load_states` leaves it out; a weight no rank saved is zeros.

    Example:
        >>> piece = lambda r, lo, hi: {"lo": lo, "hi": hi, "shape": [3], "dtype": "float32",
        ...     "weight": np.arange(lo, hi, dtype="float32"),
        ...     "state": {"m": np.full(hi - lo, r, "float32")}}
        >>> opt = {"type": "Adam", "hyper": {}, "extra": {"t": 1}}
        >>> states = [{"format": FORMAT, "version": 1, "rank": r, "world_size": 2,
        ...            "pieces": {"0": piece(r, lo, hi)}, "optimizer": opt}
        ...           for r, (lo, hi) in enumerate([(0, 1), (1, 3)])]
        >>> weights, optimizer = assemble(states)
        >>> weights[0].tolist(), optimizer["state"]["m"][0].tolist()
        ([0.0, 1.0, 2.0], [0.0, 1.0, 1.0])
    """
    _check_ranks(states)
    count = len(states[0]["pieces"])
    names = sorted({n for s in states for rec in s["pieces"].values() for n in rec["state"]})
    weights: list = []
    slots: dict[str, dict] = {n: {} for n in names}
    for i in range(count):
        rec = states[0]["pieces"][str(i)]
        shape, dtype = tuple(rec["shape"]), rec["dtype"]
        full = _whole(states, "weight", i)
        size = int(np.prod(shape, dtype=np.int64))
        weights.append((np.zeros(size, dtype) if full is None else full.astype(dtype, copy=False))
                       .reshape(shape))
        for n in names:
            value = _whole(states, "state", i, n)
            if value is not None:
                slots[n][i] = value.reshape(shape)
    opt = states[0]["optimizer"]
    return weights, {"type": opt["type"], "hyper": opt["hyper"], "state": slots,
                     "extra": opt["extra"]}


def load_states(zero: Any, states: list[dict]) -> None:
    """Restore ``zero`` (any world size) from the states of every rank of a saved run."""
    _check(states, zero.entries)
    weights, optimizer = assemble(states)
    index = _shard_index(zero.entries)
    slots: dict[str, dict[int, np.ndarray]] = {n: {} for n in optimizer["state"]}
    for e in zero.entries:
        if e.shard is None:
            continue
        for n, values in optimizer["state"].items():
            if e.index in values:
                slots[n][index[e.index]] = values[e.index].reshape(-1)[e.lo:e.hi]
    zero.set_full_weights([w.astype(e.dtype, copy=False)
                           for e, w in zip(zero.entries, weights, strict=True)])
    zero.inner.load_state_dict({**optimizer, "state": slots})
