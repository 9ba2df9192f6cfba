"""GradSync: the one gradient-sync engine under DDP, ZeRO and the mesh's data axis.

Parameters are packed, in reverse ``parameters()`` order (the order backward usually makes
their gradients ready), into buckets of one dtype and at most ``bucket_cap_mb`` each (a
larger parameter gets a bucket of its own). Each bucket's flat buffer is *rank-major*
(:class:`~needle.distributed.flat_layout.FlatLayout`: all of rank 0's pieces of its
parameters, then rank 1's, ...), so segment r is rank r's share. A post-accumulate-grad
hook copies a finished gradient into its bucket; a full bucket is handed to a
:class:`BucketHook`, in index order on every rank (so the collectives match), which starts
the collective: an all-reduce for DDP and the mesh, a reduce-scatter for ZeRO.
:meth:`GradSync.finish` waits for every bucket and lets the hook write the results back.

One example-weighting rule. Each rank multiplies its gradient by its weight, in the
gradient's dtype, while packing (a float16 gradient never overflows on the way), and the
collective sums. ``reduction="mean"`` (each rank's loss is a mean over its n_r examples):
weight ``n_r / sum_r n_r`` after ``set_num_examples(n_r)``, else ``1 / world_size``; the
result is the gradient of the global mean. ``reduction="sum"``: weight 1, and the sum is
divided by ``sum_r n_r`` when counts are given (they may come after a ``no_sync``
accumulation). The ring all-reduce is the reduce-scatter then an all-gather over the same
segments, so both sum every element in the same order: DDP, ZeRO and the mesh give
bitwise-equal gradients for the same model, bucket size and counts.

Priority. ``priority=k`` sends the k buckets that hold the earliest layers (the last ones
backward fills, the first ones the next forward needs) over a second process group of the
same ranks, so they do not queue behind the other buckets' collectives.

Example (two thread ranks, rank 1 has three times rank 0's examples):
    >>> import numpy as np, needle.distributed as dist
    >>> from needle import nn
    >>> from needle.autograd import Tensor
    >>> def job(rank):
    ...     layer = nn.Linear(2, 1, bias=False)
    ...     sync = dist.GradSync(layer.parameters(), None, dist.AllReduceHook())
    ...     sync.register()  # gradient hooks feed the buckets during backward
    ...     sync.set_num_examples([1, 3][rank])
    ...     layer(Tensor(np.full((1, 2), rank + 1.0, np.float32))).sum().backward()
    ...     sync.finish()
    ...     return layer.weight.grad.numpy().ravel().tolist()
    >>> dist.spawn_threads(job, 2)  # 1/4 * 1 + 3/4 * 2
    [[1.75, 1.75], [1.75, 1.75]]
"""
from __future__ import annotations

import time
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import _device_buckets, tracing, traffic
from ._errors import CommError, GraphError
from ._group import resolve
from ._ready_check import check_ready
from .collectives import all_gather, all_reduce
from .flat_layout import FlatLayout


class Bucket:
    """Parameters ``members`` (indices) of one dtype and their rank-major flat buffer."""

    def __init__(self, index: int, dtype: str, members: list[int], sizes: list[int],
                 world_size: int, group: Any):
        self.index, self.dtype, self.members, self.group = index, dtype, members, group
        self.layout = FlatLayout(sizes, world_size)
        self.flat: Any = None  # allocated at the first pack (ZeRO releases it after each step)
        self.device: Any = None  # set: the buffer is an NDArray there (_device_buckets)
        self.work: Any = None
        self.pending = len(members)
        self.ready_at: float | None = None
        self.launched_at: float | None = None

    def pack(self, j: int, grad: Any, weight: float) -> None:
        """Member j's gradient (flat), times ``weight`` in its dtype, into every segment."""
        if self.device is not None:
            return _device_buckets.pack_into(self, j, grad, weight)
        if self.flat is None:
            self.flat = np.empty(self.layout.numel, dtype=self.dtype)
        b, grad = self.layout.pieces[j], grad.reshape(-1)
        w = grad.dtype.type(weight)
        for r in range(self.layout.world_size):
            at = self.layout.offsets[r][j]
            np.multiply(grad[b[r]:b[r + 1]], w, out=self.flat[at:at + b[r + 1] - b[r]])


class BucketHook:
    """What a sync does with a full bucket: ``launch`` starts its collective (returns the
    Work), ``finish`` writes the results back after the wait (``sharded``: they differ by
    rank, so :meth:`GradSync.grads_finite` agrees on ``finite``)."""

    sharded = False

    def start_step(self, sync: "GradSync") -> None:
        """The first gradient of a synchronized step arrived."""

    def launch(self, bucket: Bucket) -> Any:
        raise NotImplementedError

    def gradient(self, i: int, param: Any, grad: np.ndarray) -> np.ndarray:
        """What to pack of parameter i's gradient ``grad`` (host values, or the device
        array with device buckets; default: all of it)."""
        return grad

    def packed(self, i: int, param: Any) -> None:
        """Parameter i's gradient is in its bucket."""

    def finish(self, bucket: Bucket, params: list) -> None:
        raise NotImplementedError

    def finite(self, params: list) -> bool:
        return all(p.grad is None or bool(np.isfinite(p.grad.numpy()).all()) for p in params)


class AllReduceHook(BucketHook):
    """Sum every bucket on every rank (ring over the bucket's segments, or the transport's
    own all-reduce) and write each parameter's result into ``p.grad``."""

    device_buckets = True  # on an nccl group of cuda() parameters (_device_buckets)

    def __init__(self, algorithm: str = "ring", label: str = "ddp gradients",
                 steps: bool = True):
        self.algorithm, self.label, self.steps = algorithm, label, steps

    def start_step(self, sync: "GradSync") -> None:
        if not self.steps:  # a sync that is one part of a bigger step (the mesh's)
            return
        n, r = sync.group.size, sync.group.rank
        costs = [traffic.ring_all_reduce_bytes(b.layout.numel, np.dtype(b.dtype).itemsize,
                                               n, r, b.layout.bounds) for b in sync.buckets]
        book = sync.group.traffic
        book.mark_step()
        book.expect(self.label, sum(s for s, _ in costs), sum(r for _, r in costs),
                    f"ring all-reduce of {len(costs)} buckets: 2(n-1)/n x M each")

    def launch(self, bucket: Bucket) -> Any:
        bounds = bucket.layout.bounds if self.algorithm == "ring" else None
        with traffic.label(self.label):
            return all_reduce(bucket.flat, "sum", bucket.group, async_op=True,
                              algorithm=self.algorithm, bounds=bounds)

    def finish(self, bucket: Bucket, params: list) -> None:
        from needle.autograd import Tensor
        from needle.memory import attribute

        # always a fresh Tensor, never written in place: the engine may hand one gradient
        # Tensor to several leaves (``a + b`` gives both the same out_grad)
        for i, full in zip(bucket.members, _device_buckets.unpack_bucket(bucket), strict=True):
            p = params[i]
            p.grad = Tensor(full.reshape(p.shape), device=p.device, dtype=bucket.dtype,
                            requires_grad=False)
            attribute(p.grad, "gradient")


def plan_buckets(params: Sequence[Any], cap_bytes: int) -> list[tuple[str, list[int]]]:
    """Bucket membership: ``(dtype, parameter indices)`` in reverse parameter order, one dtype
    per bucket, at most ``cap_bytes`` each (a larger parameter gets a bucket of its own).

    Example:
        >>> from needle.autograd import Tensor
        >>> plan_buckets([Tensor([0.0] * 4) for _ in range(3)], cap_bytes=32)
        [('float32', [2, 1]), ('float32', [0])]
    """
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
    return plan + [(dtype, members) for dtype, (members, _) in open_bucket.items() if members]


class GradSync:
    """The gradient-sync engine (see the module docstring).

    Args:
        params: the parameters to synchronize (those that require a gradient).
        group: the process group whose ranks hold the replicas (None: the world).
        hook: a :class:`BucketHook`: what each full bucket's collective is.
        names: parameter names for error messages (default ``parameter i``).
        bucket_cap_mb: bucket size in MiB.
        reduction: ``"mean"`` or ``"sum"``, what each rank's loss is over its examples.
        overlap: start buckets during backward (True) or all in :meth:`finish` (False).
        find_unused_parameters: parameters whose hook never fired count as zero gradients
            instead of raising.
        count_group: the group the example counts are summed over (default ``group``).
        on_hook: called with the parameter index whenever its hook fires (also in no_sync).
        priority: this many earliest-layer buckets go over a second group of the same ranks.
        owner: the name errors speak as.
    """

    def __init__(self, params: Sequence[Any], group: Any, hook: BucketHook, *,
                 names: Sequence[str] | None = None, bucket_cap_mb: float = 25,
                 reduction: str = "mean", overlap: bool = True,
                 find_unused_parameters: bool = False, count_group: Any = None,
                 on_hook: Callable[[int], None] | None = None, priority: int = 0,
                 owner: str = "GradSync", advice: str = "finish the gradient sync"):
        if reduction not in ("mean", "sum"):
            raise CommError(f"{owner}: reduction must be 'mean' or 'sum', got {reduction!r}")
        self.owner, self.hook, self.reduction, self.overlap = owner, hook, reduction, overlap
        self.advice = advice  # what "fired twice" tells the user to do between backwards
        self.group = resolve(group, owner)
        self.count_group = self.group if count_group is None else count_group
        self.params = list(params)
        self.names = list(names) if names is not None else [
            f"parameter {i}" for i in range(len(self.params))]
        self.find_unused_parameters, self.on_hook = find_unused_parameters, on_hook
        self.plan = plan_buckets(self.params, int(bucket_cap_mb * 2 ** 20))
        self.fast = None
        if priority > 0 and self.group.size > 1:
            from .process_group import new_group

            self.fast = new_group(self.group.ranks)
        n = len(self.plan)
        self.buckets = [
            Bucket(b, dtype, members,
                   [int(np.prod(self.params[m].shape, dtype=np.int64)) for m in members],
                   self.group.size, self.fast if self.fast and b >= n - priority else self.group)
            for b, (dtype, members) in enumerate(self.plan)]
        self._where = {m: (b, j) for b in self.buckets for j, m in enumerate(b.members)}
        self.device = _device_buckets.attach(self.buckets, self.group, self.params, hook)
        self._handles: list = []
        self._sync = True
        self.counts: tuple[float, float] | None = None  # (this rank's, all ranks') examples
        self.timeline: list[dict] = []
        self.events: list[tuple[str, int, float]] = []
        self._reset()

    def register(self) -> None:
        """Attach the post-accumulate-grad hooks that feed :meth:`ready` during backward
        (without them, :meth:`sync_now` feeds the engine after the backwards)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                         for i, p in enumerate(self.params)]

    def describe(self, i: int) -> str:
        return f"{self.names[i]!r} (shape {tuple(self.params[i].shape)})"

    def check_same_model(self) -> None:
        """Raise on every rank when ranks differ in bucket plan (model or bucket size);
        collective."""
        text = repr([(d, [tuple(self.params[m].shape) for m in ms]) for d, ms in self.plan])
        mine = np.array([zlib.crc32(text.encode()), len(self.plan)], dtype=np.int64)
        everyone = [np.zeros(2, np.int64) for _ in range(self.count_group.size)]
        all_gather(everyone, mine, group=self.count_group)
        differ = [r for r, h in enumerate(everyone) if not np.array_equal(h, everyone[0])]
        if differ:
            raise CommError(
                f"{self.owner}: ranks hold different models: ranks {differ} have a different "
                f"bucket plan than rank 0 (different model or bucket_cap_mb), expected "
                f"{int(everyone[0][1])} buckets with rank 0's shapes, got this rank's plan "
                f"{text[:300]}")

    # ----- weighting --------------------------------------------------------------------
    def set_num_examples(self, n: float) -> None:
        """Examples (or valid tokens) this rank's loss covers in this step (collective: every
        rank calls it; with ``"mean"`` before the step's backward); see the module doc."""
        if self._fired and self.reduction == "mean":
            raise CommError(f"{self.owner}: set_num_examples with reduction='mean' must come "
                            f"before the step's backward, got it after {len(self._fired)} "
                            "gradients were packed with the previous weight")
        total = np.array([float(n)], np.float64)
        with traffic.label("example count"):
            all_reduce(total, "sum", self.count_group)
        if total[0] <= 0:
            raise CommError(f"{self.owner}: total examples over ranks must be positive, got "
                            f"{total[0]}")
        self.counts = (float(n), float(total[0]))

    @property
    def weight(self) -> float:
        """What this rank's gradient is multiplied by before the sum."""
        if self.reduction == "sum":
            return 1.0
        return 1.0 / self.group.size if self.counts is None else self.counts[0] / self.counts[1]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside syncs."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    # ----- per step ---------------------------------------------------------------------
    def _reset(self) -> None:
        self._fired: set[int] = set()
        self._next = 0
        self._step: dict = {"buckets": []}
        for b in self.buckets:
            b.pending, b.work, b.ready_at, b.launched_at = len(b.members), None, None, None

    def _hook_for(self, i: int):
        def hook(p: Any) -> None:
            if self.on_hook is not None:
                self.on_hook(i)
            if self._sync:
                self.ready(i, p)

        return hook

    def ready(self, i: int, p: Any) -> None:
        """Parameter i's gradient is final for this step: pack it, start what is full."""
        now = time.perf_counter()
        if i in self._fired:
            raise GraphError(
                f"{self.owner}: the gradient hook of {self.describe(i)} fired twice in one "
                f"synchronized step, expected once per step: after each backward "
                f"{self.advice}; to accumulate gradients over several backward passes, run all "
                "but the last inside `with no_sync():`")
        if not self._fired:
            self.hook.start_step(self)
        self._fired.add(i)
        self._step.setdefault("first_hook", now)
        self._step["last_hook"] = now
        grad = self.hook.gradient(i, p, _device_buckets.gradient_of(p, self.device, self.owner))
        self._pack(i, grad, now)
        self.hook.packed(i, p)

    def _pack(self, i: int, grad: Any, now: float) -> None:
        bucket, j = self._where[i]
        bucket.pack(j, grad, self.weight)
        self.events.append(("ready", i, now))
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready_at = now
            if self.overlap:
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Start buckets strictly in index order so every rank issues the same sequence."""
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            bucket = self.buckets[self._next]
            bucket.launched_at = time.perf_counter()
            self.events.append(("launch", bucket.index, bucket.launched_at))
            bucket.work = self.hook.launch(bucket)
            self._next += 1

    def _fill_unused(self) -> list[int]:
        missing = [i for i in range(len(self.params)) if i not in self._fired]
        for i in missing:
            self._fired.add(i)
            self._pack(i, _device_buckets.zeros_for(self.params[i], self._where[i][0]),
                       time.perf_counter())
        return missing

    def sync_now(self) -> None:
        """Synchronize the gradients the parameters hold now (no hooks: a step that ran many
        backwards, e.g. a pipeline's), as if each had just become ready."""
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            raise CommError(f"{self.owner}: parameters {missing} have no gradient, expected a "
                            "backward before the sync")
        for i, p in enumerate(self.params):
            self.ready(i, p)
        self.finish()

    def finish(self) -> bool:
        """Wait for every bucket and let the hook write the results (idempotent within a
        step; False when there was nothing to synchronize)."""
        if not self._sync or not self._fired:
            return False
        self._step["finish_called"] = time.perf_counter()
        missing = self._fill_unused()
        self._launch_ready()
        check_ready(self, missing)  # zeros filled even so: every rank launched every bucket
        total = self.counts[1] if self.reduction == "sum" and self.counts else 1.0
        for bucket in self.buckets:
            bucket.work.wait()
            if total != 1.0:
                bucket.flat /= float(total)  # (NumPy: cast to the buffer's dtype first)
            self.hook.finish(bucket, self.params)
        self._record()
        self._reset()
        return True

    def grads_finite(self) -> bool:
        """Whether every synchronized gradient is finite on every rank (finishes the sync;
        collective when the results are sharded)."""
        self.finish()
        ok = self.hook.finite(self.params)
        if not self.hook.sharded:
            return ok
        flag = np.array([1.0 if ok else 0.0])
        all_reduce(flag, "min", self.count_group)
        return bool(flag[0] == 1.0)

    def _record(self) -> None:
        step = self._step
        step["finished"] = time.perf_counter()
        step["buckets"] = [
            {"index": b.index, "bytes": b.layout.numel * np.dtype(b.dtype).itemsize,
             "ready": b.ready_at, "launched": b.launched_at, "started": b.work.started_at,
             "done": b.work.finished_at} for b in self.buckets]
        self.timeline.append(step)
        tracing.gradient_sync(step, self.owner)
        del self.timeline[:-100]  # bounded history
        del self.events[:-10000]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def close(self) -> None:
        """Remove the hooks and close the priority group, if any."""
        self.remove_hooks()
        if self.fast is not None:
            self.fast.destroy()
            self.fast = None


class SyncedModule:
    """What a data-parallel wrapper (DDP, ZeRO) shows the training loop: the wrapped module's
    call and the engine's per-step API. Subclasses set ``module`` and ``sync``."""

    module: Any
    sync: GradSync

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def parameters(self) -> list[Any]:
        return self.module.parameters()

    @property
    def buckets(self) -> list[Bucket]:
        return self.sync.buckets

    @property
    def timeline(self) -> list[dict]:
        """Per synchronized step: hook times and each bucket's ready/launch/start/done."""
        return self.sync.timeline

    @property
    def events(self) -> list[tuple[str, int, float]]:
        """``("ready", parameter, time)`` and ``("launch", bucket, time)``, in order."""
        return self.sync.events

    def set_num_examples(self, n: float) -> None:
        """Examples (or valid tokens) this rank's loss covers in this step; each rank then
        weighs ``n / sum over ranks`` (collective: every rank calls it, before the backward;
        without it every rank weighs ``1 / world_size``)."""
        self.sync.set_num_examples(n)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside syncs."""
        with self.sync.no_sync():
            yield

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket and write the synchronized gradients back (idempotent within
        a step; the wrapped optimizer's ``step()`` calls it)."""
        self.sync.finish()

    def grads_finite(self) -> bool:
        """Whether every synchronized gradient is finite on every rank (what
        ``amp.GradScaler`` asks before a step; finishes the sync first)."""
        return self.sync.grads_finite()

    def remove_hooks(self) -> None:
        self.sync.remove_hooks()
