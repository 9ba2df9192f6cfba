"""DistributedDataParallel: gradients all-reduced in buckets while backward is still running.

Parameters are packed, in reverse order of ``parameters()`` (the order backward usually makes
their gradients ready), into buckets of at most ``bucket_cap_mb``. A post-accumulate-grad hook
copies each finished gradient into its bucket; a full bucket starts an asynchronous all-reduce
on the communication thread (buckets start in index order on every rank, so the collectives
match). ``finish_gradient_sync()`` waits for all buckets and writes the averaged gradients back
into each parameter's ``.grad`` in place.

Normalisation. Default: the average of the ranks' gradients (summed, then divided by the
world size), which is the gradient of the global mean loss when every rank holds the same
number of examples. For unequal counts call ``ddp.set_num_examples(n)`` each step (collective:
it sums the counts over the ranks): with ``reduction="mean"`` (local loss = mean over n local
examples) the result is sum_r n_r g_r / sum_r n_r, each gradient multiplied by its weight
n_r / sum_r n_r in its own dtype before the sum (so a float16 gradient never overflows on the
way; ZeroDataParallel and the synchronous parameter server use the same arithmetic); with
``reduction="sum"`` (local loss = sum over the examples, the sum-then-divide contract, also
right for no_sync accumulation) the result is sum_r g_r / sum_r n_r.
"""
from __future__ import annotations

import time
import zlib
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from . import traffic
from ._buffers import borrow
from ._errors import CommError, GraphError
from ._group import resolve
from .collectives import all_gather, all_reduce, broadcast


class _Bucket:
    def __init__(self, index: int, dtype: str, members: list[int], sizes: list[int]):
        self.index, self.dtype, self.members = index, dtype, members
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        self.flat = np.zeros(self.offsets[-1], dtype=dtype)
        self.work: Any = None
        self.pending = len(members)
        self.ready_at: float | None = None
        self.launched_at: float | None = None


def _plan(params: list[Any], cap_bytes: int) -> list[tuple[str, list[int]]]:
    """Bucket membership: reverse parameter order, one dtype per bucket, at most cap bytes
    (a parameter larger than the cap gets a bucket of its own)."""
    plan: list[tuple[str, list[int]]] = []
    open_bucket: dict[str, tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        dtype = str(params[i].dtype)
        nbytes = int(np.prod(params[i].shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        members, used = open_bucket.get(dtype, ([], 0))
        if members and used + nbytes > cap_bytes:
            plan.append((dtype, members))
            members, used = [], 0
        open_bucket[dtype] = (members + [i], used + nbytes)
    plan += [(dtype, members) for dtype, (members, _) in open_bucket.items() if members]
    return plan


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
                 find_unused_parameters: bool = False):
        if reduction not in ("mean", "sum"):
            raise CommError(f"DistributedDataParallel: reduction must be 'mean' or 'sum', "
                            f"got {reduction!r}")
        self.module = module
        self.group = resolve(group, "DistributedDataParallel")
        self.algorithm, self.reduction, self.overlap = algorithm, reduction, overlap
        self.find_unused_parameters = find_unused_parameters
        self.params = [p for p in module.parameters() if getattr(p, "requires_grad", True)]
        self.names = self._names(module)
        plan = _plan(self.params, int(bucket_cap_mb * 2**20))
        with traffic.label("ddp set-up"):
            self._check_plan(plan)  # first: a model mismatch is reported as such, on every rank
            self._broadcast_parameters()
        self.buckets = [
            _Bucket(i, dtype, members,
                    [int(np.prod(self.params[m].shape, dtype=np.int64)) for m in members])
            for i, (dtype, members) in enumerate(plan)
        ]
        self._where = {m: (b, j) for b in self.buckets for j, m in enumerate(b.members)}
        # the traffic ledger's expectation for one synchronized step: a ring all-reduce of
        # every bucket, 2(n-1)/n of its bytes each way (traffic.py)
        n, r = self.group.size, self.group.rank
        self.expected_traffic = [traffic.ring_all_reduce_bytes(b.flat.size, b.flat.itemsize,
                                                                n, r) for b in self.buckets]
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                         for i, p in enumerate(self.params)]
        self._sync = True
        self._total: float | None = None  # all ranks' examples (set_num_examples)
        self._weight: float | None = None  # this rank's n_r / total (reduction "mean")
        self.timeline: list[dict] = []
        self.events: list[tuple[str, int, float]] = []
        self._reset()

    # ----- setup ------------------------------------------------------------------------
    def _names(self, module: Any) -> list[str]:
        if hasattr(module, "named_parameters"):
            named = {id(p): n for n, p in module.named_parameters()}
            return [named.get(id(p), f"parameter {i}") for i, p in enumerate(self.params)]
        return [f"parameter {i}" for i in range(len(self.params))]

    def _describe(self, i: int) -> str:
        return f"{self.names[i]!r} (shape {tuple(self.params[i].shape)})"

    def _broadcast_parameters(self) -> None:
        for p in self.params:
            broadcast(p, src=0, group=self.group)

    def _check_plan(self, plan: list[tuple[str, list[int]]]) -> None:
        text = repr([(d, [tuple(self.params[m].shape) for m in ms]) for d, ms in plan])
        mine = np.array([zlib.crc32(text.encode()), len(plan)], dtype=np.int64)
        everyone = [np.zeros(2, np.int64) for _ in range(self.group.size)]
        all_gather(everyone, mine, group=self.group)
        differ = [r for r, h in enumerate(everyone) if not np.array_equal(h, everyone[0])]
        if differ:
            raise CommError(
                f"DistributedDataParallel: ranks {differ} have a different bucket plan than "
                f"rank 0 (different model or bucket_cap_mb), expected {int(everyone[0][1])} "
                f"buckets with rank 0's shapes, got this rank's plan {text[:300]}"
            )

    # ----- per step ---------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def parameters(self) -> list[Any]:
        return self.module.parameters()

    def set_num_examples(self, n: float) -> None:
        """Examples (or valid tokens) this rank's loss covers in this step; see the module doc
        (collective: every rank calls it, before the step's backward)."""
        total = np.array([float(n)], np.float64)
        with traffic.label("ddp example count"):
            all_reduce(total, "sum", self.group)
        if total[0] <= 0:
            raise CommError(f"DistributedDataParallel: total examples over ranks must be "
                            f"positive, got {total[0]}")
        self._total = float(total[0])
        self._weight = float(n) / self._total if self.reduction == "mean" else None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside syncs."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _reset(self) -> None:
        self._fired: set[int] = set()
        self._next_launch = 0
        self._step: dict = {"buckets": []}
        for b in self.buckets:
            b.pending, b.work, b.ready_at, b.launched_at = len(b.members), None, None, None

    def _hook_for(self, i: int):
        def hook(p: Any) -> None:
            if self._sync:
                self._on_grad(i, p)

        return hook

    def _on_grad(self, i: int, p: Any) -> None:
        now = time.perf_counter()
        if i in self._fired:
            raise GraphError(
                f"DistributedDataParallel: the gradient hook of {self._describe(i)} fired twice "
                "in one synchronized step, expected once per step: after each backward call "
                "ddp.finish_gradient_sync() before optimizer.step(), or step the optimizer "
                "returned by ddp.wrap_optimizer(optimizer), which does it; to accumulate "
                "gradients over several backward passes, run all but the last inside "
                "`with ddp.no_sync():`"
            )
        if not self._fired:  # the first gradient of a synchronized step
            book = self.group.traffic
            book.mark_step()
            book.expect("ddp gradients", sum(s for s, _ in self.expected_traffic),
                        sum(r for _, r in self.expected_traffic),
                        f"ring all-reduce of {len(self.buckets)} buckets: 2(n-1)/n x M each")
        self._fired.add(i)
        self._step.setdefault("first_hook", now)
        self._step["last_hook"] = now
        bucket, j = self._where[i]
        slot = bucket.flat[bucket.offsets[j]:bucket.offsets[j + 1]]
        grad = borrow(p.grad, "DistributedDataParallel", readonly=True).arr.reshape(-1)
        if self._weight is not None:
            np.multiply(grad, grad.dtype.type(self._weight), out=slot)
        else:
            slot[...] = grad
        self.events.append(("ready", i, now))
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready_at = now
            if self.overlap:
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Start buckets strictly in index order so every rank issues the same sequence."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending:
                return
            bucket.launched_at = time.perf_counter()
            self.events.append(("launch", bucket.index, bucket.launched_at))
            with traffic.label("ddp gradients"):
                bucket.work = all_reduce(bucket.flat, "sum", self.group, async_op=True,
                                         algorithm=self.algorithm)
            self._next_launch += 1

    def _fill_unused(self) -> None:
        missing = [i for i in range(len(self.params)) if i not in self._fired]
        if missing and not self.find_unused_parameters:
            names = ", ".join(self._describe(i) for i in missing[:8])
            raise GraphError(
                f"DistributedDataParallel: rank {self.group.rank}: {len(missing)} parameter(s) "
                f"got no gradient in this backward, expected all {len(self.params)}: {names} "
                "(unused in forward? pass find_unused_parameters=True)"
            )
        for i in missing:
            bucket, j = self._where[i]
            bucket.flat[bucket.offsets[j]:bucket.offsets[j + 1]] = 0
            bucket.pending -= 1
            bucket.ready_at = time.perf_counter()

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket and write the synchronized gradients into ``p.grad``.

        Call after backward and before the optimizer step (``wrap_optimizer`` does it).
        """
        if not self._sync or not self._fired:
            return
        self._step["finish_called"] = time.perf_counter()
        self._fill_unused()
        self._launch_ready()
        for bucket in self.buckets:
            bucket.work.wait()
        divisor = self._divisor()
        for bucket in self.buckets:
            if divisor != 1.0:
                bucket.flat /= bucket.flat.dtype.type(divisor)
            for j, i in enumerate(bucket.members):
                part = bucket.flat[bucket.offsets[j]:bucket.offsets[j + 1]]
                self._write_grad(self.params[i], part.reshape(self.params[i].shape))
        self._record()
        self._reset()

    @staticmethod
    def _write_grad(param: Any, value: np.ndarray) -> None:
        # Always a fresh Tensor, never an in-place write: the engine may hand one gradient
        # Tensor to several leaves (``a + b`` gives both the same out_grad), so writing into
        # p.grad in place would also change another parameter's (or the caller's) gradient.
        from needle.autograd import Tensor

        param.grad = Tensor(value.copy(), device=param.device, dtype=str(param.dtype),
                            requires_grad=False)

    def _divisor(self) -> float:
        """What the summed gradient is divided by (1: the weights were applied before)."""
        if self._weight is not None:
            return 1.0
        if self._total is None:
            return float(self.group.size) if self.reduction == "mean" else 1.0
        return self._total

    def _record(self) -> None:
        step = self._step
        step["finished"] = time.perf_counter()
        step["buckets"] = [
            {"index": b.index, "bytes": b.flat.nbytes, "ready": b.ready_at,
             "launched": b.launched_at, "started": b.work.started_at,
             "done": b.work.finished_at}
            for b in self.buckets
        ]
        self.timeline.append(step)
        del self.timeline[:-100]  # bounded history
        del self.events[:-10000]

    def wrap_optimizer(self, optimizer: Any) -> "SyncedOptimizer":
        """An optimizer whose ``step()`` first calls ``finish_gradient_sync()``."""
        return SyncedOptimizer(self, optimizer)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()


class SyncedOptimizer:
    """Delegates to the wrapped optimizer; ``step()`` waits for the gradient buckets first."""

    def __init__(self, ddp: DistributedDataParallel, optimizer: Any):
        self.ddp, self.optimizer = ddp, optimizer

    def step(self) -> None:
        self.ddp.finish_gradient_sync()
        self.optimizer.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
