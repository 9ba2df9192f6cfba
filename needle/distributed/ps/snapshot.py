"""Server snapshots: every K updates a server writes its shard, its optimizer state and its
bookkeeping (version, update count, every worker's clock, the counters) to one file; a server
restarted by the launcher loads it and carries on from there.

The file is written through ``needle.save`` (no pickle; written to a temporary name, then
renamed, so a server killed while writing leaves the previous snapshot intact).
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np

FORMAT = 1


def path_for(folder: str, server_index: int) -> str:
    return os.path.join(folder, f"ps_server{server_index}.ndl")


def save(role: Any, folder: str) -> str:
    """Write ``role``'s state (a ServerRole right after an update) and return the path."""
    import needle as ndl

    os.makedirs(folder, exist_ok=True)
    state = {
        "format": FORMAT, "mode": role.mode, "version": role.version, "updates": role.updates,
        "params": [np.ascontiguousarray(p.numpy()) for p in role.params],
        "optimizer": role.optimizer.state_dict(),
        "clocks": [w.clock for w in role.workers],
        "joined": [int(w.joined) for w in role.workers],
        "counters": [role.dropped, role.lost, role.rejoined],
        "staleness": [[int(k), int(v)] for k, v in role.staleness.items()],
        "delay": [[int(k), int(v)] for k, v in role.delay.items()],
        # server 0's model buffers as installed (empty elsewhere, and for a model without any)
        "buffers": [np.ascontiguousarray(t.numpy()) for t in role.ps.buffers_all]
        if role.shard.server == 0 else [],
    }
    path = path_for(folder, role.shard.server)
    ndl.save(state, path)
    return path


def load(role: Any, folder: str) -> bool:
    """Restore ``role`` from its snapshot; False when there is none."""
    import needle as ndl
    from needle.distributed._buffers import borrow

    from .layout import ParameterServerConfigError

    path = path_for(folder, role.shard.server)
    if not os.path.exists(path):
        return False
    state = ndl.load(path)
    if state.get("format") != FORMAT or state.get("mode") != role.mode or len(
            state["params"]) != len(role.params) or len(state["clocks"]) != len(role.workers):
        raise ParameterServerConfigError(
            f"ParameterServer: snapshot {path} does not fit this server, expected format "
            f"{FORMAT}, mode {role.mode!r}, {len(role.params)} parameters and "
            f"{len(role.workers)} workers, got format {state.get('format')}, mode "
            f"{state.get('mode')!r}, {len(state['params'])} parameters and "
            f"{len(state['clocks'])} workers")
    for p, value in zip(role.params, state["params"], strict=True):
        target = borrow(p, "ParameterServer snapshot")
        target.arr[...] = np.asarray(value).reshape(target.arr.shape)
        target.commit()
    role.optimizer.load_state_dict(state["optimizer"])
    for t, value in zip(role.ps.buffers_all, state.get("buffers") or [], strict=False):
        target = borrow(t, "ParameterServer snapshot")
        target.arr[...] = np.asarray(value).reshape(target.arr.shape)
        target.commit()
    role.version, role.updates = int(state["version"]), int(state["updates"])
    for w, clock in zip(role.workers, state["clocks"], strict=True):
        # the workers introduce themselves again and keep the clock saved here
        w.clock, w.joined = int(clock), False
    role.dropped, role.lost, role.rejoined = (int(x) for x in state["counters"])
    role.staleness = Counter({int(k): int(v) for k, v in state["staleness"]})
    role.delay = Counter({int(k): int(v) for k, v in state["delay"]})
    role.restored_from = path
    return True
