"""``python -m needle.plan``: what a training layout costs per GPU, per step and to the end.

Example:
    $ python -m needle.plan --params 70e9                       # 16 B/param: 1.12 TB
    $ python -m needle.plan --params 70e9 --dp 64 --zero 3      # 17.5 GB per GPU
    $ python -m needle.plan --total-flops 7e23 --flops 4e14     # ~55 years on one GPU
    $ python -m needle.plan --compute-time 2e-3 --step-bytes 1e6 --bandwidth 1e8   # 12 ms
    $ python -m needle.plan --params 70e9 --num-layers 80 --width 8192 --dp 8 --tp 8 --pp 4 \\
          --zero 1 --microbatches 8 --batch 4194304 --tokens 15e12 --checkpoint full
    $ python -m needle.plan calibrate --out calibration.json   # this machine: probe + profile
    $ python -m needle.plan --calibration calibration.json --layers 64x100,100x10 --dp 2 \\
          --batch 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # started as a file (the launcher's calibration ranks)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))

from needle.plan.model import (  # noqa: E402
    Device,
    Layout,
    Link,
    Model,
    PlanError,
    iteration_time,
    predict,
    time_to_train,
    years,
)


def _number(text: str) -> float:
    return float(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m needle.plan",
                                description="Memory, traffic, step time, bubble and time to "
                                "train of a training layout (docs/plan.md).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--params", type=_number, default=None, help="parameters (e.g. 70e9)")
    m.add_argument("--num-layers", type=int, default=1, help="layers of a --params model")
    m.add_argument("--width", type=int, default=0,
                   help="values per example out of each layer (hidden size)")
    m.add_argument("--layers", default=None,
                   help="instead of --params: Linear shapes IN x OUT, comma-separated")
    m.add_argument("--arrays-per-layer", type=int, default=None,
                   help="activation arrays of --width values a layer keeps per example "
                        "(default 17 for --params: ~34·h bytes per token in 16-bit; 4 for "
                        "--layers)")
    lay = p.add_argument_group("layout")
    for name, default, text in (("dp", 1, "data-parallel degree"),
                                ("tp", 1, "tensor-parallel degree"),
                                ("pp", 1, "pipeline stages"), ("zero", 0, "ZeRO stage 0-3"),
                                ("microbatches", 1, "micro-batches per step"),
                                ("virtual-stages", 1, "chunks per rank (interleaved)")):
        lay.add_argument(f"--{name}", type=int, default=default, help=text)
    lay.add_argument("--schedule", default="1f1b",
                     help="gpipe, 1f1b, interleaved or zero-bubble")
    lay.add_argument("--checkpoint", default="none", help="none, full, sqrt or every:K")
    lay.add_argument("--precision", default="mixed", help="mixed (16-bit + fp32 master) or fp32")
    lay.add_argument("--optimizer", default="adam", help="adam, sgd_momentum or sgd")
    lay.add_argument("--overlap", action="store_true",
                     help="data-parallel communication overlaps the backward")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--flops", type=_number, default=None,
                    help="sustained FLOP/s per GPU (default 4e14, or the calibration's)")
    hw.add_argument("--memory", type=_number, default=None,
                    help="device memory in bytes (default 80e9)")
    hw.add_argument("--bandwidth", type=_number, default=None,
                    help="link bytes/s (default 25e9, or the calibration's)")
    hw.add_argument("--latency", type=_number, default=None, help="link latency in seconds")
    hw.add_argument("--tp-bandwidth", type=_number, default=None,
                    help="tensor-parallel link bytes/s (default: --bandwidth)")
    hw.add_argument("--calibration", default=None,
                    help="a file from 'python -m needle.plan calibrate': this machine's "
                         "device, link and noise")
    hw.add_argument("--draws", type=int, default=0,
                    help="with --calibration: average this many noisy draws")
    run = p.add_argument_group("run")
    run.add_argument("--batch", type=_number, default=0,
                     help="examples (tokens) per step, all replicas together")
    run.add_argument("--tokens", type=_number, default=None, help="token budget to train on")
    run.add_argument("--total-flops", type=_number, default=None,
                     help="training FLOPs (else 6 x params x tokens)")
    run.add_argument("--gpus", type=int, default=None,
                     help="with --total-flops: GPUs (default dp x tp x pp)")
    run.add_argument("--compute-time", type=_number, default=None,
                     help="with --step-bytes: a step's compute seconds")
    run.add_argument("--step-bytes", type=_number, default=None,
                     help="bytes a step moves over --bandwidth (with --compute-time)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return p


def _calibrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m needle.plan calibrate",
                                description="Probe the link and profile the device of this "
                                "machine; write a calibration file.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="calibration.json")
    p.add_argument("--nproc", type=int, default=2, help="ranks (all profile at once)")
    p.add_argument("--backend", default="mpi", choices=["mpi", "tcp"])
    p.add_argument("--layers", default="64x100,100x100,100x10",
                   help="reference MLP profiled (Linear IN x OUT, ReLU between)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _model(opts) -> Model | None:
    if opts.layers:
        return Model.from_shapes(opts.layers, opts.arrays_per_layer or 4)
    if opts.params:
        return Model.dense(opts.params, opts.num_layers, opts.width,
                           arrays_per_layer=opts.arrays_per_layer or 17)
    return None


def _hardware(opts):
    from needle.plan.calibration import load

    cal = load(opts.calibration) if opts.calibration else None
    device = cal.device if cal else Device()
    link = cal.link if cal else Link.from_bandwidth(25e9, 5e-6)
    changes = {k: v for k, v in (("flops", opts.flops), ("memory", opts.memory))
               if v is not None}
    device = Device(**{**device.__dict__, **changes})
    if opts.bandwidth is not None or opts.latency is not None:
        link = Link(**{**link.as_dict(),
                       "alpha": link.alpha if opts.latency is None else opts.latency,
                       "beta": link.beta if opts.bandwidth is None else 1 / opts.bandwidth})
    tp_link = Link.from_bandwidth(opts.tp_bandwidth, link.alpha) if opts.tp_bandwidth else None
    return cal, device, link, tp_link


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def what_if(opts) -> dict:
    """Every number the command prints, as a dict."""
    cal, device, link, tp_link = _hardware(opts)
    out: dict = {}
    if opts.compute_time is not None or opts.step_bytes is not None:
        if opts.compute_time is None or opts.step_bytes is None:
            raise PlanError("--compute-time and --step-bytes go together")
        out["iteration"] = {
            "compute_s": opts.compute_time, "transfer_s": link.time(opts.step_bytes),
            "serial_s": iteration_time(opts.compute_time, opts.step_bytes, link),
            "overlapped_s": iteration_time(opts.compute_time, opts.step_bytes, link, True)}
    model = _model(opts)
    layout = Layout(opts.dp, opts.tp, opts.pp, opts.zero, opts.microbatches, opts.schedule,
                    opts.virtual_stages, opts.checkpoint, opts.precision, opts.optimizer,
                    opts.overlap)
    layout.check()
    total = opts.total_flops
    if total is None and model is not None and opts.tokens:
        total = 6.0 * model.params * opts.tokens
    if total is not None:
        gpus = opts.gpus or layout.gpus
        seconds = total / (device.flops * gpus)
        out["flops_time"] = {"total_flops": total, "gpus": gpus, "flops_per_gpu": device.flops,
                             "seconds": seconds, "years": years(seconds)}
    if model is None:
        return out
    noise = cal.noise if cal is not None else None
    pred = predict(model, layout, device, link, int(opts.batch), tp_link=tp_link,
                   noise=noise, draws=opts.draws if noise is not None else 0)
    out["model"] = {"params": model.params, "layers": len(model.layers),
                    "flops_per_example": model.flops}
    out["layout"] = {**layout.__dict__, "gpus": layout.gpus, "batch": opts.batch}
    out["memory_bytes"] = pred.memory
    out["device_memory_bytes"] = device.memory
    out["traffic_bytes"] = pred.traffic
    out["step"] = {"seconds": pred.step, "bubble": pred.bubble, "compute_s": pred.compute,
                   "communication_s": pred.communication, "optimizer_s": pred.optimizer,
                   "sync_s": pred.parts["sync"], "draws": pred.parts["draws"]}
    if opts.tokens and opts.batch:
        seconds = time_to_train(opts.tokens, opts.batch, pred.step)
        out["time_to_train"] = {"tokens": opts.tokens, "steps": -(-opts.tokens // opts.batch),
                                "seconds": seconds, "days": seconds / 86400,
                                "years": years(seconds)}
    return out


def text(out: dict) -> str:
    lines = []
    if "iteration" in out:
        it = out["iteration"]
        lines.append(f"iteration: compute {it['compute_s'] * 1e3:g} ms + transfer "
                     f"{it['transfer_s'] * 1e3:g} ms = {it['serial_s'] * 1e3:g} ms serial, "
                     f"{it['overlapped_s'] * 1e3:g} ms overlapped")
    if "model" in out:
        mo, la = out["model"], out["layout"]
        lines.append(f"model: {mo['params']:,} parameters, {mo['layers']} layers; layout dp "
                     f"{la['dp']} x tp {la['tp']} x pp {la['pp']} = {la['gpus']} GPUs, ZeRO "
                     f"{la['zero']}, {la['precision']}, {la['schedule']} with "
                     f"{la['microbatches']} micro-batches, checkpoint {la['checkpoint']}")
        mem = out["memory_bytes"]
        cap = out["device_memory_bytes"]
        fits = "" if not cap else ("  fits" if mem["total"] <= cap else
                                   f"  DOES NOT FIT in {_gb(cap)}")
        lines.append("memory per GPU (GB): " + "  ".join(
            f"{k} {_gb(mem[k])}" for k in ("weights", "gradients", "master", "optimizer",
                                           "activations", "total")) + fits)
        tr = out["traffic_bytes"]
        lines.append("traffic per GPU per step (GB sent): " + "  ".join(
            f"{k} {_gb(tr[k])}" for k in ("dp", "tp", "pp", "total")))
        st = out["step"]
        if not out["layout"].get("batch"):
            return "\n".join(lines + ["step: give --batch (examples per step) for its time"]
                             + _flops_lines(out))
        lines.append(f"step: {st['seconds']:.6g} s (compute {st['compute_s']:.4g} s, "
                     f"communication {st['communication_s']:.4g} s, gradient sync "
                     f"{st['sync_s']:.4g} s, optimizer {st['optimizer_s']:.4g} s), bubble "
                     f"{st['bubble']:.3f}"
                     + (f" (mean of {st['draws']} noisy draws)" if st["draws"] else ""))
    if "time_to_train" in out:
        tt = out["time_to_train"]
        lines.append(f"time to train: {tt['tokens']:.4g} tokens = {tt['steps']:,.0f} steps "
                     f"= {tt['days']:,.1f} days ({tt['years']:.2f} years)")
    lines += _flops_lines(out)
    return "\n".join(lines) or "nothing to do: give --params or --layers, --total-flops, or " \
        "--compute-time with --step-bytes (see --help)"


def _flops_lines(out: dict) -> list[str]:
    if "flops_time" not in out:
        return []
    ft = out["flops_time"]
    return [f"FLOPs: {ft['total_flops']:.3g} at {ft['flops_per_gpu']:.3g} FLOP/s x "
            f"{ft['gpus']} GPUs = {ft['seconds']:.4g} s = {ft['years']:.1f} years"]


def calibrate(argv: list[str]) -> int:
    opts = _calibrate_parser().parse_args(argv)
    if opts.worker:
        from needle.plan.calibration import calibration_worker

        calibration_worker(opts.out, opts.layers, opts.repeats)
        return 0
    from needle.distributed.launch import run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = ["calibrate", "--worker", "--out", opts.out, "--layers", opts.layers,
            "--repeats", str(opts.repeats)]
    code = run(opts.nproc, os.path.abspath(__file__), args, backend=opts.backend,
               timeout=opts.timeout)
    if code == 0:
        print(f"wrote {opts.out}")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["calibrate"]:
            return calibrate(argv[1:])
        opts = build_parser().parse_args(argv)
        out = what_if(opts)
    except (PlanError, OSError, ValueError) as exc:
        print(f"needle.plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1, default=str) if opts.json else text(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
