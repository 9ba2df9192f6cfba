"""``--memory-budget BYTES``: pick the configuration that fits, then certify it.

Before the strategy is set up, every rank lists the same candidates, orders them by predicted
step time and predicts their peaks (``peak.py``) in that order; the first whose peak fits the
budget on every rank (the largest of the ranks' peaks, of the run's first step and of a later
one, on a full batch) is chosen, the ones before it are rejected with their peak. The run then
measures every step's peak (``memory.per_rank[r].peak.max_measured``) and fails if one is
above the budget.

Candidates:

* ``single``, ``ddp``, ``zero``: micro-batches per step (``--accumulate`` 1, 2, 4, 8, at most
  the rank's examples) x activation checkpoints (none, and for each micro-batch size the plans
  of ``needle.checkpoint.plan_checkpoints`` over the model's layers, measured: the least
  recompute for each activation peak it can reach) x, with ``--strategy zero``, the stage (1,
  2, 3). With BatchNorm, each micro-batch is normalised alone, as ``--accumulate`` does.
* ``pipeline``: micro-batches (``--microbatches`` 1, 2, 4, 8, multiples of the stages with
  the interleaved schedule) x every cut of the model's layers into the stages
  (``--layers-per-stage``).

Predicted step time (:data:`TIME_MODEL`): nominal, not calibrated. A micro-batch costs its
forward FLOPs three times (backward twice the forward) plus the recomputed forward, at
:data:`FLOP_RATE`, and :data:`OP_SECONDS` per op and backward node (small models are
dispatch-bound: an extra micro-batch costs a whole pass of ops); ZeRO sends its traffic at
:data:`BYTE_RATE` (stage 3 gathers the weights again for backward: 1.5x the bytes of stages
1-2); a pipeline's step is the schedule simulator's makespan on these per-stage costs. Ties
go to fewer micro-batches, no recompute, the lower ZeRO stage.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from .config import UsageError, format_checkpoints

FLOP_RATE = 1e11  # FLOP/s of the two cores of the development machines
OP_SECONDS = 1.7e-5  # seconds to dispatch one op or one backward node there
BYTE_RATE = 1e9  # bytes a rank sends per second
TIME_MODEL = ("nominal, not calibrated: forward FLOPs x 3 plus the recomputed forward at "
              f"{FLOP_RATE:.0e} FLOP/s, {OP_SECONDS * 1e6:.0f} us per op and backward node, "
              f"ZeRO traffic at {BYTE_RATE:.0e} B/s; pipelines: the schedule simulator's "
              "makespan on those costs")
MICRO_BATCHES = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration the planner may choose; ``step_s``: its predicted step time."""

    accumulate: int = 1
    checkpoints: str | None = None
    zero_stage: int | None = None
    microbatches: int | None = None
    layers_per_stage: tuple[int, ...] | None = None
    step_s: float = 0.0

    def options(self) -> dict:
        """The command-line options it sets (``--name``: value)."""
        out: dict = {}
        if self.microbatches is not None:
            out["--microbatches"] = self.microbatches
            out["--layers-per-stage"] = ",".join(map(str, self.layers_per_stage))
            return out
        out["--accumulate"] = self.accumulate
        out["--activation-checkpoints"] = self.checkpoints
        if self.zero_stage is not None:
            out["--zero-stage"] = self.zero_stage
        return out

    def apply(self, cfg):
        """``cfg`` with this candidate's options."""
        extra = dict(cfg.extra or {})
        if self.microbatches is not None:
            extra["microbatches"] = self.microbatches
            extra["layers_per_stage"] = ",".join(map(str, self.layers_per_stage))
            return dataclasses.replace(cfg, extra=extra)
        if self.zero_stage is not None:
            extra["zero_stage"] = self.zero_stage
        return dataclasses.replace(cfg, accumulate=self.accumulate,
                                   activation_checkpoints=self.checkpoints, extra=extra)


# ---- what each layer costs ----------------------------------------------------------------
def _layer_work(ctx, rows: int) -> list[tuple[int, int]]:
    """(forward FLOPs, ops) of each of the model's layers on ``rows`` examples (FLOPs by
    ``needle.checkpoint``'s rule: a matmul 2mkn, elementwise one per output element)."""
    import needle as ndl
    from needle.autograd import Tensor
    from needle.checkpoint.report import op_flops
    from needle.memory.observers import Observer, add_observer

    class Count(Observer):
        flops = ops = 0

        def op_begin(self, op, inputs):
            return type(op).__name__, [tuple(x.shape) for x in inputs]

        def op_end(self, token, node) -> None:
            if node is not None and not node._is_tuple:
                self.flops += op_flops(token[0], token[1], tuple(node.shape))
                self.ops += 1

    out = []
    with ndl.random.fork_rng():
        h = Tensor(np.zeros((rows, ctx.in_features), np.float32), device=ctx.device,
                   requires_grad=False)
        for layer in ctx.new_model().modules:
            count = Count()
            handle = add_observer(count)
            try:
                h = layer(h)
            finally:
                handle.remove()
            out.append((count.flops, count.ops))
    return out


def _checkpoint_front(ctx, rows: int, work) -> list[tuple[str | None, int, int]]:
    """(``--activation-checkpoints`` spec or None, recomputed FLOPs, recomputed ops) of the
    plans ``plan_checkpoints`` gives for ever smaller activation budgets over the layers'
    measured costs on ``rows`` examples: the least recompute for each reachable peak."""
    import needle as ndl
    from needle._core.errors import MemoryPlanError
    from needle.autograd import Tensor
    from needle.checkpoint import measure_layer_costs, plan_checkpoints

    with ndl.random.fork_rng():
        x = Tensor(np.zeros((rows, ctx.in_features), np.float32), device=ctx.device,
                   requires_grad=False)
        costs = measure_layer_costs(ctx.new_model(), x)
    flops = [max(f, 1) for f, _ in work]
    front: list = [(None, 0, 0)]
    budget = plan_checkpoints(costs, math.inf, policy="optimal").no_checkpoint_peak_bytes
    while len(front) < 12:
        try:
            plan = plan_checkpoints(costs, budget - 1, policy="optimal", compute_costs=flops)
        except MemoryPlanError:
            break
        budget = plan.predicted_peak_bytes
        if any(plan.checkpointed):
            spec = format_checkpoints((b - a, c) for (a, b), c in
                                      zip(plan.segments, plan.checkpointed, strict=True))
            recomputed = [i for (a, b), c in zip(plan.segments, plan.checkpointed, strict=True)
                          if c for i in range(a, b)]
            front.append((spec, sum(work[i][0] for i in recomputed),
                          sum(work[i][1] for i in recomputed)))
    return front


# ---- the candidates, cheapest first --------------------------------------------------------
def _default_candidates(cfg, ctx, world_size: int) -> list[Candidate]:
    rows = -(-cfg.batch_size // world_size)  # the largest share of a full batch
    stages = (1, 2, 3) if cfg.strategy == "zero" else (None,)
    params = sum(int(np.prod(p.shape)) * 4 for p in ctx.new_model().parameters())
    out = []
    for g in [g for g in MICRO_BATCHES if g <= rows]:
        mb = -(-rows // g)
        work = _layer_work(ctx, mb)
        flops, ops = sum(f for f, _ in work), sum(o for _, o in work)
        for spec, r_flops, r_ops in _checkpoint_front(ctx, mb, work):
            compute = g * ((3 * flops + r_flops) / FLOP_RATE + (2 * ops + r_ops) * OP_SECONDS)
            for stage in stages:
                ring = 2 * (world_size - 1) / world_size * params if world_size > 1 else 0
                sent = ring * (1.5 if stage == 3 else 1.0)
                out.append(Candidate(g, spec, stage, step_s=compute + sent / BYTE_RATE))
    return sorted(out, key=lambda c: (round(c.step_s, 12), c.accumulate,
                                      c.checkpoints is not None, c.zero_stage or 0))


def _pipeline_candidates(cfg, ctx, world_size: int) -> list[Candidate]:
    from needle.distributed.pipeline import simulator

    extra = cfg.extra or {}
    schedule = extra.get("schedule", "1f1b")
    v = extra.get("virtual_stages", 2) if schedule == "interleaved" else 1
    chunks = world_size * v
    layers = len(ctx.new_model().modules)
    out = []
    for m in MICRO_BATCHES:
        if m > cfg.batch_size or (schedule == "interleaved" and m % world_size):
            continue
        work = _layer_work(ctx, -(-cfg.batch_size // m))
        for cut in itertools.combinations(range(1, layers), chunks - 1):
            bounds = [0, *cut, layers]
            counts = tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))
            fwd = [sum(work[i][0] / FLOP_RATE + work[i][1] * OP_SECONDS for i in range(a, b))
                   for a, b in zip(bounds, bounds[1:], strict=False)]
            sim = simulator.simulate(schedule, stages=world_size, microbatches=m,
                                     forward=fwd, backward=[2 * f for f in fwd],
                                     virtual_stages=v if v > 1 else None)
            out.append(Candidate(microbatches=m, layers_per_stage=counts,
                                 step_s=float(sim.makespan)))
    return sorted(out, key=lambda c: (round(c.step_s, 12), c.microbatches))


# ---- peaks ------------------------------------------------------------------------------
def _peak(candidate: Candidate, cfg, ctx, rank: int, world_size: int, X, y) -> int:
    """This rank's predicted peak for ``candidate`` (the first step's or a later one's,
    whichever is larger), the largest over the ranks (collective)."""
    from . import peak
    from .loop import RunContext

    c = candidate.apply(cfg)
    run = RunContext(c, ctx.device, ctx.in_features, ctx.classes, rank, world_size)
    if candidate.microbatches is None:
        from .data import replica_share

        rows = replica_share(np.arange(cfg.batch_size), world_size, rank)
        got = peak.predict_default(c, run, X[rows], y[rows], None,
                                   stage=candidate.zero_stage or 0, rank=rank,
                                   world_size=world_size, ddp=cfg.strategy == "ddp")
    else:
        got = _pipeline_peak(candidate, c, run, rank, world_size, X, y)
    value = np.array([got["predicted"]], np.int64)
    if world_size > 1:
        import needle.distributed as dist

        with dist.traffic.label("memory plan"):
            dist.all_reduce(value, op="max")
    return int(value[0])


def _pipeline_peak(candidate: Candidate, cfg, ctx, rank: int, world_size: int, X, y) -> dict:
    """This rank's stage peak for a pipeline candidate (first and later step)."""
    import gc

    import needle as ndl
    from needle import nn
    from needle.distributed import pipeline

    from . import peak

    extra = cfg.extra or {}
    name = extra.get("schedule", "1f1b")
    chunks_n = len(candidate.layers_per_stage)
    mine = list(range(rank, chunks_n, world_size))
    with ndl.random.fork_rng():
        chunks, tails = peak.pipeline_chunks(ctx, candidate.layers_per_stage, mine)
        stages = [pipeline.PipelineStage(chunks[k], k, chunks_n, device=ctx.device)
                  for k in mine]
        schedule = pipeline.schedule_class(name)(stages if len(stages) > 1 else stages[0],
                                                 candidate.microbatches,
                                                 loss_fn=nn.SoftmaxLoss())
        items = peak.trace_schedule(schedule, chunks, tails, X, y, ctx.device)
        held_of = {}
        model = nn.Sequential(*[chunks[k] for k in mine])
        optimizer = ctx.new_optimizer(model.parameters())
        for first in (True, False):
            held_of[first] = peak.held_at_start(model, optimizer, 0, world_size, rank, first,
                                                peak.workspace_bytes(ctx.device))
        params = [(peak._bytes(p), True) for p in model.parameters()]
        best: dict = {}
        for first, held in held_of.items():
            got = peak.pipeline_peak(items, held, optimizer, params, ctx.device, first)
            if not best or got["predicted"] > best["predicted"]:
                best = got
        del chunks, stages, schedule, model
        gc.collect()
    return best


# ---- the plan --------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """The choice (``chosen``) and what was tried before it."""

    budget: int
    chosen: Candidate
    predicted_peak: int
    rejected: list
    candidates: int

    def block(self, summary: dict) -> dict:
        """``summary.json``'s ``plan``: the choice beside the run's measurement."""
        rows = summary.get("memory", {}).get("per_rank", [])
        measured = max((r["peak"]["max_measured"] for r in rows if r.get("peak")), default=None)
        step_s = (summary.get("memory", {}).get("peak") or {}).get("step_s_median")
        return {"budget": self.budget, "chosen": self.chosen.options(),
                "predicted_peak": self.predicted_peak, "measured_peak": measured,
                "within_budget": measured is not None and measured <= self.budget,
                "predicted_step_s": self.chosen.step_s, "measured_step_s": step_s,
                "time_model": TIME_MODEL, "rejected": self.rejected,
                "candidates": self.candidates,
                "peak": "per rank, the largest over the ranks and over the first and a later "
                        "full step; measured: the largest step peak of the run"}


def choose(cfg, rank: int, world_size: int):
    """(``cfg`` with the chosen options, the :class:`Plan`); raises :class:`UsageError`
    naming the smallest predicted peak when nothing fits (on every rank alike)."""
    from .data import load_data
    from .loop import RunContext
    from .models import device_by_name

    device = device_by_name(cfg.device)
    X, y, _, yt = load_data(cfg)
    X, y = np.zeros((cfg.batch_size, X.shape[1]), X.dtype), np.zeros(cfg.batch_size, y.dtype)
    ctx = RunContext(cfg, device, X.shape[1], int(max(y.max(), yt.max())) + 1, rank,
                     world_size)
    _warm_workspace(ctx)
    listed = (_pipeline_candidates if cfg.strategy == "pipeline" else _default_candidates)(
        cfg, ctx, world_size)
    rejected = []
    for candidate in listed:
        peak = _peak(candidate, cfg, ctx, rank, world_size, X, y)
        if peak <= cfg.memory_budget:
            return candidate.apply(cfg), Plan(cfg.memory_budget, candidate, peak, rejected,
                                              len(listed))
        rejected.append({"config": candidate.options(), "predicted_peak": peak,
                         "predicted_step_s": candidate.step_s,
                         "reason": f"predicted peak {peak:,} B > budget "
                                   f"{cfg.memory_budget:,} B"})
    least = min(rejected, key=lambda r: r["predicted_peak"])
    options = " ".join(f"{k} {v}" for k, v in least["config"].items() if v is not None)
    raise UsageError(f"--memory-budget {cfg.memory_budget}: no configuration fits; the "
                     f"smallest predicted peak is {least['predicted_peak']:,} bytes per rank "
                     f"({options}) among {len(listed)} candidates")


def _warm_workspace(ctx) -> None:
    """One evaluation-sized forward (256 examples, as ``evaluate_model``): kernels keep the
    scratch the run's largest products need from the start, so the workspace the predictions
    read is the run's."""
    import needle as ndl
    from needle.autograd import Tensor, no_grad

    with ndl.random.fork_rng(), no_grad():
        model = ctx.new_model().eval()
        model(Tensor(np.zeros((256, ctx.in_features), np.float32), device=ctx.device,
                     requires_grad=False))
