"""Server snapshots: a server's shard, its optimizer state and its bookkeeping (version,
update count, every worker's clock, the counters, the loss log; on server 0 the model's
buffers and every worker's latest pushed buffers) as one state dict.

:func:`state` and :func:`restore` are the one definition of that state. Two things use it:

* every K updates a server writes it to one file (:func:`save`); a server restarted by the
  launcher loads it (:func:`load`) and carries on from there;
* a training job's checkpoint (``ParameterServer.state_dict``) holds it as each server's
  part, written at a synchronous round's boundary, and ``--resume`` restores it.

The file is written through ``needle.save`` (no pickle; written to a temporary name, then
renamed, so a server killed while writing leaves the previous snapshot intact).
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np

FORMAT = 2


def path_for(folder: str, server_index: int) -> str:
    """The snapshot file of server ``server_index`` in ``folder``."""
    return os.path.join(folder, f"ps_server{server_index}.ndl")


def _arrays(tensors: list[Any]) -> list[np.ndarray]:
    return [np.ascontiguousarray(t.numpy()) for t in tensors]


def state(role: Any) -> dict:
    """``role``'s whole state (a ServerRole right after an update, when no round is open)."""
    server0 = role.shard.server == 0
    log = role.loss_log
    indices = sorted(role.worker_buffers) if server0 else []
    return {
        "format": FORMAT, "mode": role.mode, "version": role.version, "updates": role.updates,
        "params": _arrays(role.params),
        "optimizer": role.optimizer.state_dict(),
        "clocks": [w.clock for w in role.workers],
        "joined": [int(w.joined) for w in role.workers],
        "counters": [role.dropped, role.lost, role.rejoined],
        "staleness": [[int(k), int(v)] for k, v in role.staleness.items()],
        "delay": [[int(k), int(v)] for k, v in role.delay.items()],
        "traffic": [role.bytes_in, role.bytes_out, role.buffer_bytes_in],
        # (snapshots_written is not restored: it counts this process's writes)
        "max_lead": role.max_lead, "events": list(role.events),
        # (worker, clock, examples, correct) exactly as integers, the loss sums as float64
        "loss_log": np.array([[e[0], e[1], e[2], e[4]] for e in log], np.int64).reshape(-1, 4),
        "loss_sums": np.array([e[3] for e in log], np.float64),
        # server 0's model buffers as installed (empty elsewhere, and for a model without any)
        "buffers": _arrays(role.ps.buffers_all) if server0 else [],
        "worker_buffers": [[i, role.worker_buffers[i][0], list(role.worker_buffers[i][1])]
                           for i in indices],
        "buffers_from": -1 if role.buffers_from is None else role.buffers_from,
    }


def restore(role: Any, saved: dict, origin: str) -> None:
    """Load ``saved`` (a :func:`state` of this server) into ``role``; ``origin`` names where
    it came from (errors and ``stats()["restored_from"]`` say it).

    Raises:
        ParameterServerConfigError: the state is of another format, mode, shard or number
            of workers.
    """
    from needle.distributed._buffers import borrow

    from .layout import ParameterServerConfigError

    shapes = [tuple(np.shape(v)) for v in saved.get("params", [])]
    mine = [tuple(p.shape) for p in role.params]
    if saved.get("format") != FORMAT or saved.get("mode") != role.mode or shapes != mine or len(
            saved.get("clocks", [])) != len(role.workers):
        raise ParameterServerConfigError(
            f"ParameterServer: the server state from {origin} does not fit server "
            f"{role.shard.server}, expected "
            f"format {FORMAT}, mode {role.mode!r}, parameter shapes {mine} and "
            f"{len(role.workers)} workers, got format {saved.get('format')}, mode "
            f"{saved.get('mode')!r}, parameter shapes {shapes} and "
            f"{len(saved.get('clocks', []))} workers")
    for p, value in zip(role.params, saved["params"], strict=True):
        target = borrow(p, "ParameterServer snapshot")
        target.arr[...] = np.asarray(value).reshape(target.arr.shape)
        target.commit()
    role.optimizer.load_state_dict(saved["optimizer"])
    for t, value in zip(role.ps.buffers_all, saved["buffers"], strict=False):
        target = borrow(t, "ParameterServer snapshot")
        target.arr[...] = np.asarray(value).reshape(target.arr.shape)
        target.commit()
    role.version, role.updates = int(saved["version"]), int(saved["updates"])
    for w, clock in zip(role.workers, saved["clocks"], strict=True):
        # the workers introduce themselves again and keep the clock saved here
        w.clock, w.joined = int(clock), False
    role.dropped, role.lost, role.rejoined = (int(x) for x in saved["counters"])
    role.staleness = Counter({int(k): int(v) for k, v in saved["staleness"]})
    role.delay = Counter({int(k): int(v) for k, v in saved["delay"]})
    role.bytes_in, role.bytes_out, role.buffer_bytes_in = (int(x) for x in saved["traffic"])
    role.max_lead = int(saved["max_lead"])
    role.events = [str(e) for e in saved["events"]]
    ints, sums = np.asarray(saved["loss_log"]), np.asarray(saved["loss_sums"])
    role.loss_log = [(int(a), int(b), int(c), float(s), int(d))
                     for (a, b, c, d), s in zip(ints.tolist(), sums.tolist(), strict=True)]
    role.worker_buffers = {int(i): (int(u), [np.asarray(b) for b in bufs])
                           for i, u, bufs in saved["worker_buffers"]}
    role.buffers_from = None if int(saved["buffers_from"]) < 0 else int(saved["buffers_from"])
    role.round = {}
    role.restored_from = origin


def save(role: Any, folder: str) -> str:
    """Write ``role``'s :func:`state` (a ServerRole right after an update) and return the
    path."""
    import needle as ndl

    os.makedirs(folder, exist_ok=True)
    path = path_for(folder, role.shard.server)
    ndl.save(state(role), path)
    return path


def load(role: Any, folder: str) -> bool:
    """Restore ``role`` from its snapshot in ``folder``; False when there is none."""
    import needle as ndl

    path = path_for(folder, role.shard.server)
    if not os.path.exists(path):
        return False
    restore(role, ndl.load(path), path)
    return True
