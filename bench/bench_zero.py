"""DDP vs ZeRO stages 1/2/3, float32 vs mixed precision, side by side: step time, model-state
bytes per rank (predicted by the ledger, measured by needle.memory) and bytes sent per step
(predicted from the ring layouts, measured on the wire).

    python bench/bench_zero.py                     # 2 ranks, then 4 (oversubscribed on 2 cores)
    python bench/bench_zero.py --nproc 2 --steps 10 --width 512 --layers 4

One run starts the ranks itself (needle's launcher, mpi by default) once per world size.
Every configuration runs the same MLP (``--layers`` x Linear(width, width) + ReLU) on the same
batch, with Adam; configurations alternate inside one process so that machine load hits all
of them alike; step times are medians over ``--steps`` steps after one warm-up step. Memory is
read right after a step. With 4 ranks on a 2-core machine the ranks share cores: step times
then measure contention as much as the strategies (the byte counts are exact either way).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = [("ddp", 0), ("zero", 1), ("zero", 2), ("zero", 3)]
PRECISIONS = ("fp32", "fp16-mixed")
CATS = ("weight", "gradient", "master", "optimizer")


def _model(width: int, layers: int, device):
    from needle import nn

    np.random.seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width, device=device), nn.ReLU()]
    return nn.Sequential(*blocks)


def _wrap(kind: str, stage: int, model):
    import needle.distributed as dist
    from needle import optim

    def make(params):
        return optim.Adam(params, lr=1e-4)

    if kind == "ddp":
        ddp = dist.DistributedDataParallel(model, bucket_cap_mb=4)
        return ddp, ddp.wrap_optimizer(make(model.parameters())), ddp
    zero = dist.ZeroDataParallel(model, optimizer=make, stage=stage, bucket_cap_mb=4)
    return zero, zero.optimizer, zero


def _one_step(forward, optimizer, scaler, x, mixed: bool, model) -> None:
    import needle as ndl
    from needle import amp, memory

    optimizer.reset_grad()
    with amp.autocast(enabled=mixed):
        loss = ndl.ops.summation(forward(x)) / float(x.shape[0] * x.shape[1])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    for p in model.parameters():  # DDP installs its averaged gradients outside backward
        if p.grad is not None:
            memory.attribute(p.grad, "gradient")


def _measure(kind, stage, precision, args, device) -> dict:
    import gc

    import needle as ndl
    import needle.distributed as dist
    from needle import amp
    from needle.distributed.zero import accounting

    gc.collect()
    mixed = precision == "fp16-mixed"
    model = _model(args.width, args.layers, device)
    if mixed:
        amp.cast_parameters(model)
    forward, optimizer, wrapper = _wrap(kind, stage, model)
    scaler = amp.GradScaler(enabled=mixed, init_scale=2.0 ** 10)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = ndl.Tensor(np.random.default_rng(rank).standard_normal((args.batch, args.width)),
                   device=device, requires_grad=False)
    group = wrapper.comm if kind == "zero" else wrapper.group
    _one_step(forward, optimizer, scaler, x, mixed, model)  # warm-up (and lazy state)
    times, sent = [], []
    for _ in range(args.steps):
        dist.barrier()
        before = group.bytes_sent["ring"]
        start = time.perf_counter()
        _one_step(forward, optimizer, scaler, x, mixed, model)
        times.append(time.perf_counter() - start)
        sent.append(group.bytes_sent["ring"] - before)
    inner = getattr(optimizer, "optimizer", optimizer)
    got = accounting.measured(device)["requested"]
    want = accounting.predicted(model, inner, stage, world, rank)
    if kind == "zero":
        predicted_traffic = wrapper.predicted_traffic()["total"]
        wrapper.close()
    else:
        n = sum(int(np.prod(p.shape)) * np.dtype(str(p.dtype)).itemsize
                for p in model.parameters())
        predicted_traffic = None if n == 0 else round(2 * (world - 1) / world * n)
        wrapper.remove_hooks()
    return {"step_ms": 1e3 * statistics.median(times), "measured": got, "predicted": want,
            "traffic_measured": int(statistics.median(sent)),
            "traffic_predicted": predicted_traffic, "skipped": scaler.skipped_steps}


def worker(args) -> None:
    import needle as ndl
    import needle.distributed as dist

    dist.init_process_group(timeout=600)
    device = ndl.backend_ndarray.device_by_name(args.device)
    ndl.memory.stats(device)
    rows = []
    for precision in PRECISIONS:
        for kind, stage in CONFIGS:
            row = _measure(kind, stage, precision, args, device)
            row.update(kind=kind, stage=stage, precision=precision)
            rows.append(row)
    if dist.get_rank() == 0:
        print("BENCH_ZERO_JSON " + json.dumps({"world": dist.get_world_size(), "rows": rows}),
              flush=True)


def _table(result: dict, params: int) -> str:
    world, rows = result["world"], result["rows"]
    base = {p: next(r for r in rows if r["kind"] == "ddp" and r["precision"] == p)
            for p in PRECISIONS}
    head = (f"{'config':<8}{'precision':<12}{'step ms':>9}{'x ddp':>7}"
            f"{'state B/rank pred':>19}{'measured':>12}{'sent B/step pred':>18}"
            f"{'measured':>11}{'x ddp':>7}")
    lines = [f"--- {world} ranks ({params:,} parameters, Adam; rank 0's numbers)", head]
    for r in rows:
        name = "ddp" if r["kind"] == "ddp" else f"zero-{r['stage']}"
        b = base[r["precision"]]
        pred, meas = sum(r["predicted"].values()), sum(r["measured"].values())
        mark = "" if r["predicted"] == r["measured"] else " !"
        lines.append(f"{name:<8}{r['precision']:<12}{r['step_ms']:>9.1f}"
                     f"{r['step_ms'] / b['step_ms']:>7.2f}{pred:>19,}{meas:>12,}{mark:2}"
                     f"{r['traffic_predicted'] or 0:>16,}{r['traffic_measured']:>11,}"
                     f"{r['traffic_measured'] / max(b['traffic_measured'], 1):>7.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="mpi")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    params = args.layers * (args.width * args.width + args.width)
    print(f"bench_zero: {os.cpu_count()} cores; {args.layers} x Linear({args.width}) "
          f"({params:,} parameters), batch {args.batch} per rank, median of {args.steps} "
          f"steps, device {args.device}, backend {args.backend}")
    results = []
    for n in args.nproc:
        if n > (os.cpu_count() or 1):
            print(f"note: {n} ranks on {os.cpu_count()} cores oversubscribe: step times include "
                  f"contention; byte counts are exact")
        cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", str(n), "--backend",
               args.backend, "--timeout", "1800", __file__, "--worker",
               "--width", str(args.width), "--layers", str(args.layers),
               "--batch", str(args.batch), "--steps", str(args.steps), "--device", args.device]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get(
            "PYTHONPATH", ""))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=2000)
        line = next((ln for ln in proc.stdout.splitlines() if "BENCH_ZERO_JSON " in ln), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-3000:] + proc.stderr[-3000:])
            return proc.returncode or 1
        result = json.loads(line.split("BENCH_ZERO_JSON ", 1)[1])
        results.append(result)
        print(_table(result, params), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
