"""The time and memory model of a training step: one set of formulas, fed either a cluster's
numbers (a device's FLOP rate, a link's bandwidth) or this machine's calibration.

What a step costs on one GPU (or process) of a ``dp x tp x pp`` layout, ZeRO stage ``z``:

* memory by term: :func:`needle.memory.estimate` (16 bytes per parameter in mixed precision
  with Adam: 2 weights + 2 gradients + 4 master + 8 moments; ZeRO divides terms by ``dp``,
  tensor and pipeline parallelism divide all by ``tp·pp``), plus activations: per micro-batch
  ``arrays x width x layers`` values per example on a stage, times the micro-batches a schedule
  holds (GPipe ``m``, 1F1B ``min(p, m)``), less with checkpointing (below);
* compute: a layer's forward costs ``op_time`` (the device's per-operation overhead, zero on a
  cluster) plus ``FLOPs / rate``; its backward twice that; checkpointing adds one forward;
* traffic per step (bytes each GPU sends, ``traffic.py``'s ring formulas): data parallel
  ``2(dp-1)/dp·M`` (all-reduce, or reduce-scatter + all-gather with ZeRO 1-2), ``3(dp-1)/dp·M``
  with ZeRO 3 (weights gathered in forward and backward); tensor parallel one all-reduce of a
  layer's output per layer forward and one backward; pipeline the activation and its adjoint
  per stage edge and micro-batch;
* time: :func:`~needle.distributed.calibrate.collective_time` for every collective on the
  link (``rounds·α + β·bytes``), the pipeline simulator for the stages (messages on the link),
  data-parallel communication hidden behind the backward when ``overlap`` (then only what
  outlasts it shows);
* time to train: ``tokens / tokens per step x step time``, or ``FLOPs / rate``.

Checkpoint policies: ``none`` keeps every layer's activations; ``every:k`` keeps the input of
every ``k``-th layer and rebuilds a segment of ``k`` layers at a time in backward (peak:
``ceil(L/k)`` inputs plus one segment); ``sqrt`` is ``every:round(sqrt(L))``; ``full`` is
``every:1``.

Example (the course's numbers):
    >>> m = Model.dense(70e9)
    >>> memory(m, Layout())["model_state"] / 1e12                 # 16 bytes x 70e9
    1.12
    >>> memory(m, Layout(dp=64, zero=3))["model_state"] / 1e9     # ZeRO-3 over 64 GPUs
    17.5
    >>> round(years(7e23 / 4e14), 1)                              # one GPU at 4e14 FLOP/s
    55.5
    >>> iteration_time(2e-3, 1_000_000, Link.from_bandwidth(1e8))  # 2 ms compute + 10 ms
    0.012
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from needle.distributed.calibrate import Link, collective_time

__all__ = ["Layer", "Model", "Device", "Layout", "Noise", "Prediction", "PlanError", "memory",
           "traffic", "stage_costs", "stage_layers", "predict", "iteration_time", "years",
           "time_to_train", "Link", "SECONDS_PER_YEAR"]

SECONDS_PER_YEAR = 365.25 * 24 * 3600
_VALUE_BYTES = {"mixed": 2, "fp32": 4}


class PlanError(ValueError):
    """Inconsistent plan arguments."""


@dataclass(frozen=True)
class Layer:
    """One layer: parameter elements and tensors, forward FLOPs and output values per example
    (what crosses a stage edge after it), leaf operations, and tensor-parallel all-reduces of
    its output (forward; backward has as many)."""

    params: int = 0
    flops: float = 0.0
    width: int = 0
    tensors: int = 0
    ops: int = 1
    tp_allreduces: int = 0


@dataclass(frozen=True)
class Model:
    """A model as its layers (examples: sequences x positions for a language model)."""

    layers: tuple[Layer, ...]
    arrays_per_layer: int = 17  # values per example per layer kept for backward, in units of
    # its width (a transformer layer keeps ~34·h bytes per token in 16-bit: 17 arrays)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def flops(self) -> float:
        """Forward FLOPs per example (backward: twice; a step: 6 x params per example)."""
        return sum(layer.flops for layer in self.layers)

    @classmethod
    def dense(cls, params: float, layers: int = 1, width: int = 0, tp_allreduces: int = 2,
              arrays_per_layer: int = 17) -> "Model":
        """A model given by its size: ``layers`` equal layers of ``params / layers`` parameters,
        forward ``2 x params`` FLOPs per example (token), ``width`` values out per example;
        Megatron's two all-reduces per layer under tensor parallelism."""
        if params <= 0 or layers < 1:
            raise PlanError(f"Model.dense: params and layers must be positive, got "
                            f"{params}, {layers}")
        each = int(round(params / layers))
        layer = Layer(each, 2.0 * each, width, 4, 1, tp_allreduces)
        return cls(tuple([layer] * layers), arrays_per_layer)

    @classmethod
    def from_shapes(cls, shapes: str, arrays_per_layer: int = 4,
                    ops_per_layer: int = 1) -> "Model":
        """Linear layers from ``"64x100,100x50,..."`` (weights and bias; 2·in·out FLOPs per
        example), tensor-parallel in column/row pairs (one all-reduce per pair)."""
        layers = []
        for i, text in enumerate(s for s in shapes.split(",") if s.strip()):
            try:
                a, b = (int(x) for x in text.lower().split("x"))
            except ValueError:
                raise PlanError(f"Model.from_shapes: expected IN x OUT like 64x100, got "
                                f"{text!r}") from None
            layers.append(Layer(a * b + b, 2.0 * a * b, b, 2, ops_per_layer, i % 2))
        if not layers:
            raise PlanError(f"Model.from_shapes: no layers in {shapes!r}")
        return cls(tuple(layers), arrays_per_layer)

    @classmethod
    def from_module(cls, module: Any, in_features: int, arrays_per_layer: int = 4) -> "Model":
        """Each top-level layer of an ``nn.Sequential``: its parameters, its Linear FLOPs
        (2·in·out per example, nested layers included), its leaf modules as operations, its
        output width (one example through it)."""
        import numpy as np

        from needle.autograd import Tensor, no_grad

        layers = []
        x = Tensor(np.zeros((1, in_features), np.float32), requires_grad=False)
        was = getattr(module, "training", True)
        module.eval()
        try:
            for layer in module.modules:
                leaves = _leaves(layer)
                flops = sum(2.0 * math.prod(p.shape) for leaf in leaves
                            for p in leaf.parameters() if len(p.shape) == 2)
                params = layer.parameters()
                with no_grad():
                    x = layer(x)
                layers.append(Layer(sum(math.prod(p.shape) for p in params), flops,
                                    int(math.prod(x.shape[1:])), len(params), len(leaves)))
        finally:
            module.train(was)
        return cls(tuple(layers), arrays_per_layer)


def _leaves(module: Any) -> list:
    children = list(module._children()) if hasattr(module, "_children") else []
    return [module] if not children else [leaf for c in children for leaf in _leaves(c)]


@dataclass(frozen=True)
class Device:
    """A device (or a process on this machine): sustained FLOP rate, memory, and the costs a
    calibration measures: per-operation overhead of a forward, per-parameter-tensor optimizer
    overhead, optimizer FLOPs per parameter, a fixed cost per step; ``cores``: processes
    beyond this many share cores, their compute stretches (a calibration sets it to the
    machine's cores, or to the processes that profiled at once when more: their sharing is in
    the profile already); a backward costs ``backward_ratio`` forwards (2: twice the FLOPs);
    ``sync_tensor_time``: what the data-parallel gradient sync costs the training thread per
    parameter tensor beyond its collectives (packing each gradient into its bucket, writing
    the result back; zero where kernels do it beside the compute)."""

    flops: float = 4e14
    memory: float | None = 80e9
    op_time: float = 0.0
    optimizer_tensor_time: float = 0.0
    optimizer_flops: float = 0.0
    step_time: float = 0.0
    cores: int | None = None
    backward_ratio: float = 2.0
    sync_tensor_time: float = 0.0


@dataclass(frozen=True)
class Layout:
    """How the job is spread: ``dp x tp x pp`` processes, ZeRO stage, micro-batches per step,
    the pipeline schedule, checkpoint policy, precision and optimizer, whether data-parallel
    communication overlaps the backward."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    checkpoint: str = "none"
    precision: str = "mixed"
    optimizer: str = "adam"
    overlap: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def check(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "virtual_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise PlanError(f"Layout: {name} must be a positive integer, got "
                                f"{getattr(self, name)!r}")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"Layout: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.precision not in _VALUE_BYTES:
            raise PlanError(f"Layout: precision must be one of {sorted(_VALUE_BYTES)}, got "
                            f"{self.precision!r}")
        _segment(self.checkpoint, 1)


def _segment(policy: str, num_layers: int) -> int:
    """Layers per recomputed segment (0: no checkpointing)."""
    if policy == "none":
        return 0
    if policy == "full":
        return 1
    if policy == "sqrt":
        return max(1, round(math.sqrt(num_layers)))
    if policy.startswith("every:") and policy[6:].isdigit() and int(policy[6:]) >= 1:
        return int(policy[6:])
    raise PlanError(f"checkpoint policy must be none, full, sqrt or every:K, got {policy!r}")


def _stages(model: Model, layout: Layout) -> list[list[Layer]]:
    """The layers of each of the ``pp x virtual_stages`` stages (contiguous, by parameters)."""
    from needle.distributed.pipeline import balance

    count = layout.pp * layout.virtual_stages
    if count > len(model.layers):
        raise PlanError(f"{count} pipeline stages need at least as many layers, got "
                        f"{len(model.layers)}")
    bounds = balance([1.0 + layer.params for layer in model.layers], count)
    return [list(model.layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _in_flight(layout: Layout) -> int:
    m, p = layout.microbatches, layout.pp
    if p == 1:
        return 1
    return m if layout.schedule == "gpipe" else min(p, m)


def memory(model: Model, layout: Layout, batch: int = 0) -> dict[str, float]:
    """Bytes per GPU by term (``weights``, ``gradients``, ``master``, ``optimizer``,
    ``activations``), ``model_state`` and ``total``, for ``batch`` examples per step (summed
    over data-parallel replicas). Activations: the heaviest stage's, for the micro-batches its
    schedule holds, whole on each tensor-parallel rank (a conservative choice)."""
    from needle.memory import estimate

    layout.check()
    stage = max(_stages(model, layout), key=lambda layers: sum(x.width for x in layers))
    per_mb = batch / layout.dp / layout.microbatches
    value = _VALUE_BYTES[layout.precision]
    widths = [x.width for x in stage]
    k = _segment(layout.checkpoint, len(widths))
    if k == 0:
        kept = sum(widths) * model.arrays_per_layer
    else:  # every k-th layer's input, plus the segment being rebuilt
        kept = sum(widths[::k]) + max(sum(widths[i:i + k])
                                      for i in range(0, len(widths), k)) * model.arrays_per_layer
    acts = per_mb * kept * value * _in_flight(layout)
    led = estimate(num_params=model.params, precision=layout.precision,
                   optimizer=layout.optimizer, zero_stage=layout.zero, dp=layout.dp,
                   tp=layout.tp, pp=layout.pp, activation_bytes=int(round(acts)), margin=0)
    out = {"weights": led["working weights"], "gradients": led["gradients"],
           "master": led["master weights"], "optimizer": led["optimizer moments"],
           "activations": led["activations"]}
    out["model_state"] = led.model_state_bytes
    out["total"] = led.subtotal_bytes
    return {k: float(v) for k, v in out.items()}


def traffic(model: Model, layout: Layout, batch: int = 0) -> dict[str, float]:
    """Bytes one GPU sends per step: ``dp`` (gradients and ZeRO weight gathers), ``tp``
    (activation all-reduces), ``pp`` (activations and adjoints across its stage edge), and
    ``total``; the ring formulas of ``needle.distributed.traffic``."""
    from needle.distributed import traffic as formulas

    layout.check()
    value = _VALUE_BYTES[layout.precision]
    grads = model.params / (layout.tp * layout.pp) * value
    n = layout.dp
    if layout.zero == 3:  # all-gather in forward and in backward, reduce-scatter
        dp = 3 * (n - 1) / n * grads
    else:  # all-reduce = reduce-scatter + all-gather: the same bytes
        dp = 2 * (n - 1) / n * grads
    per_mb = batch / layout.dp / layout.microbatches
    stages = _stages(model, layout)
    heaviest = max(stages, key=lambda layers: sum(x.tp_allreduces * x.width for x in layers))
    ar = sum(2 * x.tp_allreduces * x.width for x in heaviest) * per_mb * value
    tp = formulas.ring_all_reduce_bytes(int(ar), 1, layout.tp, 0)[0] * layout.microbatches
    edges = [stage[-1].width for stage in stages[:-1]]
    pp = 2 * max(edges, default=0) * per_mb * value * layout.microbatches * (
        layout.virtual_stages if layout.pp > 1 else 0)
    out = {"dp": float(dp), "tp": float(tp), "pp": float(pp)}
    out["total"] = sum(out.values())
    return out


def stage_costs(model: Model, layout: Layout, device: Device, batch: int
                ) -> dict[str, list[float]]:
    """Seconds of one micro-batch's forward and backward on each stage (``F``, ``B``), and of
    the optimizer step on one GPU (``optimizer``, one value)."""
    layout.check()
    per_mb = batch / layout.dp / layout.microbatches
    stretch = _stretch(layout, device)
    f, b = [], []
    for layers in _stages(model, layout):
        ops = sum(x.ops for x in layers) * device.op_time
        work = sum(x.flops for x in layers) * per_mb / layout.tp / device.flops
        fwd = (ops + work) * stretch
        f.append(fwd)
        b.append(device.backward_ratio * fwd
                 + (fwd if _segment(layout.checkpoint, len(layers)) else 0.0))
    share = model.params / layout.pp / layout.tp / (layout.dp if layout.zero else 1)
    tensors = sum(x.tensors for x in model.layers) / layout.pp
    opt = (tensors * device.optimizer_tensor_time + share * device.optimizer_flops
           / device.flops) * stretch
    sync = tensors * device.sync_tensor_time * stretch if layout.dp > 1 else 0.0
    return {"F": f, "B": b, "optimizer": [opt], "sync": [sync]}


def _stretch(layout: Layout, device: Device) -> float:
    """Compute slows down when more processes than cores share the machine."""
    if device.cores is None:
        return 1.0
    return max(1.0, layout.gpus / device.cores)


@dataclass
class Noise:
    """What a loaded machine adds, as measured samples: ``compute`` (ratios of profiled
    compute samples to their median) and the link's residuals (seconds: ``flight``, ``send``,
    ``recv`` around its fit, ``wake`` around its median; ``LinkProbe.residuals()``)."""

    def compute_mean(self) -> float:
        """How much slower than its median an operation runs on average."""
        return sum(self.compute) / len(self.compute) if self.compute else 1.0

    compute: list[float] = field(default_factory=lambda: [1.0])
    flight: list[float] = field(default_factory=list)
    send: list[float] = field(default_factory=list)
    recv: list[float] = field(default_factory=list)
    wake: list[float] = field(default_factory=list)

    def link_noise(self) -> dict[str, list[float]]:
        return {"flight": self.flight, "send": self.send, "recv": self.recv, "wake": self.wake}


@dataclass
class Prediction:
    """What :func:`predict` returns (seconds, bytes)."""

    step: float
    bubble: float
    compute: float
    communication: float
    optimizer: float
    memory: dict
    traffic: dict
    parts: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _dp_collectives(model: Model, layout: Layout) -> list[tuple[str, float]]:
    grads = model.params / (layout.tp * layout.pp) * _VALUE_BYTES[layout.precision]
    if layout.dp == 1:
        return []
    if layout.zero == 3:
        return [("all_gather", grads), ("all_gather", grads), ("reduce_scatter", grads)]
    if layout.zero:
        return [("reduce_scatter", grads), ("all_gather", grads)]
    return [("all_reduce", grads)]


def predict(model: Model, layout: Layout, device: Device, link: Link, batch: int,
            tp_link: Link | None = None, collectives: Sequence[tuple[str, float]] = (),
            noise: Noise | None = None, draws: int = 0,
            stage_samples: dict | None = None, adjoint_in_backward: bool = False
            ) -> Prediction:
    """One training step of ``batch`` examples (all replicas together).

    The pipeline (or the one stage) is simulated with its messages on ``link``; each layer's
    tensor-parallel all-reduces (on ``tp_link``, default ``link``: inside a server it is
    usually faster) sit in its forward and backward; the data-parallel gradient collectives
    run on ``link`` after the backward (hidden behind it with ``layout.overlap``: then only
    what outlasts it shows); then the optimizer, ``collectives`` (more per-step collectives of
    the whole job, ``(kind, bytes)``: a loss reduction, a barrier) and the device's fixed
    step time. ``stage_samples`` (``{"F": [[s, ...] per stage], "B": ..., "W": ...}``,
    seconds per micro-batch, from a profiled step) replace the device's compute model for
    the stages; ``adjoint_in_backward``: the pipeline posts each adjoint inside ``B``, as
    needle's runtime does (see ``needle.distributed.pipeline.simulator.simulate``).

    With ``noise`` and ``draws > 0`` (one-dimensional layouts: ``dp``, ``tp`` or ``pp``
    alone), the step is the mean of ``draws`` random draws in which every rank's compute is
    scaled by a sampled ratio (or drawn from ``stage_samples``) and every collective is a
    meeting point: it starts when the last rank arrives, and a rank that waited longer than
    the link's ``spin`` leaves ``wake`` late (the machine's measured noise; docs/plan.md).
    """
    costs = stage_costs(model, layout, device, batch)
    tp_link = tp_link or link
    value = _VALUE_BYTES[layout.precision]
    per_mb = batch / layout.dp / layout.microbatches
    stages = _stages(model, layout)
    tp_each = [[collective_time("all_reduce", x.width * per_mb * value, layout.tp, tp_link)
                for x in s for _ in range(x.tp_allreduces)] for s in stages]
    samples = _samples(costs, tp_each, stage_samples)
    mean = {k: [sum(v) / len(v) for v in vs] for k, vs in samples.items()}
    dp_colls = _dp_collectives(model, layout)
    dp = sum(collective_time(kind, n, layout.dp, link) for kind, n in dp_colls)
    extra = sum(collective_time(kind, n, layout.gpus, link) for kind, n in collectives)
    opt, sync = costs["optimizer"][0], costs["sync"][0]
    inside = {"adjoint_in_backward": adjoint_in_backward}
    span, bubble, _ = _pipeline(layout, samples, stages, per_mb * value, link, **inside)
    last_backward = mean["B"][0] if layout.pp > 1 else layout.microbatches * mean["B"][0]
    exposed = max(0.0, dp - last_backward) if layout.overlap else dp
    step = span + exposed + sync + opt + extra + device.step_time
    parts = {"pipeline": span, "dp_communication": dp, "sync": sync, "collectives": extra,
             "tp_per_stage": [sum(t) for t in tp_each], "forward": mean["F"],
             "backward": mean["B"], "draws": 0}
    one_dimensional = sorted((layout.dp, layout.tp, layout.pp))[:2] == [1, 1]
    if noise is not None and draws > 0 and one_dimensional:
        segments = _segments(layout, samples, tp_each, dp_colls, collectives,
                             sync + opt + device.step_time, link, tp_link)
        runs = [_draw(segments, layout, stages, per_mb * value, link, noise, k,
                      stage_samples is None, inside) for k in range(draws)]
        step = sum(r["step"] for r in runs) / draws
        if layout.pp > 1:
            bubble = sum(r["bubble"] for r in runs) / draws
            parts["pipeline"] = sum(r["span"] for r in runs) / draws
        parts["draws"] = draws
    tp_stage = [sum(t) for t in tp_each] if stage_samples is None else [0.0] * len(stages)
    compute = layout.microbatches * sum(mean["F"][i] + mean["B"][i] + mean["W"][i]
                                        - 2 * tp_stage[i] for i in range(len(stages))) / layout.pp
    tp_total = 2 * layout.microbatches * sum(map(sum, tp_each)) / layout.pp
    return Prediction(step, bubble, compute, exposed + extra + tp_total, opt,
                      memory(model, layout, batch), traffic(model, layout, batch), parts)


def _samples(costs: dict, tp_each: list, given: dict | None) -> dict[str, list[list[float]]]:
    """Per stage: samples of F, B and W (one sample: the model's cost), tensor-parallel
    all-reduces included."""
    if given is not None:
        out = {k: [list(map(float, v)) for v in given[k]] for k in ("F", "B")}
        out["W"] = [list(map(float, v)) for v in given.get("W", [[0.0]] * len(out["F"]))]
        return out
    return {"F": [[f + sum(t)] for f, t in zip(costs["F"], tp_each, strict=True)],
            "B": [[b + sum(t)] for b, t in zip(costs["B"], tp_each, strict=True)],
            "W": [[0.0] for _ in costs["F"]]}


def _pipeline(layout: Layout, samples: dict, stages: list, value: float, link: Link,
              **extra: Any) -> tuple[float, float, Any]:
    """(makespan, bubble, Simulation or None) of the micro-batches of one step."""
    from needle.distributed.pipeline import make_plan, simulate

    if layout.pp == 1:
        f, b, w = (sum(x[0]) / len(x[0]) for x in (samples["F"], samples["B"], samples["W"]))
        return layout.microbatches * (f + b + w), 0.0, None
    plan = make_plan(layout.schedule, layout.pp, layout.microbatches,
                     layout.virtual_stages if layout.schedule == "interleaved" else None)
    edges = [s[-1].width * value for s in stages[:-1]]
    split = plan.split_backward and any(any(x) for x in samples["W"])
    sim = simulate(plan, forward=samples["F"], backward=samples["B"],
                   weight=samples["W"] if split else None, link=link, message_bytes=edges,
                   **extra)
    return sim.makespan, sim.bubble_fraction, sim


def _segments(layout: Layout, samples: dict, tp_each: list, dp_colls: list, collectives,
              fixed: float, link: Link, tp_link: Link) -> list:
    """The step as a list of ``("compute", s)``, ``("meet", kind, bytes, link)`` and
    ``("pipeline", samples)`` segments, the same on every rank (``fixed``: the optimizer and
    the device's step time)."""
    seg: list = []
    if layout.pp > 1:
        seg.append(("pipeline", samples))
    else:
        meets = [("meet", "all_reduce", t, tp_link) for t in tp_each[0]]
        f, b = (sum(samples[k][0]) / len(samples[k][0]) for k in ("F", "B"))
        for _ in range(layout.microbatches):  # forward with its all-reduces, then backward
            for cost in (f, b):
                piece = ("compute", cost / (len(meets) + 1))
                seg.append(piece)
                for meet in meets:
                    seg += [meet, piece]
    seg += [("meet", kind, n, link) for kind, n in dp_colls]
    seg.append(("compute", fixed))
    seg += [("meet", kind, n, link) for kind, n in collectives]
    return seg


def _draw(segments: list, layout: Layout, stages: list, value: float, link: Link,
          noise: Noise, seed: int, scale_stages: bool, extra: dict) -> dict[str, float]:
    """One random draw of the step: its time, and the pipeline's bubble and makespan."""
    import random

    from needle.distributed.calibrate import collective_rounds

    rng = random.Random(seed)
    ranks = layout.gpus
    clock = [0.0] * ranks
    out = {"bubble": 0.0, "span": 0.0}
    for seg in segments:
        if seg[0] == "compute":
            clock = [c + seg[1] * rng.choice(noise.compute) for c in clock]
        elif seg[0] == "meet":
            _, kind, nbytes, on = seg
            start = max(clock)
            base = collective_time(kind, nbytes, ranks, on)
            jitter = sum(rng.choice(noise.flight) for _ in range(
                collective_rounds(kind, ranks))) if noise.flight else 0.0
            wake = max(0.0, on.wake + (rng.choice(noise.wake) if noise.wake else 0.0))
            clock = [start + max(0.0, base + jitter) + (wake if start - c > on.spin else 0.0)
                     for c in clock]
        else:
            samples = seg[1]
            if scale_stages:  # the model's one cost per stage, scaled by the compute noise
                samples = {k: [[x[0] * r for r in noise.compute] for x in v]
                           for k, v in samples.items()}
            span, out["bubble"], sim = _pipeline(layout, samples, stages, value, link,
                                                 seed=seed, message_noise=noise.link_noise(),
                                                 **extra)
            out["span"] = span
            start = max(clock)
            clock = [start + row[-1].end if row else start for row in sim.timeline]
    out["step"] = max(clock)
    return out


def iteration_time(compute: float, transfer_bytes: float, link: Link,
                   overlap: bool = False) -> float:
    """A step of ``compute`` seconds that moves ``transfer_bytes`` over ``link``: the sum,
    or the longer of the two when the transfer overlaps the compute."""
    move = link.time(transfer_bytes)
    return max(compute, move) if overlap else compute + move


def years(seconds: float) -> float:
    """Seconds in Julian years (365.25 days)."""
    return seconds / SECONDS_PER_YEAR


def time_to_train(tokens: float, tokens_per_step: float, step: float) -> float:
    """Seconds to see ``tokens`` at ``tokens_per_step`` per step of ``step`` seconds."""
    if tokens_per_step <= 0:
        raise PlanError(f"time_to_train: tokens per step must be positive, got "
                        f"{tokens_per_step}")
    return math.ceil(tokens / tokens_per_step) * step


def stage_layers(model: Model, layout: Layout) -> Sequence[Sequence[Layer]]:
    """The layers of each stage (as :func:`stage_costs` cuts them)."""
    return _stages(model, layout)
