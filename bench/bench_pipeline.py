"""Pipeline schedules measured against the simulator: bubble for p = 2 and 4 over m = 1..16,
GPipe vs 1F1B step time and peak activation bytes, in one run.

    python bench/bench_pipeline.py                       # p = 2 and 4, mpi, m = 1..16
    python bench/bench_pipeline.py --stages 2 --max-m 8 --backend tcp --json out.json

Each stage is ``--layers`` Linear(width, width) + ReLU; every micro-batch has ``--rows`` rows,
so the work per micro-batch is fixed and the batch grows with m (the course's figure). For
each (p, m, schedule) the runtime records ``--steps`` steps (the first is dropped) and its
report feeds the measured per-op costs, message time and activation bytes back into the
simulator. Columns: the formula (p-1)/(m+p-1), the simulator's prediction, the measurement
and its error; then 1F1B/GPipe ratios of step time and of stage 0's peak activation bytes.
Every rank runs one thread (OMP_NUM_THREADS=1); p = 4 oversubscribes a 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import needle as ndl  # noqa: E402
import needle.autograd  # noqa: E402,F401 - before needle.nn (import order)
import needle.distributed as dist  # noqa: E402
from needle import nn  # noqa: E402
from needle.distributed import pipeline  # noqa: E402
from needle.distributed.launch import run  # noqa: E402


def stage_module(width: int, layers: int, last: bool) -> nn.Sequential:
    blocks: list = []
    for i in range(layers):
        blocks += [nn.Linear(width, 10 if last and i == layers - 1 else width)]
        if not (last and i == layers - 1):
            blocks.append(nn.ReLU())
    return nn.Sequential(*blocks)


def measure(p: int, m: int, name: str, opts) -> pipeline.PipelineReport | None:
    rank = dist.get_rank()
    np.random.seed(rank)
    ndl.random.seed(rank)
    module = stage_module(opts.width, opts.layers, rank == p - 1)
    stage = pipeline.PipelineStage(module, rank, p)
    sched = pipeline.schedule_class(name)(stage, m, loss_fn=nn.SoftmaxLoss(), record=True)
    rng = np.random.RandomState(0)
    X = rng.randn(opts.rows * m, opts.width).astype(np.float32)
    y = rng.randint(0, 10, opts.rows * m).astype(np.uint8)
    for _ in range(opts.steps):
        for q in module.parameters():
            q.grad = None
        sched.step(X if rank == 0 else None, y if rank == p - 1 else None)
    return sched.report()


def worker(opts) -> None:
    dist.init_process_group(timeout=300)
    p = dist.get_world_size()
    rows = []
    for m in range(1, opts.max_m + 1):
        for name in ("gpipe", "1f1b"):
            report = measure(p, m, name, opts)
            if report is not None:
                rows.append({"p": p, "m": m, **report.as_dict()})
    if dist.get_rank() == 0:
        Path(opts.out).write_text(json.dumps(rows))


def table(rows: list[dict]) -> str:
    lines = [f"{'p':>2} {'m':>3} {'schedule':8} {'formula':>8} {'predict':>8} {'measure':>8} "
             f"{'error':>7} {'step ms':>8} {'pred ms':>8} {'peak act s0 meas':>17} "
             f"{'pred':>10}"]
    for r in rows:
        peaks = r["peak_activation_bytes"]
        formula = (r["p"] - 1) / (r["m"] + r["p"] - 1)
        lines.append(
            f"{r['p']:>2} {r['m']:>3} {r['schedule']:8} {formula:8.3f} "
            f"{r['bubble_predicted']:8.3f} {r['bubble_measured']:8.3f} {r['bubble_error']:+7.3f} "
            f"{r['makespan_measured_s'] * 1e3:8.2f} {r['makespan_predicted_s'] * 1e3:8.2f} "
            f"{peaks['measured'][0]:17,.0f} {peaks['predicted'][0]:10,.0f}")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    by = {(r["p"], r["m"], r["schedule"]): r for r in rows}
    lines = ["1F1B / GPipe (same p, m): step time, stage-0 peak activation bytes (measured)"]
    for (p, m, name), r in sorted(by.items()):
        g = by.get((p, m, "gpipe"))
        if name != "1f1b" or g is None:
            continue
        t = r["makespan_measured_s"] / g["makespan_measured_s"]
        a = r["peak_activation_bytes"]["measured"][0] / g["peak_activation_bytes"]["measured"][0]
        lines.append(f"p={p} m={m:>2}: step x{t:5.2f}   peak activation x{a:5.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-m", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4, help="Linear layers per stage")
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=4, help="recorded steps (first dropped)")
    parser.add_argument("--backend", default="mpi", choices=["mpi", "tcp"])
    parser.add_argument("--json", default=None, help="also write every row here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows: list[dict] = []
    for p in opts.stages:
        out = Path(f"/tmp/bench_pipeline_{os.getpid()}_{p}.json")
        args = ["--worker", "--out", str(out), "--max-m", str(opts.max_m), "--width",
                str(opts.width), "--layers", str(opts.layers), "--rows", str(opts.rows),
                "--steps", str(opts.steps)]
        code = run(p, __file__, args, backend=opts.backend, timeout=3000)
        if code:
            print(f"bench_pipeline: the p={p} job failed with exit code {code}")
            return code
        rows += json.loads(out.read_text())
        out.unlink()
    print(table(rows))
    print(ratios(rows))
    errors = [abs(r["bubble_error"]) for r in rows]
    print(f"bubble error |measured - predicted|: median {np.median(errors):.3f}, "
          f"max {max(errors):.3f} over {len(rows)} runs")
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
