"""``ZeroDataParallel``: data parallelism with sharded optimizer state, gradients and weights.

Stage 1: every rank keeps the whole model and whole gradients; after backward the gradients
are reduce-scattered (ring, in buckets), each rank updates its 1/N share of every parameter
with an optimizer that holds only that share's state (moments, float32 master weights), and
the updated shares are all-gathered back into the whole weights.
Stage 2: as stage 1, but a gradient is dropped as soon as its bucket is packed, so each rank
keeps only its share of the (reduced) gradients.
Stage 3: also the weights are sharded: a module's parameters are all-gathered right before its
forward and freed right after; gathered again when its backward starts and freed when its
parameters' gradients are final. The next module's gather is started while the current one
computes (``prefetch``).

Sharding rule, memory and traffic: docs/zero.md. What crosses the network is staged through
host buffers (any device works), or on an ``nccl`` group of ``cuda()`` parameters stays on it.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from needle.autograd import Tensor
from needle.memory import framework_category

from .. import _device_buckets
from .._errors import CommError
from .._group import resolve
from ..collectives import broadcast, reduce_scatter_v
from ..grad_sync import Bucket, BucketHook, GradSync, SyncedModule
from .optimizer import ZeroOptimizer
from .shards import Entry, flat_view, piece_of, to_device
from .stage3 import GatherUnits
from .weights import ZeroWeights


class _ScatterHook(BucketHook):
    """ZeRO's bucket collective: a reduce-scatter; each rank keeps its reduced pieces."""

    sharded = True
    device_buckets = True  # on an nccl group of cuda() parameters (_device_buckets)

    def __init__(self, zero: "ZeroDataParallel"):
        self.zero = zero

    def launch(self, bucket: Bucket) -> Any:
        return reduce_scatter_v(bucket.flat, bucket.layout.bounds, "sum", bucket.group,
                                async_op=True)

    def gradient(self, i: int, param: Any, grad: Any) -> Any:
        """Stage 1 after a sync of this step: ``p.grad`` is the synced gradient plus this
        backward's; pack this backward's only (the synced one is still alive: the shard's
        gradient is a view of it), its reduced piece is added to the synced piece."""
        synced = self.zero.entries[i].synced if self.zero.stage == 1 else None
        return grad if synced is None else grad - _device_buckets.values_like(synced, grad)

    def packed(self, i: int, param: Any) -> None:
        if self.zero.stage == 1:
            self.zero._own_grad(param)
        else:
            param.grad = None  # this rank keeps only its reduced piece (stage 2)

    def finish(self, bucket: Bucket, params: list) -> None:
        pieces = _device_buckets.unpack_bucket_mine(bucket, self.zero.rank)
        for m, piece in zip(bucket.members, pieces, strict=True):
            self.zero._take_piece(self.zero.entries[m], piece)
        bucket.flat = None  # the full-size buffer lives only while the bucket is in flight

    def finite(self, params: list) -> bool:
        return all(np.isfinite(e.shard.grad.numpy()).all() for e in self.zero.entries
                   if e.shard is not None and e.shard.grad is not None)


class ZeroDataParallel(SyncedModule, ZeroWeights):
    """ZeRO data parallelism over the ranks of ``group`` (see the module docstring).

    Args:
        module: an ``nn.Module``; rank 0's parameters are broadcast at construction.
        optimizer: ``lambda params: optim.Adam(params, lr=...)``, called with this rank's
            shard parameters (1-D Tensors, one per parameter whose piece is not empty).
        stage: 1, 2 or 3.
        bucket_cap_mb: gradient bucket size in MiB (full-gradient bytes).
        group: the process group (default: the world); ZeRO's own traffic runs on a private
            group over the same ranks, so it is measured on its own (``bytes_sent``); call
            :meth:`close` when done with this wrapper to stop that group's thread.
        prefetch: stage 3: start gathering the next module's weights while one computes.
        find_unused_parameters: treat parameters that got no gradient as zero gradients.

    Example (two thread ranks):
        >>> import numpy as np, needle.distributed as dist
        >>> from needle import nn, optim
        >>> from needle.autograd import Tensor
        >>> def job(rank):
        ...     np.random.seed(0)
        ...     zero = dist.ZeroDataParallel(nn.Linear(3, 1), stage=3,
        ...                                  optimizer=lambda ps: optim.SGD(ps, lr=0.5))
        ...     zero(Tensor(np.ones((1, 3)) * (rank + 1))).sum().backward()
        ...     zero.step()
        ...     return [round(float(v), 4) for v in zero.full_parameters()[0].ravel()]
        >>> a, b = dist.spawn_threads(job, 2); a == b
        True
    """

    def __init__(self, module: Any, optimizer: Callable[[list], Any], stage: int = 2,
                 bucket_cap_mb: float = 25, group: Any = None, prefetch: bool = True,
                 find_unused_parameters: bool = False):
        if stage not in (1, 2, 3):
            raise CommError(f"ZeroDataParallel: stage must be 1, 2 or 3, got {stage!r}")
        if not callable(optimizer):
            raise CommError(f"ZeroDataParallel: optimizer must be a callable params -> "
                            f"optimizer, got {type(optimizer).__name__}")
        self.module, self.stage = module, stage
        self.group = resolve(group, "ZeroDataParallel")
        from ..process_group import new_group

        self.comm = new_group(self.group.ranks)  # ZeRO's data traffic, counted on its own
        self.rank, self.world_size = self.group.rank, self.group.size
        self.find_unused_parameters = find_unused_parameters
        named = {id(p): n for n, p in getattr(module, "named_parameters", list)()}
        params = [p for p in module.parameters() if getattr(p, "requires_grad", True)]
        self.entries = [Entry(i, named.get(id(p), f"parameter {i}"), p, self.rank,
                              self.world_size) for i, p in enumerate(params)]
        units = GatherUnits(self, prefetch) if stage == 3 else None
        self.sync = GradSync(
            [e.param for e in self.entries], self.comm, _ScatterHook(self),
            names=[e.name for e in self.entries], bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters, count_group=self.group,
            on_hook=None if units is None else (lambda i: units.grad_ready(self.entries[i])),
            owner="ZeroDataParallel", advice="call zero.step() or zero.finish_gradient_sync()")
        self.sync.check_same_model()
        for e in self.entries:
            broadcast(e.param, src=0, group=self.comm)
        self.units = units
        self._make_shards()
        self.inner = optimizer([e.shard for e in self.entries if e.shard is not None])
        self.optimizer = ZeroOptimizer(self, self.inner)
        self.sync.register()
        self._seen_grads: set[int] = set()  # stage 1: gradient buffers already made own
        self.steps = 0

    # ----- setup ----------------------------------------------------------------------------
    def _make_shards(self) -> None:
        for e in self.entries:
            data = e.param.realize_cached_data()
            if self.stage == 3:  # the piece becomes this rank's own copy; the rest goes
                piece = piece_of(data, e, self.sync.device)
                e.make_shard(to_device(piece, e, "weight") if e.numel else None)
                e.release()
            else:
                e.make_shard(flat_view(data, e.lo, e.hi) if e.numel else None)
        if self.units is not None:
            self.units.attach()

    def set_num_examples(self, n: float) -> None:
        """GradSync's weighting rule (so DDP and ZeRO give bitwise-equal gradients)."""
        self.sync.set_num_examples(n)
        self.denominators = {"local": self.sync.counts[0], "global": self.sync.counts[1]}

    # ----- gradients -------------------------------------------------------------------------
    def _own_grad(self, p: Any) -> None:
        """Stage 1 writes the reduced piece back into ``p.grad``: make sure that buffer is
        compact and belongs to ``p`` alone (the engine may hand one gradient to two leaves)."""
        data = p.grad.realize_cached_data()
        handle = getattr(data, "_handle", None)
        compact = getattr(data, "is_compact", lambda: False)()
        if handle is None or not compact or id(handle) in self._seen_grads:
            with framework_category("gradient"):
                data = _device_buckets.copy(data) if self.sync.device is not None else \
                    Tensor(data.numpy(), device=p.device, dtype=str(p.dtype),
                           requires_grad=False).realize_cached_data()
            p.grad = Tensor.make_const(data)
            handle = getattr(data, "_handle", data)
        self._seen_grads.add(id(handle))

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket and hand each shard parameter its reduced gradient piece.
        Called by :meth:`step`; idempotent within a step."""
        if self.sync.finish():
            self._seen_grads.clear()
            if self.units is not None:
                self.units.release_all()

    def _take_piece(self, e: Entry, piece: Any) -> None:  # host values or a device view
        if not e.numel:
            return
        on_host = isinstance(piece, np.ndarray)
        if self.stage == 1 and e.param.grad is not None:  # into the whole gradient's slice
            if e.synced is not None:  # a second synced backward: add to the synced piece
                piece = piece + _device_buckets.values_like(e.shard.grad, piece)
            grad = e.param.grad.realize_cached_data()
            view = flat_view(grad, e.lo, e.hi)
            view[slice(None)] = to_device(piece, e, "gradient") if on_host else piece
            e.shard.grad = Tensor.make_const(view)
            e.synced = e.param.grad  # its other ranks' slices are this rank's, unreduced
            return
        value = to_device(piece, e, "gradient")
        if e.grad is not None:  # a second synced backward before the step: accumulate
            with framework_category("gradient"):
                value = e.grad + value
        e.grad = value
        e.shard.grad = Tensor.make_const(value)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Finish the gradient sync, then clip the reduced gradients by the whole model's L2
        norm, the one a single process would compute (collective; ``dist.clip_grad_norm``
        over this wrapper's group: each element lives in exactly one rank's piece, so the
        pieces' squared sums add up to the whole). Returns the norm before clipping.

        Example (two thread ranks, the same input: the gradient [3, 4] is split in two):
            >>> import numpy as np, needle.distributed as dist
            >>> from needle import nn, optim
            >>> from needle.autograd import Tensor
            >>> def job(rank):
            ...     zero = dist.ZeroDataParallel(nn.Linear(2, 1, bias=False), stage=2,
            ...                                  optimizer=lambda ps: optim.SGD(ps, lr=1.0))
            ...     zero(Tensor(np.array([[3.0, 4.0]]))).sum().backward()
            ...     norm = zero.clip_grad_norm(1.0)
            ...     zero.close()
            ...     return round(norm, 4)
            >>> dist.spawn_threads(job, 2)
            [5.0, 5.0]
        """
        from ..clip import clip_grad_norm

        self.finish_gradient_sync()
        shards = [e for e in self.entries if e.shard is not None]
        before = [e.shard.grad for e in shards]
        norm = clip_grad_norm([e.shard for e in shards], max_norm, group=self.group)
        if self.stage == 1:  # write the clipped pieces back into the whole gradients' slices,
            for e, old in zip(shards, before, strict=True):  # so no second buffer stays alive
                if e.shard.grad is old or e.param.grad is None:
                    continue
                view = flat_view(e.param.grad.realize_cached_data(), e.lo, e.hi)
                view[slice(None)] = e.shard.grad.realize_cached_data()
                e.shard.grad = Tensor.make_const(view)
        return norm

    # ----- the step --------------------------------------------------------------------------
    def step(self) -> None:
        """Finish the gradient sync, update this rank's shard, publish the weights."""
        self.finish_gradient_sync()
        self.inner.step()
        if self.stage < 3:
            self._all_gather_weights()
        self.steps += 1

    def zero_grad(self) -> None:
        """Drop every gradient: whole ones, reduced pieces and the shard parameters'."""
        for e in self.entries:
            e.param.grad = None
            e.grad = e.synced = None
            if e.shard is not None:
                e.shard.grad = None

    reset_grad = zero_grad

    def remove_hooks(self) -> None:
        """Detach from the module: gradient hooks, stage-3 forward wrappers."""
        self.sync.remove_hooks()
        if self.units is not None:
            self.units.detach()

    def close(self) -> None:
        """:meth:`remove_hooks` and close ZeRO's private process group (the module keeps
        whatever data its parameters hold now; gather first in stage 3 if it must be whole)."""
        self.sync.close()
        self.remove_hooks()
        self.comm.destroy()

