"""The debugging tools of the main job (docs/debugging.md): ``--check-replicas`` and
``--detect-anomaly``.

``--detect-anomaly`` runs every training step under ``needle.autograd.detect_anomaly()``: the
first op of the step (forward or backward) whose output holds a NaN or an Inf raises there,
on its own rank, before anything it computed reaches a collective, so no other rank sees the
NaN; :func:`anomaly_mode` adds the step and the rank and ``train.py`` exits with status 5.
The other ranks are stopped by the launcher, as after any rank's error.

``--check-replicas K``: every K steps, data-parallel replicas compare what they should hold
identically, and a difference stops the job.

After every K-th optimizer step each rank digests every replicated tensor (the CRC-32 of its
bytes, exact to the bit, and its float64 sum, to show how far apart two copies are), the
digests are all-gathered (one small collective of ``2 x tensors + 1`` float64 numbers), and
every rank compares them. The rank(s) whose digests differ from the most common ones (rank
0's group on a tie) are named, with the first tensor that differs and the step;
:class:`ReplicasDiverged` stops every rank at once (``train.py`` exits with status 4).

What is replicated depends on the strategy (``Strategy.replicated_state``): under ddp the
parameters and the whole optimizer state; under zero stages 1-2 the parameters only (each
rank's optimizer state and master weights are its own shard, so there is nothing to compare
them with). BatchNorm running statistics differ between replicas by design and are never
compared. The time of each check is measured; ``summary.json`` reports it as
``replica_checks``.
"""
from __future__ import annotations

import time
import zlib
from contextlib import contextmanager

import numpy as np


@contextmanager
def anomaly_mode(cfg, rank: int, step: int):
    """``--detect-anomaly``: run the block under ``detect_anomaly()``; a ``NonFiniteError``
    leaves with ``rank`` and ``step`` attached (nothing at all without the flag)."""
    if not cfg.detect_anomaly:
        yield
        return
    from needle.autograd import NonFiniteError, detect_anomaly

    try:
        with detect_anomaly():
            yield
    except NonFiniteError as exc:
        exc.rank, exc.step = rank, step
        raise


class ReplicasDiverged(RuntimeError):
    """Replicas that should be identical are not (raised on every rank at the same step)."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def tensor_digest(array: np.ndarray) -> tuple[float, float]:
    """(CRC-32 of the bytes, float64 sum) of one array; the CRC fits a float64 exactly."""
    array = np.ascontiguousarray(array)
    total = float(array.sum(dtype=np.float64)) if array.dtype.kind in "fiub" else 0.0
    return float(zlib.crc32(array.view(np.uint8).reshape(-1))), total


def divergence(step: int, names: list[str], digests: list[np.ndarray]) -> str | None:
    """The message naming the ranks whose ``digests`` (one row per rank: structure CRC, then
    CRC and sum per tensor) differ from the most common row, or None when all agree.

    Example:
        >>> a = np.array([7.0, 1.0, 0.5]); b = np.array([7.0, 2.0, 0.75])
        >>> divergence(6, ["w"], [a, b])[:62]
        'replicas diverged at step 6: rank 1 differs from rank 0 in w ('
    """
    keys = [d.tobytes() for d in digests]
    groups: dict[bytes, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    if len(groups) == 1:
        return None
    reference = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    ref = digests[reference[0]]
    odd = [r for r in range(len(keys)) if keys[r] != keys[reference[0]]]
    who = ", ".join(map(str, odd))
    if any(d[0] != ref[0] for d in digests):
        return (f"replicas diverged at step {step}: rank(s) {who} hold a different set of "
                f"replicated tensors than rank {reference[0]} (another model or optimizer)")
    lines = [f"replicas diverged at step {step}:"]
    for r in odd:
        differ = [i for i in range(len(names)) if digests[r][1 + 2 * i] != ref[1 + 2 * i]]
        first = differ[0]
        also = ", ".join(names[i] for i in differ[1:4]) + (", ..." if len(differ) > 4 else "")
        lines.append(f"rank {r} differs from rank {reference[0]} in {names[first]} (float64 "
                     f"sum {float(digests[r][2 + 2 * first])!r}, expected "
                     f"{float(ref[2 + 2 * first])!r}); {len(differ)} of {len(names)} "
                     f"replicated tensors differ" + (f" (also {also})" if also else ""))
    return " ".join(lines) if len(odd) == 1 else "\n  ".join(lines)


def named_arrays(value, path: str, names: list[str] | None = None) -> list[tuple[str, np.ndarray]]:
    """The numeric leaves of a nested state dict as ``(path, array)``; an optimizer's
    per-parameter slot ``state/<slot>/<i>`` is named ``<slot> of <names[i]>``.

    Example:
        >>> [n for n, _ in named_arrays({"state": {"m": {0: [1.0]}}, "t": 3}, "Adam", ["w"])]
        ['Adam m of w', 'Adam t']
    """
    if isinstance(value, dict):
        parts = path.split("/")
        if names is not None and len(parts) == 3 and parts[1] == "state":
            return [(f"{parts[0]} {parts[2]} of {names[int(k)]}", np.asarray(v))
                    for k, v in sorted(value.items(), key=lambda kv: int(kv[0]))]
        out = []
        for key in sorted(value, key=str):
            out += named_arrays(value[key], f"{path}/{key}", names)
        return out
    array = np.asarray(value)
    if array.dtype.kind not in "fiub":  # names, types: not state that can drift
        return []
    return [(path.replace("/", " ").replace(" hyper ", " ").replace(" extra ", " "), array)]


class ReplicaCheck:
    """Every ``every`` steps, compare the strategy's replicated tensors over the ranks."""

    def __init__(self, every: int | None, strategy, rank: int):
        self.every, self.strategy, self.rank = every, strategy, rank
        self.checks, self.seconds, self.bytes = 0, 0.0, 0
        self.compared, self.not_compared = [], None

    def after_step(self, step: int) -> None:
        """Collective every ``every`` steps: raise :class:`ReplicasDiverged` on a difference."""
        if not self.every or step % self.every:
            return
        import needle.distributed as dist

        start = time.perf_counter()
        tensors, self.compared, self.not_compared = self.strategy.replicated_state()
        names = [name for name, _ in tensors]
        mine = np.empty(1 + 2 * len(tensors), np.float64)
        mine[0] = zlib.crc32(repr([(n, np.shape(a)) for n, a in tensors]).encode())
        for i, (_, array) in enumerate(tensors):
            mine[1 + 2 * i:3 + 2 * i] = tensor_digest(array)
        self.bytes = sum(np.asarray(a).nbytes for _, a in tensors)
        everyone = [np.zeros_like(mine) for _ in range(dist.get_world_size())]
        with dist.traffic.label("replica check"):
            dist.all_gather(everyone, mine)
        message = divergence(step, names, everyone)
        self.seconds += time.perf_counter() - start
        self.checks += 1
        if message is not None:
            raise ReplicasDiverged(message, self.rank)

    def blocks(self) -> dict:
        """``summary.json``'s ``replica_checks`` (nothing without ``--check-replicas``)."""
        if not self.every:
            return {}
        return {"replica_checks": {"every": self.every, "checks": self.checks,
                "seconds_per_check": self.seconds / self.checks if self.checks else None,
                "bytes_digested": self.bytes,
                "compared": self.compared, "not_compared": self.not_compared}}
