"""Activation memory of a deep MLP with and without activation checkpointing.

A chain of ``layers`` × (Linear(width, width) + ReLU) at batch ``batch``, float32. For each
configuration one forward + backward is run and the caching allocator reports the peak bytes in
the ``activation`` category (forward under ``memory.category("activation")``, recomputation
inside backward is attributed there by the checkpoint regions). Configurations: the plain graph,
the plain graph under ``release_unsaved`` (keeps only what backward reads), and
``checkpoint_sequential`` with K = 1, 2, 4, ..., ``layers`` segments.

Beside each row: the lecture's proxy ``layers/K + K`` in units of one layer output
(batch·width·4 bytes), the measured peak in the same unit, and the step time as a ratio to the
plain step.

Usage::

    python apps/checkpoint_experiment.py                      # 64 × 1024, batch 256
    python apps/checkpoint_experiment.py --layers 16 --width 128 --batch 32 --plot out.png
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import needle.memory as memory  # noqa: E402
from needle import nn  # noqa: E402
from needle.autograd import Tensor  # noqa: E402
from needle.backend_ndarray import cpu, cpu_numpy  # noqa: E402
from needle.checkpoint import checkpoint_sequential, release_unsaved  # noqa: E402


def build_model(layers: int, width: int, device):
    np.random.seed(0)
    modules = []
    for _ in range(layers):
        modules += [nn.Linear(width, width, device=device), nn.ReLU()]
    return nn.Sequential(*modules)


def _step(model, x, mode, layers: int):
    """One forward + backward; returns (peak activation bytes, seconds)."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    memory.reset_peak(x.device)
    start = time.perf_counter()
    with memory.category("activation"):
        if mode == "plain":
            y = model(x)
        elif mode == "release_unsaved":
            with release_unsaved():
                y = model(x)
        else:
            y = checkpoint_sequential(model, mode, x)
        loss = y.sum()
    del y
    loss.backward()
    elapsed = time.perf_counter() - start
    peak = memory.stats(x.device)["by_category"]["activation"]["peak"]
    del loss
    return peak, elapsed


def segment_counts(layers: int) -> list[int]:
    """1, 2, 4, ... up to ``layers`` (and ``layers`` itself when not a power of two)."""
    counts = [2 ** k for k in range(int(math.log2(layers)) + 1)]
    if counts[-1] != layers:
        counts.append(layers)
    return counts


def run_experiment(layers=64, width=1024, batch=256, segments=None, device=None, repeats=1,
                   warmup=0):
    """Measure every configuration; returns a list of row dicts (see ``format_table``).

    Peaks are exact allocator counts (the same in every repeat); times are the best of
    ``repeats`` after ``warmup`` untimed steps (first touches of fresh memory are slow).
    """
    device = device or cpu_numpy()
    model = build_model(layers, width, device)
    x = Tensor(np.random.randn(batch, width).astype("float32"), device=device,
               requires_grad=False)
    unit = batch * width * 4
    modes = ["plain", "release_unsaved"] + list(segments or segment_counts(layers))
    rows = []
    for mode in modes:
        for _ in range(warmup):
            _step(model, x, mode, layers)
        runs = [_step(model, x, mode, layers) for _ in range(repeats)]
        peak = min(r[0] for r in runs)
        seconds = min(r[1] for r in runs)
        model_units = layers if isinstance(mode, str) else layers / mode + mode
        rows.append({"config": mode, "segments": None if isinstance(mode, str) else mode,
                     "model_units": model_units, "peak_bytes": peak,
                     "peak_units": peak / unit, "seconds": seconds})
    plain = rows[0]["seconds"]
    for row in rows:
        row["time_ratio"] = row["seconds"] / plain
    return rows


def format_table(rows, unit_bytes: int) -> str:
    lines = [f"activation unit = {unit_bytes} bytes ({unit_bytes / 2**20:.2f} MiB)",
             f"{'config':>16} {'model':>7} {'peak MiB':>9} {'units':>7} {'-model':>7} "
             f"{'time s':>7} {'ratio':>6}"]
    for r in rows:
        name = f"K={r['segments']}" if r["segments"] else r["config"]
        lines.append(
            f"{name:>16} {r['model_units']:7.1f} {r['peak_bytes'] / 2**20:9.2f} "
            f"{r['peak_units']:7.2f} {r['peak_units'] - r['model_units']:7.2f} "
            f"{r['seconds']:7.3f} {r['time_ratio']:6.2f}")
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ck = [r for r in rows if r["segments"]]
    ks = [r["segments"] for r in ck]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, [r["model_units"] for r in ck], "o--", label="model N/K + K")
    ax.plot(ks, [r["peak_units"] for r in ck], "s-", label="measured (allocator)")
    for r in rows:
        if not r["segments"]:
            ax.axhline(r["peak_units"], linestyle=":", color="grey")
            ax.annotate(r["config"], (ks[0], r["peak_units"]), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("segments K")
    ax.set_ylabel("peak activation (layer outputs)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--segments", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", choices=["cpu_numpy", "cpu"], default="cpu_numpy",
                        help="a device whose buffers come from needle's caching allocator")
    parser.add_argument("--plot", default=None, help="write the PNG here")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    device = cpu_numpy() if args.device == "cpu_numpy" else cpu()
    rows = run_experiment(args.layers, args.width, args.batch, args.segments, device,
                          args.repeats, args.warmup)
    print(format_table(rows, args.batch * args.width * 4))
    best = min((r for r in rows if r["segments"]), key=lambda r: r["peak_bytes"])
    print(f"measured minimum at K = {best['segments']} segments")
    if args.plot:
        plot(rows, args.plot, f"{args.layers} x Linear({args.width})+ReLU, batch {args.batch}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
