"""ZeRO's weights in and out: publishing updated pieces, whole weights and gradients on
demand, checkpoints and the traffic model (mixed into :class:`ZeroDataParallel`)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from ..collectives import all_gather_v
from ..grad_sync import Bucket, GradSync
from .shards import Entry, flat_view, host, mine, new_flat, pack_mine, to_device, unpack_all


class ZeroWeights:
    """Everything ZeroDataParallel does with whole weights; expects its attributes
    (``entries``, ``sync``, ``units``, ``comm``, ``inner``, ``stage``, ``rank``)."""

    entries: list[Entry]
    sync: GradSync
    units: Any
    comm: Any
    inner: Any
    stage: int
    rank: int

    def _members(self, bucket: Bucket) -> list[Entry]:
        return [self.entries[m] for m in bucket.members]

    def _all_gather_weights(self) -> None:
        """Stages 1-2: every rank's updated pieces into every rank's whole weights."""
        works: list[tuple[Bucket, Any, Any]] = []
        for bucket in self.sync.buckets:
            flat = new_flat(bucket.layout.numel, bucket.dtype, self.sync.device)
            pieces = mine(self._members(bucket), bucket.dtype, self.sync.device)
            pack_mine(bucket.layout, pieces, self.rank, flat)
            works.append((bucket, flat, all_gather_v(flat, bucket.layout.bounds, self.comm,
                                                     async_op=True)))
        for bucket, flat, work in works:
            work.wait()
            for e, full in zip(self._members(bucket), unpack_all(bucket.layout, flat),
                               strict=True):
                data = to_device(full, e, "weight", e.shape)
                e.param.cached_data = data
                if e.shard is not None:
                    rebind = getattr(self.inner, "rebind", None)
                    view = flat_view(data, e.lo, e.hi)
                    if rebind is not None:
                        rebind(e.shard, view)
                    else:
                        e.shard.cached_data = view

    # ----- whole weights ---------------------------------------------------------------------
    def full_parameters(self) -> list[np.ndarray]:
        """Every parameter as a host array in ``parameters()`` order (collective in stage 3)."""
        if self.units is not None:
            return self.units.gather_all_host()
        return [e.param.numpy() for e in self.entries]

    def full_gradients(self) -> list[np.ndarray]:
        """Every parameter's reduced gradient as a host array, assembled from every rank's
        pieces (collective; after :meth:`finish_gradient_sync`, before the step)."""
        out = []
        for e in self.entries:
            flat = np.zeros(e.size, dtype=e.dtype)
            if e.shard is not None and e.shard.grad is not None:
                flat[e.lo:e.hi] = host(e.shard.grad.realize_cached_data())
            all_gather_v(flat, e.bounds, self.comm)
            out.append(flat.reshape(e.shape))
        return out

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Stage 3: the whole weights in place for the block (collective; others: no-op)."""
        if self.units is None:
            yield
            return
        self.units.materialize_all()
        try:
            yield
        finally:
            self.units.release_all()

    def set_full_weights(self, arrays: list[np.ndarray]) -> None:
        """Install whole weights (host arrays in ``parameters()`` order) on this rank: the
        whole data in stages 1-2, this rank's pieces in stage 3."""
        for e, full in zip(self.entries, arrays, strict=True):
            full = np.asarray(full).reshape(-1)
            if self.stage == 3:
                if e.shard is not None:
                    e.shard.cached_data = to_device(full[e.lo:e.hi], e, "weight")
                e.release()
                continue
            data = to_device(full, e, "weight", e.shape)
            e.param.cached_data = data
            if e.shard is not None:
                e.shard.cached_data = flat_view(data, e.lo, e.hi)

    # ----- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's pieces of the weights and of the optimizer state (docs/zero.md); save
        one per rank."""
        from .state import local_state

        return local_state(self)

    def load_state_dict(self, states: list[dict] | dict) -> None:
        """Restore from the :meth:`state_dict` of *every* rank of a saved run, whatever its
        world size (a different one reshards). A single dict is accepted on one rank."""
        from .state import load_states

        load_states(self, [states] if isinstance(states, dict) else list(states))

    # ----- traffic ---------------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank's ZeRO collectives have sent so far (measured)."""
        return int(self.comm.bytes_sent["ring"])

    def predicted_traffic(self, micro_batches: int = 1) -> dict[str, int]:
        """Bytes this rank sends in one training step, from the layouts (ring: every segment
        but one per collective): gradient reduce-scatter, weight all-gathers (after the step
        in stages 1-2; before each module's forward and backward in stage 3, so once per
        micro-batch when accumulating), their total, and a ring all-reduce of the same
        gradients (what DDP sends) for comparison."""
        rs = sum(b.layout.sent_elements(self.rank, "reduce_scatter") * np.dtype(b.dtype).itemsize
                 for b in self.sync.buckets)
        if self.units is None:
            ag = sum(b.layout.sent_elements(self.rank, "all_gather") * np.dtype(b.dtype).itemsize
                     for b in self.sync.buckets)
        else:
            per_gather = sum(lay.sent_elements(self.rank, "all_gather") * g[0].itemsize
                             for u in self.units.units
                             for g, lay in zip(u.groups, u.layouts, strict=True))
            ag = 2 * int(micro_batches) * per_gather
        ddp = sum(b.layout.sent_elements(self.rank, k) * np.dtype(b.dtype).itemsize
                  for b in self.sync.buckets for k in ("reduce_scatter", "all_gather"))
        return {"reduce_scatter": rs, "all_gather": ag, "total": rs + ag, "ddp_all_reduce": ddp}

