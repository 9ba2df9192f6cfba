"""This machine's calibration: the link from a ping-pong probe, the device from profiled steps,
the noise of both, in one JSON file that ``python -m needle.plan --calibration FILE`` reads.

``python -m needle.plan calibrate --out calibration.json`` starts ``--nproc`` ranks (default
2) through needle's launcher; calibrate with as many processes as the job will run: on an
oversubscribed machine the probe and the profile then see the same sharing of the cores.
Ranks 0 and 1 run :func:`needle.distributed.calibrate.probe_link` (α, β, the CPU time of
each end, the wake-up delay of a long wait); then every rank, all at once (as a job's ranks
run), profiles training steps of a reference model at a few batch sizes and fits the
:class:`~needle.plan.model.Device`:

* forward ``F(b) = ops x op_time + FLOPs(b) / rate`` (least squares over the batch sizes ``b``;
  ``ops`` counts the model's leaf modules), backward ``backward_ratio x F``;
* optimizer step ``tensors x optimizer_tensor_time`` (per parameter tensor);
* ``step_time``: what a whole step costs beyond those (gradient reset, host reads of the loss);
* with two or more ranks, ``sync_tensor_time``: a profiled data-parallel step
  (:func:`calibrate_sync`: ``DistributedDataParallel`` without overlap) costs the training
  thread this much per parameter tensor beyond the plain backward and beyond the same
  all-reduce timed alone (packing the gradients into the bucket, writing the sums back).

The noise is kept as samples: compute (each profiled sample of F, B and the optimizer over
the median of its kind and batch size: 1 for an undisturbed run, 3 for one preempted for
twice its length) and the link's residuals; :func:`needle.plan.model.predict` draws from them
(the mean ratio is how much slower than its median an operation runs on average).

Example:
    >>> cal = Calibration(link=Link(alpha=1e-4), device=Device(flops=1e10))
    >>> Calibration.from_dict(cal.as_dict()).link.alpha
    0.0001
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from needle.distributed.calibrate import Link, fit_alpha_beta

from .model import Device, Model, Noise

__all__ = ["Calibration", "calibrate_device", "calibrate_sync", "machine", "load"]


def machine() -> dict:
    """CPU model, logical cores, load average and the date (UTC)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        loadavg = list(os.getloadavg())
    except OSError:
        loadavg = []
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average": loadavg,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


@dataclass
class Calibration:
    """The link, the device and their noise, with where and when they were measured."""

    link: Link = field(default_factory=Link)
    device: Device = field(default_factory=Device)
    noise: Noise = field(default_factory=Noise)
    machine: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)  # what was profiled, the raw medians

    def as_dict(self) -> dict:
        return {"link": self.link.as_dict(), "device": asdict(self.device),
                "noise": asdict(self.noise), "machine": self.machine,
                "reference": self.reference}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        return cls(Link.from_dict(data.get("link", {})), Device(**data.get("device", {})),
                   Noise(**data.get("noise", {})), data.get("machine", {}),
                   data.get("reference", {}))

    def save(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)
        return path


def load(path: str) -> Calibration:
    """Read a calibration file written by ``python -m needle.plan calibrate``."""
    with open(path) as f:
        return Calibration.from_dict(json.load(f))


def _reference_step(module: Any, optimizer: Any, loss_fn: Any, x: np.ndarray,
                    y: np.ndarray, repeats: int) -> dict[str, list[float]]:
    """Samples of F (forward and loss), B, the optimizer step and a whole step."""
    from needle.autograd import Tensor

    out: dict[str, list[float]] = {"F": [], "B": [], "optimizer": [], "step": []}
    for k in range(repeats + 1):
        t0 = time.perf_counter()
        optimizer.reset_grad()
        t1 = time.perf_counter()
        logits = module(Tensor(x, requires_grad=False))
        loss = loss_fn(logits, Tensor(y, requires_grad=False))
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        optimizer.step()
        t4 = time.perf_counter()
        float(loss.numpy())
        logits.numpy().argmax(axis=1)
        t5 = time.perf_counter()
        if k:  # the first round allocates: dropped
            out["F"].append(t2 - t1)
            out["B"].append(t3 - t2)
            out["optimizer"].append(t4 - t3)
            out["step"].append(t5 - t0)
    return out


def calibrate_device(module: Any, in_features: int, classes: int, optimizer: Any,
                     batches: Sequence[int] = (8, 16, 32, 64), repeats: int = 20,
                     seed: int = 0) -> tuple[Device, list[float], dict]:
    """Fit a :class:`Device` from training steps of ``module`` (an ``nn.Sequential`` taking
    ``in_features`` values, ``classes`` outputs) with ``optimizer`` (over its parameters; they
    move) at each batch size. Returns (device, compute noise ratios, the medians per batch)."""
    from needle import nn

    rng = np.random.RandomState(seed)
    model = Model.from_module(module, in_features)
    ops = sum(layer.ops for layer in model.layers)
    tensors = sum(layer.tensors for layer in model.layers)
    medians: dict[str, dict[int, float]] = {"F": {}, "B": {}, "optimizer": {}, "step": {}}
    ratios: list[float] = []
    for b in batches:
        x = rng.randn(b, in_features).astype(np.float32)
        y = rng.randint(0, classes, b).astype(np.uint8)
        got = _reference_step(module, optimizer, nn.SoftmaxLoss(), x, y, repeats)
        for key, values in got.items():
            medians[key][b] = float(np.median(values))
        for key in ("F", "B", "optimizer"):
            ratios += [v / medians[key][b] for v in got[key] if medians[key][b] > 0]
    bs = sorted(medians["F"])
    intercept, slope = fit_alpha_beta(bs, [medians["F"][b] for b in bs])
    flops = model.flops
    rate = flops / slope if slope > 0 else 1e18
    f = {b: medians["F"][b] for b in bs}
    ratio = float(np.median([medians["B"][b] / f[b] for b in bs if f[b] > 0]))
    opt = float(np.median(list(medians["optimizer"].values())))
    rest = float(np.median([medians["step"][b] - medians["F"][b] - medians["B"][b]
                            - medians["optimizer"][b] for b in bs]))
    device = Device(flops=rate, memory=None, op_time=intercept / max(ops, 1),
                    optimizer_tensor_time=opt / max(tensors, 1), step_time=max(rest, 0.0),
                    cores=os.cpu_count(), backward_ratio=ratio)
    return device, ratios, {"batches": bs, "medians": medians, "ops": ops, "tensors": tensors,
                            "params": model.params, "flops_per_example": flops}


def calibrate_sync(module: Any, in_features: int, classes: int, batch: int = 32,
                   repeats: int = 20, seed: int = 0) -> tuple[float, dict]:
    """Collective over the default group: the per-parameter-tensor cost of the gradient sync
    on the training thread, from profiled steps of ``module`` at ``batch`` (its parameters
    get rank 0's values). Returns (seconds per tensor, the medians it came from): the median
    plain backward ``B``, then with ``DistributedDataParallel(overlap=False)`` the backward
    ``B_sync`` (its hooks pack) and ``finish`` (the all-reduce, the write-back), and the same
    all-reduce alone; ``(B_sync - B) + (finish - all_reduce)`` over the tensors."""
    import needle.distributed as dist
    from needle import nn
    from needle.autograd import Tensor

    rng = np.random.RandomState(seed + dist.get_rank())
    x = Tensor(rng.randn(batch, in_features).astype(np.float32), requires_grad=False)
    y = Tensor(rng.randint(0, classes, batch).astype(np.uint8), requires_grad=False)
    loss_fn = nn.SoftmaxLoss()
    params = module.parameters()

    def backward(forward: Any, after: Any = None) -> tuple[list[float], list[float]]:
        back, fin = [], []
        for k in range(repeats + 1):
            for p in params:
                p.grad = None
            loss = loss_fn(forward(x), y)
            dist.barrier()
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            if after is not None:
                after()
            t2 = time.perf_counter()
            if k:
                back.append(t1 - t0)
                fin.append(t2 - t1)
        return back, fin

    plain, _ = backward(module)
    ddp = dist.DistributedDataParallel(module, overlap=False)
    try:
        synced, finish = backward(ddp, ddp.finish_gradient_sync)
        flats = [np.zeros(b.layout.numel, b.dtype) for b in ddp.buckets]
    finally:
        ddp.close()
    alone = []
    for k in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for flat in flats:
            dist.all_reduce(flat, "sum", async_op=True, algorithm="ring").wait()
        if k:
            alone.append(time.perf_counter() - t0)
    med = {"B": float(np.median(plain)), "B_sync": float(np.median(synced)),
           "finish": float(np.median(finish)), "all_reduce": float(np.median(alone)),
           "tensors": len(params)}
    extra = (med["B_sync"] - med["B"]) + (med["finish"] - med["all_reduce"])
    return max(extra, 0.0) / max(len(params), 1), med


def probe_table(probe: dict, link: Link) -> str:
    """What a link probe measured (``LinkProbe.as_dict()``) beside the fit, as a table."""
    lines = [f"{'bytes':>9} {'one-way us':>11} {'fit us':>8} {'send busy us':>13} "
             f"{'recv busy us':>13}  (lower quartiles of {probe['repeats']})"]
    for n, t, s, r in zip(probe["sizes"], probe["one_way_s"], probe["send_busy_s"],
                          probe["recv_busy_s"], strict=True):
        lines.append(f"{n:>9,} {t * 1e6:>11.1f} {link.time(n) * 1e6:>8.1f} {s * 1e6:>13.1f} "
                     f"{r * 1e6:>13.1f}")
    lines.append(f"alpha {link.alpha * 1e6:.1f} us, beta {link.beta * 1e9:.3f} ns/B; send "
                 f"{link.send_fixed * 1e6:.1f} us + {link.send_per_byte * 1e9:.3f} ns/B; "
                 f"receive {link.recv_fixed * 1e6:.1f} us + {link.recv_per_byte * 1e9:.3f} "
                 f"ns/B; wake {link.wake * 1e6:.1f} us after {link.spin * 1e3:g} ms of waiting")
    return "\n".join(lines)


def reference_mlp(layers: str, seed: int = 0) -> tuple[Any, int, int]:
    """(``nn.Sequential`` of the Linear shapes with ReLU between, in features, classes)."""
    from needle import nn

    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in layers.split(",") if s]
    np.random.seed(seed)
    blocks: list = []
    for i, (a, b) in enumerate(shapes):
        blocks.append(nn.Linear(a, b))
        if i < len(shapes) - 1:
            blocks.append(nn.ReLU())
    return nn.Sequential(*blocks), shapes[0][0], shapes[-1][1]


def calibrate_job(module: Any, in_features: int, classes: int, optimizer: Any,
                  repeats: int = 20, timeout: float = 60.0) -> Calibration | None:
    """Collective over the default group (every rank at once, as a job's ranks run): the link
    probe between ranks 0 and 1, then every rank profiles ``module`` (its own copy) with
    ``optimizer``. The :class:`Calibration` on rank 0 (the device of the slowest rank's
    profile, noise pooled over ranks), None elsewhere."""
    import needle.distributed as dist
    from needle.distributed.calibrate import probe_link

    probe = probe_link(repeats=repeats, timeout=timeout) if dist.get_world_size() > 1 else None
    dist.barrier(timeout=timeout)
    device, ratios, ref = calibrate_device(module, in_features, classes, optimizer,
                                           repeats=repeats)
    if dist.get_world_size() > 1:
        per_tensor, ref["sync"] = calibrate_sync(module, in_features, classes,
                                                 repeats=repeats)
        device = replace(device, sync_tensor_time=per_tensor)
    every = dist.all_gather_object([asdict(device), ratios, ref["medians"]["step"]])
    if dist.get_rank() != 0:
        return None
    slowest = max(every, key=lambda row: sum(row[2].values()))
    # the ranks profiled at once: their sharing of the cores is in the profile
    slowest[0]["cores"] = max(os.cpu_count() or 1, len(every))
    noise = Noise(compute=[r for row in every for r in row[1]])
    link = Link()
    if probe is not None:
        res = probe.residuals()
        noise = Noise(noise.compute, res["flight"], res["send"], res["recv"], res["wake"])
        link = probe.link
        ref["probe"] = probe.as_dict()
    ref["ranks"] = len(every)
    return Calibration(link, Device(**slowest[0]), noise, machine(), ref)


def calibration_worker(out: str, layers: str, repeats: int) -> None:
    """One rank of ``python -m needle.plan calibrate`` (the reference MLP, Adam)."""
    import needle.distributed as dist
    from needle import optim

    dist.init_process_group(timeout=120)
    module, n_in, n_out = reference_mlp(layers)
    cal = calibrate_job(module, n_in, n_out, optim.Adam(module.parameters(), lr=1e-3),
                        repeats=repeats)
    if cal is not None:
        cal.reference["model"] = f"MLP {layers}, Adam"
        cal.save(out)
        if "probe" in cal.reference:
            print(probe_table(cal.reference["probe"], cal.link))
