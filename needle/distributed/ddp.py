"""DistributedDataParallel: gradients all-reduced in buckets while backward is still running.

A thin client of :class:`~needle.distributed.grad_sync.GradSync`: parameters are packed, in
reverse order of ``parameters()``, into buckets of at most ``bucket_cap_mb``; a full bucket
starts an asynchronous all-reduce on the communication thread (in index order on every
rank); ``finish_gradient_sync()`` waits for all of them and writes the averaged gradients
into each parameter's ``.grad``.

Normalisation (GradSync's one rule): the average of the ranks' gradients; after
``ddp.set_num_examples(n)`` (collective) with ``reduction="mean"``, ``sum_r n_r g_r / sum_r
n_r``; with ``reduction="sum"``, ``sum_r g_r / sum_r n_r``. ZeroDataParallel, the mesh's
data axis and the synchronous parameter server use the same arithmetic, bit for bit.
"""
from __future__ import annotations

from typing import Any

from . import traffic
from ._group import resolve
from .collectives import broadcast
from .grad_sync import AllReduceHook, GradSync, SyncedModule

_ADVICE = ("call ddp.finish_gradient_sync() before optimizer.step(), or step the optimizer "
           "returned by ddp.wrap_optimizer(optimizer), which does it (or use ddp.no_sync())")


class DistributedDataParallel(SyncedModule):
    """Data-parallel wrapper of a module; see the module docstring for the contract.

    Args:
        module: an ``nn.Module``; rank 0's parameters are broadcast to all ranks.
        bucket_cap_mb: bucket size in MiB.
        algorithm: all-reduce algorithm, "ring" or "native".
        reduction: "mean" or "sum", what each rank's loss is over its examples (see above).
        overlap: start buckets during backward (True) or all in finish_gradient_sync (False).
        find_unused_parameters: treat parameters whose hook never fired as zero gradients
            instead of raising.
        priority: this many buckets holding the earliest layers (the ones the next forward
            needs first) are all-reduced over a second group, not queued behind the others.

    Example (two thread ranks, one Linear layer):
        >>> import numpy as np, needle.distributed as dist
        >>> from needle import nn
        >>> from needle.autograd import Tensor
        >>> def job(rank):
        ...     ddp = dist.DistributedDataParallel(nn.Linear(2, 1))
        ...     ddp(Tensor(np.full((1, 2), rank + 1.0, np.float32))).sum().backward()
        ...     ddp.finish_gradient_sync()
        ...     return ddp.module.weight.grad.numpy().ravel().tolist()
        >>> dist.spawn_threads(job, 2)
        [[1.5, 1.5], [1.5, 1.5]]
    """

    def __init__(self, module: Any, bucket_cap_mb: float = 25, algorithm: str = "ring",
                 group: Any = None, reduction: str = "mean", overlap: bool = True,
                 find_unused_parameters: bool = False, priority: int = 0):
        self.module = module
        self.group = resolve(group, "DistributedDataParallel")
        self.params = [p for p in module.parameters() if getattr(p, "requires_grad", True)]
        named = {id(p): n for n, p in getattr(module, "named_parameters", list)()}
        self.names = [named.get(id(p), f"parameter {i}") for i, p in enumerate(self.params)]
        self.sync = GradSync(self.params, self.group, AllReduceHook(algorithm), names=self.names,
                             bucket_cap_mb=bucket_cap_mb, reduction=reduction, overlap=overlap,
                             find_unused_parameters=find_unused_parameters, priority=priority,
                             owner="DistributedDataParallel", advice=_ADVICE)
        with traffic.label("ddp set-up"):
            self.sync.check_same_model()  # first: a model mismatch is reported as such
            for p in self.params:
                broadcast(p, src=0, group=self.group)
        self.sync.register()

    def wrap_optimizer(self, optimizer: Any) -> "SyncedOptimizer":
        """An optimizer whose ``step()`` first calls ``finish_gradient_sync()``."""
        return SyncedOptimizer(self, optimizer)

    def close(self) -> None:
        """Remove the hooks and close the priority group, if any."""
        self.sync.close()


class SyncedOptimizer:
    """Delegates to the wrapped optimizer; ``step()`` waits for the gradient buckets first."""

    def __init__(self, ddp: DistributedDataParallel, optimizer: Any):
        self.ddp, self.optimizer = ddp, optimizer

    def step(self) -> None:
        self.ddp.finish_gradient_sync()
        self.optimizer.step()

    def grads_finite(self) -> bool:
        """What ``amp.GradScaler`` asks before a step: the synchronized gradients' answer."""
        return self.ddp.grads_finite()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
