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
  :func:`data_parallel` (ddp and ZeRO stages 1-3); a pipeline runs this rank's actions of
  its schedule on copies of its chunks (:func:`trace_schedule`); tensor parallelism traces
  the sharded model. The optimizer's update: :func:`optimizer_update`. Everything that
  crosses the network is staged in host memory (DDP buckets, ZeRO's gathers and prefetches,
  pipeline messages), which the device allocator never sees.
"""
from __future__ import annotations

import copy
import dataclasses
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


def shadow_strategy(cfg, ctx):
    """A bare default-step strategy over ``ctx`` whose model each trace sets: runs the step's
    forward and backward as the strategies do (``Strategy._backward``)."""
    from needle import amp, nn

    from .strategies.base import Strategy

    shadow = Strategy(cfg)
    shadow.ctx, shadow.loss_fn = ctx, nn.SoftmaxLoss()
    shadow.scaler = amp.GradScaler(enabled=False)
    return shadow


def trace_backward(shadow, model, X: np.ndarray, y: np.ndarray, modules: bool = False) -> list:
    """The event log of the default step's forward and backward of ``X, y`` (zeros of their
    shapes) on ``model``, a throwaway copy: every micro-batch, gradients accumulated as the
    step does, ``("mb", k)`` after micro-batch k."""
    shadow.model = model
    with recording(shadow.ctx.device) as log:
        probe(model, log, modules)
        shadow.on_micro_batch = lambda done: log.mark("mb", done)
        shadow._backward(np.zeros_like(X), np.zeros_like(y))
        log.mark("end")
    for module, _ in units_of(model) if modules else ():
        module.__dict__.pop("forward", None)  # the probe's closure refers to the module
    shadow.model = shadow.on_micro_batch = None
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


def optimizer_update(optimizer, device, first: bool, params: list[tuple[int, bool]],
                     grads_compact: bool) -> tuple:
    """(peak, bytes left, the composed updates' new values) of ``optimizer.step()`` above what
    it starts from, for ``params``: (bytes, whether the value is compact) of each parameter
    the optimizer updates, in order. The fused parameters go first (one batch), then the
    others in order (``Optimizer.step``); a composed update of a view parameter leaves a new
    compact value (its bytes in the third element, in parameter order; 0 if fused)."""
    level = top = 0
    kinds = [(compact, grads_compact) for _, compact in params]
    for (nbytes, _), kind in sorted(zip(params, kinds, strict=True), key=lambda pk: not all(pk[1])):
        held, left = update_cost(optimizer, device, first, kind)
        top = max(top, level + held * nbytes)
        level += left * nbytes
    return top, level, [0 if all(k) else b for (b, _), k in zip(params, kinds, strict=True)]


def live_params(optimizer) -> list[tuple[int, bool]]:
    """:func:`optimizer_update`'s ``params`` for a live optimizer."""
    return [(_bytes(p), _compact(p.realize_cached_data())) for p in optimizer.params]


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


def predict_default(cfg, ctx, X: np.ndarray, y: np.ndarray, first: bool | None, *,
                    stage: int = 0, rank: int = 0, world_size: int = 1,
                    ddp: bool = False) -> dict:
    """The peak of the default step (``single``, ``ddp``, ``zero`` at ``stage``) on ``X, y``,
    this rank's share, from a fresh copy of the configured model (see the module doc).
    ``first``: the run's first step (no gradients or moments yet); None: the larger of the
    first and a later step (one trace serves both)."""
    import needle as ndl

    if cfg.precision != "fp32":
        return unpredicted("--precision fp16-mixed: the loss scaler's unscale and the float32 "
                           "master update are not modelled")
    extra = cfg.extra or {}
    if extra.get("compile") or extra.get("data_shares", 1) > 1:
        return unpredicted("--compile and --data-shares run another step than the default")
    with ndl.random.fork_rng():
        model = ctx.new_model()
        optimizer = ctx.new_optimizer(model.parameters())
        sizes = [_bytes(p) for p in model.parameters()]
        counts = [int(np.prod(p.shape)) for p in model.parameters()]
        pieces = [((rank + 1) * n // world_size - rank * n // world_size) * (b // max(n, 1))
                  for n, b in zip(counts, sizes, strict=True)]
        units = [m for _, m in units_of(model)] if stage == 3 else None
        held = {f: held_at_start(model, optimizer, stage, world_size, rank, f, 0)
                for f in ((True, False) if first is None else (first,))}
        items = trace_backward(shadow_strategy(cfg, ctx), model, X, y, modules=stage == 3)
        del model
        gc.collect()
    if stage == 0:
        params = [(b, True) for b in sizes]
    else:  # ZeRO's optimizer updates this rank's pieces: views of the weights below stage 3
        params = [(p, stage == 3 or p == b) for p, b in zip(pieces, sizes, strict=True) if p]
    out = {}
    for f, terms in held.items():
        terms[WORKSPACE] = workspace_bytes(ctx.device)  # after the trace: kernels have run
        update = optimizer_update(optimizer, ctx.device, f, params, grads_compact=stage != 1)
        step = data_parallel(items, stage=stage, sizes=sizes, pieces=pieces,
                             micro_batches=max(1, int(cfg.accumulate)), update=update,
                             ddp=ddp, units=units)
        start = sum(terms.values())
        got = {"predicted": start - terms["gradient"] + step["peak"], "where": step["where"],
               "held_at_start": start, "terms": terms}
        if not out or got["predicted"] > out["predicted"]:
            out = got
    return out


def predict_default_step(strategy, X: np.ndarray, y: np.ndarray, first: bool) -> dict:
    """:func:`predict_default` for a running strategy (``single``, ``ddp``, ``zero``)."""
    stage = int(getattr(strategy, "stage", 0))
    return predict_default(strategy.cfg, strategy.ctx, X, y, first, stage=stage,
                           rank=strategy.rank, world_size=strategy.world_size,
                           ddp=strategy.distributed and stage == 0)


def predict_ps_worker(strategy, X: np.ndarray, y: np.ndarray, first: bool) -> dict:
    """The peak of a parameter-server worker's step: the pull writes the new weights into
    the parameters in place (host staging: nothing on the device), the last step's gradients
    are dropped, then the forward and backward of the default step; the push reads the
    gradients into host memory and the servers run the optimizer, so no update here."""
    import needle as ndl

    cfg, ctx = strategy.cfg, strategy.ctx
    if cfg.precision != "fp32":
        return unpredicted("--precision fp16-mixed: not a parameter-server option")
    with ndl.random.fork_rng():
        model = ctx.new_model()
        terms = held_at_start(model, None, 0, 1, 0, first, 0)
        items = trace_backward(shadow_strategy(cfg, ctx), model, X, y)
        del model
        gc.collect()
    terms[WORKSPACE] = workspace_bytes(ctx.device)
    top, _ = run_deltas(items)
    start = sum(terms.values())
    return {"predicted": start - terms["gradient"] + top, "held_at_start": start,
            "terms": terms, "where": "backward"}


def _shadow_trace(strategy, build, run, X, y) -> list:
    """The event log of ``run(shadow, X0, y0)``: ``shadow`` is a shallow copy of the strategy
    whose model is ``build(fresh unsharded model)``, ``X0, y0`` zeros of the shapes."""
    import needle as ndl
    import needle.distributed as dist

    with ndl.random.fork_rng():
        shadow = copy.copy(strategy)
        model = build(shadow, strategy.ctx.new_model())
        with recording(strategy.ctx.device) as log, dist.traffic.label("peak prediction"):
            probe(model, log, modules=False)
            run(shadow, np.zeros_like(X), np.zeros_like(y))
            log.mark("end")
        del shadow, model
        gc.collect()
    return log.items


def predict_tensor_parallel(strategy, X: np.ndarray, y: np.ndarray, first: bool) -> dict:
    """The peak of a mesh step without pipeline stages or data-parallel replicas (``tp``):
    held state, the sharded model's forward and backward (its all-reduces' results are
    activations and gradients like any op's), the fused update."""
    from needle.distributed import tensor_parallel

    from .strategies._mesh import MeshStrategy

    def build(shadow, full):
        shadow.modules = {0: tensor_parallel.parallelize_sequential(
            full, strategy.mesh.get_group("tp"))}
        return shadow.modules[0]

    items = _shadow_trace(strategy, build, MeshStrategy._forward_backward, X, y)
    state = strategy.memory_probe()
    held = held_at_start(state.model, state.optimizer, 0, strategy.world_size, strategy.rank,
                         first, workspace_bytes(state.device))
    top, level = run_deltas(items)
    update = optimizer_update(state.optimizer, state.device, first,
                              live_params(state.optimizer), grads_compact=True)
    step = max(top, level + update[0])
    start = sum(held.values())
    return {"predicted": start - held["gradient"] + step, "held_at_start": start,
            "terms": held, "where": "backward" if step == top else "optimizer update"}


class _Messages:
    """A pipeline step's messages without the network: what a stage sends is dropped, what
    it receives is zeros of the shape its peer sends (``shape(tag)``)."""

    def __init__(self, shape):
        self.shape = shape

    def put(self, key, arr) -> None:
        pass

    def take(self, key):
        return np.zeros(self.shape(key[0]), np.float32)


def schedule_actions(schedule) -> list:
    """This rank's actions of the schedule's plan, in the order the step runs them (the
    in-flight micro-batches of the schedule are in that order)."""
    return list(schedule.plan.actions[schedule.rank])


def pipeline_chunks(ctx, layers_per_stage, mine, tp_group=None) -> tuple[dict, list]:
    """Fresh copies of the chunks ``mine`` of the model cut into ``layers_per_stage`` (sharded
    over ``tp_group`` when given), and every chunk's output shape past the batch axis."""
    from needle import nn
    from needle.autograd import Tensor, no_grad

    layers = list(ctx.new_model().modules)
    cuts = np.cumsum([0, *layers_per_stage]).tolist()
    pieces = [nn.Sequential(*layers[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    tails, h = [], Tensor(np.zeros((1, ctx.in_features), np.float32), device=ctx.device,
                          requires_grad=False)
    with no_grad():
        for piece in pieces:
            piece.eval()
            h = piece(h)
            tails.append(tuple(h.shape[1:]))
    chunks = {}
    for k in mine:
        pieces[k].train()
        chunks[k] = pieces[k]
        if tp_group is not None:
            from needle.distributed import tensor_parallel

            chunks[k] = tensor_parallel.parallelize_sequential(pieces[k], tp_group)
    return chunks, tails


def trace_schedule(schedule, chunks: dict, tails: list, X: np.ndarray, y: np.ndarray,
                   device) -> list:
    """The event log of ``schedule.step`` on this rank with ``chunks`` (copies) for its stages:
    this rank's actions in order (``schedule_actions``), messages received as zeros of the
    shape the peer sends (``tails``: each chunk's output shape past the batch axis)."""
    import needle.distributed as dist
    from needle.distributed.pipeline.autograd_p2p import Link
    from needle.distributed.pipeline.runtime import TAG_BASE

    plan = schedule.plan
    sizes = [hi - lo for lo, hi in _cuts(int(X.shape[0]), plan.num_microbatches)]
    messages = _Messages(lambda tag: (sizes[(tag - TAG_BASE) // plan.num_stages],
                                      *tails[(tag - TAG_BASE) % plan.num_stages]))
    shadow = copy.copy(schedule)
    shadow.stages = {k: copy.copy(st) for k, st in schedule.stages.items()}
    for k, st in shadow.stages.items():
        st.module = chunks[k]
    shadow._params = {k: chunks[k].parameters() for k in shadow.stages}
    shadow.record, shadow._links = False, {}

    def link(edge, microbatch, towards_next, links=shadow._links):
        key = (edge, microbatch, towards_next)
        if key not in links:
            tag = TAG_BASE + microbatch * plan.num_stages + edge
            links[key] = Link(schedule.group, 0, tag, local=messages)
        return links[key]

    shadow._link = link
    actions = list(plan.actions)
    actions[schedule.rank] = tuple(schedule_actions(schedule))
    shadow.plan = dataclasses.replace(plan, actions=tuple(actions))
    with recording(device) as log, dist.traffic.label("peak prediction"):
        for k in shadow.stages:
            probe(chunks[k], log, modules=False)
        shadow.step(np.zeros_like(X), np.zeros_like(y))
        log.mark("end")  # the last stage's outputs stay until the next step begins
    shadow.outputs = []
    return log.items


def pipeline_peak(items: list, held: dict, optimizer, params, device, first: bool) -> dict:
    """A pipeline step's peak from its trace: held state (less the gradients and the last
    stage's previous outputs, both dropped as the step begins), the schedule, the update."""
    top, level = run_deltas(items)
    update = optimizer_update(optimizer, device, first, params, grads_compact=True)
    step = max(top, level + update[0])
    start = sum(held.values())
    return {"predicted": start - held["gradient"] - held.get("outputs", 0) + step,
            "held_at_start": start, "terms": held,
            "where": "schedule" if step == top else "optimizer update"}


def predict_pipeline(strategy, X: np.ndarray, y: np.ndarray, first: bool) -> dict:
    """The peak of the running pipeline's step on this rank (see :func:`trace_schedule`)."""
    import needle as ndl

    real = strategy.schedule
    tp = strategy.mesh.get_group("tp") if strategy.tp > 1 else None
    with ndl.random.fork_rng():
        chunks, tails = pipeline_chunks(strategy.ctx, strategy.layers_per_stage, real.stages,
                                        tp)
        items = trace_schedule(real, chunks, tails, X, y, strategy.ctx.device)
        del chunks
        gc.collect()
    state = strategy.memory_probe()
    held = held_at_start(state.model, state.optimizer, 0, strategy.world_size, strategy.rank,
                         first, workspace_bytes(state.device))
    held["outputs"] = sum(_bytes(o) for o in real.outputs)  # freed when the step begins
    return pipeline_peak(items, held, state.optimizer, live_params(state.optimizer),
                         state.device, first)


def _cuts(n: int, m: int) -> list[tuple[int, int]]:
    c = [n * i // m for i in range(m + 1)]
    return list(zip(c, c[1:], strict=False))
