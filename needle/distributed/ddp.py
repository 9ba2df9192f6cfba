"""DistributedDataParallel: gradients all-reduced in buckets while backward is still running.

A thin client of :class:`~needle.distributed.grad_sync.GradSync`: parameters are packed, in
reverse order of ``parameters()``, into buckets of at most ``bucket_cap_mb``; a full bucket
starts an asynchronous all-reduce on the communication thread (in index order on every
rank); ``finish_gradient_sync()`` waits for all of them and writes the averaged gradients
into each parameter's ``.grad``.

Normalisation (GradSync's one rule). Default: the average of the ranks' gradients, the
gradient of the global mean loss when every rank holds the same number of examples. For
unequal counts call ``ddp.set_num_examples(n)`` each step (collective: it sums the counts):
with ``reduction="mean"`` (local loss = mean over n local examples) the result is
``sum_r n_r g_r / sum_r n_r``; with ``reduction="sum"`` (local loss = sum over the
examples, also right for no_sync accumulation) it is ``sum_r g_r / sum_r n_r``. Each rank's
weight is applied to its gradient in the gradient's dtype before the sum (a float16
gradient never overflows on the way); ZeroDataParallel, the mesh's data axis and the
synchronous parameter server use the same arithmetic, bit for bit.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from . import traffic
from ._group import resolve
from .collectives import broadcast
from .grad_sync import AllReduceHook, GradSync

_ADVICE = ("call ddp.finish_gradient_sync() before optimizer.step(), or step the optimizer "
           "returned by ddp.wrap_optimizer(optimizer), which does it (or use ddp.no_sync())")


class DistributedDataParallel:
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

    @property
    def buckets(self) -> list:
        return self.sync.buckets

    @property
    def timeline(self) -> list[dict]:
        """Per synchronized step: hook times and each bucket's ready/launch/start/done."""
        return self.sync.timeline

    @property
    def events(self) -> list[tuple[str, int, float]]:
        """``("ready", parameter, time)`` and ``("launch", bucket, time)``, in order."""
        return self.sync.events

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def parameters(self) -> list[Any]:
        return self.module.parameters()

    def set_num_examples(self, n: float) -> None:
        """Examples (or valid tokens) this rank's loss covers in this step; see the module doc
        (collective: every rank calls it, before the step's backward)."""
        self.sync.set_num_examples(n)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside syncs."""
        with self.sync.no_sync():
            yield

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket and write the synchronized gradients into ``p.grad``.

        Call after backward and before the optimizer step (``wrap_optimizer`` does it).
        """
        self.sync.finish()

    def grads_finite(self) -> bool:
        """Whether every synchronized gradient is finite (finishes the sync first)."""
        return self.sync.grads_finite()

    def wrap_optimizer(self, optimizer: Any) -> "SyncedOptimizer":
        """An optimizer whose ``step()`` first calls ``finish_gradient_sync()``."""
        return SyncedOptimizer(self, optimizer)

    def remove_hooks(self) -> None:
        self.sync.remove_hooks()

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
