"""The per-rank peak of a training step: predicted before the step, measured during it.

``summary.json``'s ``memory.per_rank[r].peak``. Bytes are requested bytes (what tensors ask
the device's allocator for), so the allocator's 512-byte block rounding is outside both sides.

Measured: ``needle.memory``'s ``peak_requested_bytes`` of the device, its peaks reset right
before the step and read right after it.

Predicted, before the step, without reading the step: a list of byte deltas in the order the
step makes them, whose running sum's maximum is the peak.

* Held at the start: this rank's model state by the memory ledger (``needle.memory.estimate``
  for its layout: weights, the previous step's gradients, optimizer moments), the model's
  buffers (BatchNorm running statistics) and the kernels' workspace. The workspace is the C++
  backend's per-thread packing scratch: kept between kernels and sized by their blocking and
  thread count, not by the model, so it is read from the allocator when the step starts.
* Activations and gradients in flight: one forward and backward of each of the step's
  micro-batches (zeros of the step's shapes) through a throwaway copy of this rank's model,
  under the allocator's event log. Probes on the copy mark where each parameter's gradient is
  final and where each module owning parameters runs its forward and starts its backward.
* The strategy's own device buffers, from shapes, at those marks and after the backward:
  ``data_parallel`` below (ddp and ZeRO stages 1-3), ``mesh.py``'s pipeline schedule.
  Everything that crosses the network is staged in host memory (DDP buckets, ZeRO's gathers
  and prefetches, pipeline messages), which the device allocator never sees.
"""
from __future__ import annotations

import copy
import gc
from contextlib import contextmanager

import numpy as np

WORKSPACE = "workspace"


class EventLog:
    """The allocator's events as requested-byte deltas (kernel workspace left out: it is a
    term of its own), with probe marks (tuples) in between, in order."""

    def __init__(self, allocator):
        self.allocator, self.items = allocator, []

    def append(self, event) -> None:  # the allocator's sink
        if event.category != WORKSPACE and event.kind in ("alloc", "free"):
            self.items.append(event.requested if event.kind == "alloc" else -event.requested)

    def mark(self, *what) -> None:
        drain = getattr(self.allocator, "drain", None)  # the C++ allocator logs on its side
        if drain is not None:
            drain()
        self.items.append(what)


@contextmanager
def recording(device):
    """Log ``device``'s allocator events while the block runs (the collector paused, so that
    buffers die where their last reference goes)."""
    from needle.memory import get_allocator, timeline

    allocator = get_allocator(device)
    log = EventLog(allocator)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    cpp = hasattr(allocator, "begin_recording")
    sink = None
    if cpp:
        allocator.begin_recording(log)
    else:
        sink = timeline.add_sink(log, frozenset([allocator.name]))
    try:
        yield log
    finally:
        if cpp:
            allocator.end_recording(log)
        else:
            timeline.remove_sink(sink)
        if enabled:
            gc.enable()


def units_of(model) -> list[tuple]:
    """``(module, parameter indices)`` of every module that owns parameters directly, found as
    ZeRO stage 3 finds its gather units."""
    from types import SimpleNamespace

    from needle.distributed.zero.stage3 import discover_units

    entries = [SimpleNamespace(param=p, index=i, dtype=str(p.dtype), size=int(np.prod(p.shape)))
               for i, p in enumerate(model.parameters())]
    return [(u.module, [e.index for e in u.entries]) for u in discover_units(model, entries, 1)]


def probe(model, log: EventLog, modules: bool) -> None:
    """Marks on ``model``: ``("grad", i)`` when parameter i's gradient is final;
    with ``modules``, ``("fwd", u, 1|0)`` around unit u's forward and ``("bwd", u)`` when the
    gradient of its output is complete (where its backward starts)."""
    from needle.autograd import Tensor

    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda t, i=i: log.mark("grad", i))
    if not modules:
        return
    for u, (module, _) in enumerate(units_of(model)):
        def forward(*args, _u=u, _run=module.forward, **kwargs):
            log.mark("fwd", _u, 1)
            out = _run(*args, **kwargs)
            log.mark("fwd", _u, 0)
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(lambda g, _u=_u: log.mark("bwd", _u))
            return out

        module.forward = forward


def trace_backward(strategy, X: np.ndarray, y: np.ndarray, modules: bool = False) -> list:
    """The event log of the default step's forward and backward of ``X, y`` (zeros of their
    shapes) on a copy of the strategy's model: every micro-batch, gradients accumulated
    as the step does, ``("mb", k)`` after micro-batch k."""
    import needle as ndl

    from .strategies.base import Strategy

    with ndl.random.fork_rng():
        replica = strategy.ctx.new_model()
        shadow = copy.copy(strategy)
        shadow.model = replica
        with recording(strategy.ctx.device) as log:
            probe(replica, log, modules)
            shadow.on_micro_batch = lambda done: log.mark("mb", done)
            Strategy._backward(shadow, np.zeros_like(X), np.zeros_like(y))
            log.mark("end")
        for module, _ in units_of(replica) if modules else ():
            module.__dict__.pop("forward", None)  # the probe's closure refers to the module
        del shadow, replica
        gc.collect()
    return log.items


def _bytes(t) -> int:
    return int(np.prod(t.shape)) * np.dtype(str(t.dtype)).itemsize


def held_at_start(model, optimizer, zero_stage: int, world_size: int, rank: int,
                  first: bool, workspace: int, buffers: int | None = None) -> dict:
    """The bytes held when a step starts, by term: the ledger's model state for this rank (no
    gradients and no moments before the first step), the model's buffers, the workspace."""
    from needle.memory import accounting

    state = accounting.predicted(model, optimizer, zero_stage, world_size, rank)
    if first:
        state["gradient"] = state["optimizer"] = 0
    if buffers is None:
        buffers = sum(_bytes(t) for _, t in model.named_buffers())
    return {**state, "buffers": buffers, WORKSPACE: workspace}


def run_deltas(items, on_mark=None) -> tuple[int, int]:
    """(the highest running sum, the final sum) of ``items``; marks are handed to
    ``on_mark(mark)``, which returns the bytes the strategy adds (negative: frees) there."""
    level = top = 0
    for item in items:
        if isinstance(item, tuple):
            if on_mark is None:
                continue
            level += on_mark(item)
        else:
            level += item
        top = max(top, level)
    return top, level


class _Stage3:
    """ZeRO stage 3's gathered weights on the device, as ``GatherUnits`` holds them: a unit is
    materialized at its forward and again when its backward starts, freed after its forward
    and when its last gradient is final. A prefetched unit waits in host memory."""

    def __init__(self, units: list[list[int]], sizes: list[int]):
        self.units, self.sizes = units, sizes
        self.unit_of = {i: u for u, members in enumerate(units) for i in members}
        self.live: set[int] = set()
        self.left = [0] * len(units)

    def bytes(self, u: int) -> int:
        return sum(self.sizes[i] for i in self.units[u])

    def materialize(self, u: int) -> int:
        if u in self.live:
            return 0
        self.live.add(u)
        self.left[u] = len(self.units[u])
        return self.bytes(u)

    def release(self, u: int) -> int:
        if u not in self.live:
            return 0
        self.live.discard(u)
        return -self.bytes(u)

    def on_mark(self, mark) -> int:
        if mark[0] == "fwd":
            return self.materialize(mark[1]) if mark[2] else self.release(mark[1])
        if mark[0] == "bwd":
            return self.materialize(mark[1])
        if mark[0] == "grad":
            u = self.unit_of[mark[1]]
            self.left[u] -= 1
            return self.release(u) if self.left[u] <= 0 else 0
        return 0


_CALIBRATED: dict = {}


def _compact(array) -> bool:
    return bool(getattr(array, "is_compact", lambda: True)())


def update_cost(optimizer, device, first: bool, compact: tuple[bool, bool]) -> tuple[int, int]:
    """(most bytes held beside the parameter during its update, bytes its update leaves: new
    moments) per byte of a float32 parameter, for an optimizer of ``optimizer``'s class and
    settings updating a parameter whose value and gradient are compact or views
    (``compact``): the fused update (one kernel program, in place) runs on compact arrays
    only, the composed one holds its temporaries. Counted once per kind, on one update of a
    256-element parameter, as every array of an update is the parameter's size."""
    import needle as ndl
    from needle.autograd import Tensor

    hyper = {h: getattr(optimizer, h) for h in getattr(optimizer, "_hyper", ())}
    key = (type(optimizer), tuple(sorted(hyper.items())), str(device), first, compact)
    if key not in _CALIBRATED:
        n = 256

        def array(is_compact: bool):
            # a view keeps its whole alive, as a ZeRO shard's whole weight does
            whole = ndl.init.zeros(n if is_compact else 2 * n, device=device).cached_data
            return whole if is_compact else whole.reshape((2 * n,))[n:]

        theta = array(compact[0])
        param = Tensor.make_const(theta, requires_grad=True)
        param.grad = Tensor.make_const(array(compact[1]))
        update = type(optimizer)([param], **hyper)
        if not first:
            update.step()  # the moments exist; the parameter is a view again, as ZeRO
            param.cached_data = theta  # stages 1-2 rebind it after publishing the weights
        with recording(device) as log:
            update.step()
        top, end = run_deltas(log.items)
        _CALIBRATED[key] = (top // (4 * n), end // (4 * n))
        del update, param, theta
    return _CALIBRATED[key]


def optimizer_update(optimizer, device, first: bool, grads_compact: bool) -> tuple:
    """(peak, bytes left, the parameters' composed updates) of ``optimizer.step()`` above
    what it starts from: the fused parameters first (one batch), then the others in order
    (``Optimizer.step``). A composed update of a view parameter leaves a new compact value
    (its bytes in the third element, in parameter order; 0 for a fused one)."""
    level = top = 0
    kinds = [(_compact(p.realize_cached_data()), grads_compact) for p in optimizer.params]
    composed = []
    for p, kind in sorted(zip(optimizer.params, kinds, strict=True),
                          key=lambda pk: not all(pk[1])):
        held, left = update_cost(optimizer, device, first, kind)
        top = max(top, level + held * _bytes(p))
        level += left * _bytes(p)
    for p, kind in zip(optimizer.params, kinds, strict=True):
        composed.append(0 if all(kind) else _bytes(p))
    return top, level, composed


def data_parallel(items: list, *, stage: int, sizes: list[int], pieces: list[int],
                  micro_batches: int, update: tuple[int, int], ddp: bool,
                  units: list[list[int]] | None = None) -> dict:
    """The step of ``single``, ``ddp`` and ``zero`` above what is held after ``reset_grad``:
    (peak, where). ``sizes``: each parameter's bytes; ``pieces``: this rank's share of each
    (ZeRO). Terms:

    * the backward (``items``); ZeRO stage 2-3 drops a whole gradient once it is packed in
      the step's synchronized (last) micro-batch; stage 3 holds the units it has gathered;
    * after it: ddp writes each averaged gradient beside the old one (the largest parameter
      at once); ZeRO stage 1 writes its reduced piece into the whole gradient through a
      temporary of the piece, stages 2-3 keep each piece as the rank's gradient;
    * the optimizer's update (``update``: its peak and what it leaves, ``optimizer_update``);
    * ZeRO stages 1-2 publish each updated weight beside the old one until the shard view
      moves over (the largest parameter at once)."""
    gathered = _Stage3(units, sizes) if stage == 3 else None
    done = [0]

    def on_mark(mark) -> int:
        if mark[0] == "mb":
            done[0] = mark[1]
            return 0
        add = gathered.on_mark(mark) if gathered is not None else 0
        if mark[0] == "grad" and stage >= 2 and done[0] == micro_batches - 1:
            add -= sizes[mark[1]]  # packed into its bucket, then dropped
        return add

    top, level = run_deltas(items, on_mark)
    where = "backward"
    if gathered is not None:
        level -= sum(gathered.bytes(u) for u in gathered.live)  # release_all
    after = [level]
    if ddp:
        after.append(level + max(sizes))
    elif stage == 1:
        after.append(level + max(pieces))
    elif stage >= 2:
        level += sum(pieces)
        after.append(level)
    after.append(level + update[0])
    level += update[1]
    if stage in (1, 2):  # the weights published, last parameter first (the bucket order)
        composed = iter(update[2])
        replaced = [next(composed) if piece else 0 for piece in pieces]
        for i in reversed(range(len(sizes))):
            after.append(level + sizes[i])
            level -= replaced[i]  # a new value beside the view, until the shard moves over
    if max(after) > top:
        top, where = max(after), "after the backward"
    return {"peak": top, "where": where}


def workspace_bytes(device) -> int:
    from needle.memory import stats

    return int(stats(device)["by_category"][WORKSPACE]["current_requested"])


def unpredicted(why: str) -> dict:
    return {"predicted": None, "why": why}


def predict_default_step(strategy, X: np.ndarray, y: np.ndarray, first: bool) -> dict:
    """The peak of the default step (``single``, ``ddp``, ``zero``) on this rank's share."""
    extra = strategy.cfg.extra or {}
    if strategy.mixed:
        return unpredicted("--precision fp16-mixed: the loss scaler's unscale and the float32 "
                           "master update are not modelled")
    if extra.get("compile") or extra.get("data_shares", 1) > 1:
        return unpredicted("--compile and --data-shares run another step than the default")
    state = strategy.memory_probe()
    stage, world, rank = state.zero_stage, strategy.world_size, strategy.rank
    items = trace_backward(strategy, X, y, modules=stage == 3)
    params = list(state.model.parameters())
    sizes = [_bytes(p) for p in params]
    items_per = [int(np.prod(p.shape)) for p in params]
    pieces = [((rank + 1) * n // world - rank * n // world) * s // max(n, 1)
              for n, s in zip(items_per, sizes, strict=True)]
    held = held_at_start(state.model, state.optimizer, stage, world, rank, first,
                         workspace_bytes(state.device))
    update = optimizer_update(state.optimizer, state.device, first, grads_compact=stage != 1)
    step = data_parallel(items, stage=stage, sizes=sizes, pieces=pieces,
                         micro_batches=max(1, int(strategy.cfg.accumulate)), update=update,
                         ddp=strategy.distributed and stage == 0,
                         units=[m for _, m in units_of(state.model)] if stage == 3 else None)
    start = sum(held.values())
    return {"predicted": start - held["gradient"] + step["peak"], "where": step["where"],
            "held_at_start": start, "terms": held,
            "step": step["peak"]}
