"""The calibrated time model against measured runs of apps/train.py: calibrate, predict, run,
compare.

    python bench/bench_time_model.py                          # both tables (a few minutes)
    python bench/bench_time_model.py --only pipeline          # the four schedules at p = 2
    python bench/bench_time_model.py --only scaling --nprocs 1 2 4 8 --json out.json
    python bench/bench_time_model.py --nprocs 1 2 --rounds 3  # medians of 3 paired rounds

1. Calibration: a job of as many ranks as the run (this file with --calibrate-worker) runs
   the link probe (needle.distributed.calibrate.probe_link: alpha, beta, each end's CPU
   time, the wake-up of a long wait), fits the device on the main job's model (MLP-ResNet,
   Adam) at a few batch sizes and the gradient sync's cost per tensor (needle.plan.calibration),
   and, for the pipeline table, runs every schedule for a few pipelined steps of
   CAL_MICROBATCHES micro-batches of the run's size, recording every action as the runtime
   runs it (needle.plan.profile_schedule). Everything goes to one JSON file.
2. Predictions, from that file only, before any run: each schedule at MICROBATCHES
   micro-batches (the simulator fed the profiled actions and messages: the mean of --draws
   noisy draws), and each scaling run's step time (needle.plan.predict with the fitted device;
   the job's other per-step collectives read from the traffic ledger of one dry-run step on
   thread ranks).
3. The runs: apps/train.py through bench/_timed_train.py (rank 0 times every train_step;
   the first step, which allocates, is left out of the mean).
4. The tables, with measured / predicted ratios; with --rounds R every calibrate-predict-run
   repeats R times in turn (the machine's speed drifts by tens of percent over minutes on a
   shared host) and a last table gives the medians and the range of the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "apps"))
sys.path.insert(0, str(ROOT))
import needle as ndl  # noqa: E402
import needle.autograd  # noqa: E402,F401 - before needle.nn (import order)
from needle.plan.calibration import Calibration, load  # noqa: E402
from needle.plan.model import Layout, Model, predict  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "interleaved")
MICROBATCHES, BATCH, IN_FEATURES, CLASSES, HIDDEN = 4, 64, 64, 10, 100
# the profiled pipelined step: the run's micro-batch size, half its micro-batches (the
# prediction simulates m = MICROBATCHES from the actions measured at m = CAL_MICROBATCHES)
CAL_MICROBATCHES, CAL_STEPS, CAL_WARMUP = 2, 40, 10


def app_model(device=None):
    from training.models import build_model

    np.random.seed(0)
    ndl.random.seed(0)
    return build_model("mlp_resnet", IN_FEATURES, CLASSES, HIDDEN, device or ndl.cpu())


def app_optimizer(params):
    from training.models import build_optimizer

    return build_optimizer("adam", params, 0.003, 1e-4)


# ---- 1. calibration (a rank of the job) -----------------------------------------------------
def calibrate_worker(out: str, repeats: int, stages: bool) -> None:
    import needle.distributed as dist
    from needle.plan.calibration import calibrate_job

    dist.init_process_group(timeout=300)
    from needle import memory

    memory.stats(ndl.cpu())  # the main job attributes memory by category from set-up on
    model = app_model()
    cal = calibrate_job(model, IN_FEATURES, CLASSES, app_optimizer(model.parameters()),
                        repeats=repeats)
    pipelined = profile_pipelined(dist.get_rank(), dist.get_world_size()) if stages else None
    if cal is not None:
        cal.reference["model"] = "MLP-ResNet (apps/training, --model mlp_resnet), Adam"
        cal.reference["pipelined"] = pipelined
        cal.save(out)


def profile_pipelined(rank: int, p: int) -> dict | None:
    """Each schedule's actions measured inside CAL_STEPS pipelined steps of CAL_MICROBATCHES
    micro-batches of the run's size (needle.plan.profile_schedule), cut as apps/train.py
    cuts the model; rank 0 gets ``{schedule: simulator inputs}``."""
    from needle import nn
    from needle.distributed import pipeline
    from needle.plan.profile import profile_schedule

    rows = BATCH // MICROBATCHES
    rng = np.random.RandomState(0)
    x = rng.randn(rows * CAL_MICROBATCHES, IN_FEATURES).astype(np.float32)
    y = rng.randint(0, CLASSES, rows * CAL_MICROBATCHES).astype(np.uint8)
    out = {}
    for name in SCHEDULES:
        v = 2 if name == "interleaved" else 1
        full = app_model()
        chunks = p * v
        pieces = pipeline.split_sequential(full, chunks,
                                           pipeline.parameter_costs(list(full.modules)))
        mine = list(range(rank, chunks, p))
        stages = [pipeline.PipelineStage(pieces[k], k, chunks) for k in mine]
        schedule = pipeline.schedule_class(name)(stages if v > 1 else stages[0],
                                                 CAL_MICROBATCHES, loss_fn=nn.SoftmaxLoss(),
                                                 record=True)
        params = [q for k in mine for q in pieces[k].parameters()]
        got = profile_schedule(schedule, x if rank == 0 else None,
                               y if rank == p - 1 else None, CAL_STEPS,
                               app_optimizer(params), warmup=CAL_WARMUP)
        out[name] = got
    return out if rank == 0 else None


def calibrate(path: str, repeats: int, nproc: int = 2, stages: bool = True) -> Calibration:
    """The calibration job on ``nproc`` ranks (as many as the run it predicts: the probe and
    the profile then share the cores as the run will; one rank has no link to probe);
    ``stages``: profile the pipeline stages of p = 2 too."""
    from needle.distributed.launch import run

    args = ["--calibrate-worker", path, "--repeats", str(repeats)] + (
        ["--stages"] if stages else [])
    code = run(nproc, __file__, args, backend="mpi", timeout=900)
    if code:
        raise SystemExit(f"bench_time_model: the calibration job failed with exit code {code}")
    return load(path)


# ---- 2. predictions -------------------------------------------------------------------------
def dry_run_collectives(strategy: str, p: int) -> list[tuple[str, float]]:
    """The per-step collectives of ``strategy`` on ``p`` ranks that the model does not build
    itself (gradient sync and pipeline messages are the model's): the traffic ledger of the
    second of two steps of the real strategy on thread ranks."""
    if p == 1:
        return []
    from training.config import parse_args
    from training.data import replica_share
    from training.loop import RunContext
    from training.models import device_by_name
    from training.strategies import STRATEGIES

    import needle.distributed as dist

    def job(rank: int):
        extra = ["--microbatches", str(MICROBATCHES)] if strategy == "pipeline" else []
        cfg = parse_args(["--strategy", strategy, "--nproc", str(p), "--no-progress", *extra],
                         STRATEGIES)
        s = STRATEGIES[strategy](cfg, rank, p)
        s.setup(RunContext(cfg, device_by_name(None), IN_FEATURES, CLASSES, rank, p))
        data = np.random.RandomState(0)
        X = data.randn(BATCH, IN_FEATURES).astype(np.float32)
        y = data.randint(0, CLASSES, BATCH).astype(np.uint8)
        share = replica_share(np.arange(BATCH), *s.data_shard())
        s.train_step(X[share], y[share])
        book = dist.traffic.ledger()
        first = len(book.records)
        s.train_step(X[share], y[share])
        records = list(book.records)[first:]
        s.close()
        return [(r.kind, float(r.payload_bytes)) for r in records
                if r.label != "ddp gradients" and r.kind not in ("send", "recv")]

    return dist.spawn_threads(job, p, timeout=300)[0]


def layout_of(strategy: str, p: int, schedule: str = "1f1b") -> Layout:
    v = 2 if schedule == "interleaved" else 1
    if strategy == "pipeline":
        return Layout(pp=p, microbatches=MICROBATCHES, schedule=schedule, virtual_stages=v,
                      precision="fp32")
    if strategy == "tp":
        return Layout(tp=p, precision="fp32")
    return Layout(dp=p, zero=2 if strategy == "zero" else 0, precision="fp32")


def predict_pipeline(cal: Calibration, schedule: str, draws: int, collectives) -> dict:
    """The schedule at MICROBATCHES from the actions measured in the calibration's pipelined
    steps at CAL_MICROBATCHES (needle.distributed.pipeline.simulator.expected: every
    action's cost drawn from its stage's samples, every message's from the measured ones);
    the step adds the model's optimizer, collectives and fixed step time."""
    from needle.distributed.pipeline import make_plan
    from needle.distributed.pipeline.simulator import expected, simulate

    inputs = dict(cal.reference["pipelined"][schedule])
    inputs.pop("microbatches")
    v = 2 if schedule == "interleaved" else 1
    plan = make_plan(schedule, 2, MICROBATCHES, v if v > 1 else None)
    noisy = expected(plan, draws=draws, **inputs)
    plain = simulate(plan, **{**inputs, "message_noise": None})  # mean costs
    model = Model.from_module(app_model(), IN_FEATURES)
    rest = predict(model, layout_of("pipeline", 2, schedule), cal.device, cal.link, BATCH,
                   collectives=collectives)
    others = rest.step - rest.parts["pipeline"]
    return {"bubble": noisy.bubble_fraction, "makespan_s": noisy.makespan,
            "step_s": noisy.makespan + others, "bubble_means": plain.bubble_fraction,
            "makespan_means_s": plain.makespan, "step_means_s": plain.makespan + others}


def predict_step(cal: Calibration, strategy: str, p: int, draws: int, collectives) -> dict:
    model = Model.from_module(app_model(), IN_FEATURES)
    layout = layout_of(strategy, p) if p > 1 else Layout(precision="fp32")
    noisy = predict(model, layout, cal.device, cal.link, BATCH, collectives=collectives,
                    noise=cal.noise, draws=draws)
    plain = predict(model, layout, cal.device, cal.link, BATCH, collectives=collectives)
    return {"step_s": noisy.step, "step_means_s": plain.step}


# ---- 3. runs --------------------------------------------------------------------------------
def run_train(strategy: str, p: int, epochs: int, schedule: str | None = None) -> dict:
    out = tempfile.mkdtemp(prefix="bench_time_model_")
    times = os.path.join(out, "steps.json")
    args = [sys.executable, str(ROOT / "bench" / "_timed_train.py"), "--strategy", strategy,
            "--nproc", str(p), "--epochs", str(epochs), "--no-progress", "--out", out]
    if schedule is not None:
        args += ["--microbatches", str(MICROBATCHES), "--schedule", schedule]
        if schedule == "interleaved":
            args += ["--virtual-stages", "2"]
    env = {**os.environ, "NEEDLE_STEP_TIMES": times, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode:
        raise SystemExit(f"bench_time_model: {' '.join(args[1:])} failed:\n"
                         f"{done.stderr[-3000:]}")
    summary = json.loads(Path(out, "summary.json").read_text())
    steps = json.loads(Path(times).read_text())[1:]
    row = {"step_s": float(np.mean(steps)), "step_median_s": float(np.median(steps)),
           "wall_per_step_s": summary["wall_s"] / summary["steps"], "steps": summary["steps"]}
    if "pipeline" in summary:
        block = summary["pipeline"]
        row |= {"bubble": block["bubble_measured"], "makespan_s": block["makespan_measured_s"]}
    return row


# ---- 4. tables ------------------------------------------------------------------------------
def pipeline_table(rows: list[dict], head: bool = True) -> str:
    lines = [f"{'schedule':12} {'bubble pred':>11} {'meas':>6} {'diff':>6} "
             f"{'makespan ms pred':>16} {'meas':>6} {'ratio':>6} "
             f"{'step ms pred':>12} {'meas':>6} {'ratio':>6} {'load':>5}"] if head else []
    for r in rows:
        p, m = r["predicted"], r["measured"]
        lines.append(f"{r['schedule']:12} {p['bubble']:11.3f} {m['bubble']:6.3f} "
                     f"{m['bubble'] - p['bubble']:+6.3f} {p['makespan_s'] * 1e3:16.2f} "
                     f"{m['makespan_s'] * 1e3:6.2f} {m['makespan_s'] / p['makespan_s']:6.2f} "
                     f"{p['step_s'] * 1e3:12.2f} {m['step_s'] * 1e3:6.2f} "
                     f"{m['step_s'] / p['step_s']:6.2f} {r['calibration']['load']:5.1f}")
    return "\n".join(lines)


def scaling_table(rows: list[dict], head: bool = True) -> str:
    lines = [f"{'strategy':10} {'nproc':>5} {'step ms pred':>12} {'meas':>7} {'ratio':>6} "
             f"{'no-noise pred':>13} {'load':>5}"] if head else []
    for r in rows:
        p, m = r["predicted"], r["measured"]
        lines.append(f"{r['strategy']:10} {r['nproc']:5d} {p['step_s'] * 1e3:12.2f} "
                     f"{m['step_s'] * 1e3:7.2f} {m['step_s'] / p['step_s']:6.2f} "
                     f"{p['step_means_s'] * 1e3:13.2f} {r['calibration']['load']:5.1f}")
    return "\n".join(lines)


def rounds_table(rows: list[dict], key: str) -> str:
    """Per configuration over the rounds: median predicted and measured step, the median and
    the range of measured / predicted, and (pipelines) the median bubble difference."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r[key], r.get("nproc", 2)), []).append(r)
    lines = [f"{key:12} {'nproc':>5} {'step ms pred':>12} {'meas':>7} {'ratio':>6} "
             f"{'range':>11} {'bubble diff':>11}"]
    for (name, p), rs in groups.items():
        pred = [r["predicted"]["step_s"] for r in rs]
        meas = [r["measured"]["step_s"] for r in rs]
        ratios = [m / q for m, q in zip(meas, pred, strict=True)]
        diff = [r["measured"]["bubble"] - r["predicted"]["bubble"] for r in rs
                if "bubble" in r["measured"] and "bubble" in r["predicted"]]
        lines.append(f"{name:12} {p:5d} {np.median(pred) * 1e3:12.2f} "
                     f"{np.median(meas) * 1e3:7.2f} {np.median(ratios):6.2f} "
                     f"{min(ratios):5.2f}-{max(ratios):<5.2f} "
                     + (f"{np.median(diff):+11.3f}" if diff else f"{'':>11}"))
    return "\n".join(lines)


def header(cal: Calibration) -> str:
    mach = cal.machine
    link, dev = cal.link, cal.device
    return (f"calibrated {mach.get('date')} on {mach.get('cpu')} ({mach.get('cores')} cores), "
            f"load average {' '.join(f'{x:.1f}' for x in mach.get('load_average', []))}\n"
            f"link: alpha {link.alpha * 1e6:.1f} us, beta {link.beta * 1e9:.3f} ns/B, send "
            f"{link.send_fixed * 1e6:.1f} us, receive {link.recv_fixed * 1e6:.1f} us, wake "
            f"{link.wake * 1e6:.1f} us after {link.spin * 1e3:g} ms; device: "
            f"{dev.flops / 1e9:.1f} GFLOP/s, {dev.op_time * 1e6:.1f} us per op, backward "
            f"{dev.backward_ratio:.2f} x forward, optimizer {dev.optimizer_tensor_time * 1e6:.1f}"
            f" us per tensor, step {dev.step_time * 1e6:.1f} us")


# long: the options, then the rounds of calibrate-predict-run for both tables, in order
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["pipeline", "scaling"], default=None)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero", "tp", "pipeline"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40, help="calibration samples")
    parser.add_argument("--draws", type=int, default=300, help="noisy draws per prediction")
    parser.add_argument("--calibrate", choices=["each", "once"], default="each",
                        help="a fresh calibration before each run, on as many processes as "
                             "the run (the machine's load moves within a minute), or one on "
                             "2 processes for all")
    parser.add_argument("--calibration", default=None,
                        help="with --calibrate once: write the calibration here")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat every calibrate-predict-run this many times, in turn, "
                             "and add a table of the medians")
    parser.add_argument("--json", default=None, help="also write every row here")
    parser.add_argument("--calibrate-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stages", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.calibrate_worker:
        calibrate_worker(opts.calibrate_worker, opts.repeats, opts.stages)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.time()
    folder = tempfile.mkdtemp(prefix="bench_time_model_cal_")
    shared: list[Calibration] = []

    def calibration(name: str, nproc: int = 2, stages: bool = False) -> Calibration:
        if opts.calibrate == "once" and shared:
            return shared[0]
        path = opts.calibration if opts.calibrate == "once" and opts.calibration else \
            os.path.join(folder, f"{name}.json")
        once = opts.calibrate == "once"
        cal = calibrate(path, opts.repeats, 2 if once else nproc, stages or once)
        if opts.calibrate == "once":
            shared.append(cal)
            print(header(cal), flush=True)
        return cal

    pipe_rows, scale_rows = [], []
    for rnd in range(opts.rounds):  # rounds interleave: each config meets the machine's drift
        if opts.only in (None, "pipeline"):
            extra = dry_run_collectives("pipeline", 2)
            for s in SCHEDULES:
                cal = calibration(s, 2, stages=True)
                row = {"schedule": s, "round": rnd, "calibration": summary_of(cal),
                       "predicted": predict_pipeline(cal, s, opts.draws, extra)}
                row["measured"] = run_train("pipeline", 2, opts.epochs, s)
                pipe_rows.append(row)
                print(pipeline_table([row], head=len(pipe_rows) == 1), flush=True)
        if opts.only in (None, "scaling"):
            combos = [("single", 1)] if 1 in opts.nprocs else []
            combos += [(s, p) for s in opts.strategies for p in opts.nprocs if p > 1
                       and not (s == "pipeline" and p > 4)]
            for s, p in combos:
                extra = dry_run_collectives(s, p)
                cal = calibration(f"{s}{p}", p)
                row = {"strategy": s, "nproc": p, "round": rnd, "calibration": summary_of(cal),
                       "predicted": predict_step(cal, s, p, opts.draws, extra)}
                row["measured"] = run_train(s, p, opts.epochs)
                scale_rows.append(row)
                print(scaling_table([row], head=len(scale_rows) == 1), flush=True)
    if pipe_rows:
        print("\npipeline, p = 2, m = 4 (makespan: the schedule; step: the whole train_step)")
        print(pipeline_table(pipe_rows))
    if scale_rows:
        print("\nstep time, apps/train.py --model mlp_resnet --batch-size 64")
        print(scaling_table(scale_rows))
    if opts.rounds > 1:
        print(f"\nover {opts.rounds} rounds: medians, and the range of measured / predicted")
        print(rounds_table(pipe_rows, "schedule") if pipe_rows else "")
        print(rounds_table(scale_rows, "strategy") if scale_rows else "")
    load = os.getloadavg()
    print(f"\nfinished after {time.time() - started:.0f} s; load average now "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"pipeline": pipe_rows, "scaling": scale_rows,
                                               "calibrations": folder}, indent=1))
    return 0


def summary_of(cal: Calibration) -> dict:
    """The numbers of a calibration a table row shows."""
    return {"load": cal.machine.get("load_average", [None])[0], "alpha_s": cal.link.alpha,
            "wake_s": cal.link.wake, "compute_noise": cal.noise.compute_mean(),
            "date": cal.machine.get("date")}


if __name__ == "__main__":
    sys.exit(main())
