"""Parameter server against DDP's ring allreduce, on the main job (apps/train.py), same workers.

    python bench/bench_ps.py --workers 2 --steps 40 --delays 0 20 50

For each delay d (one worker sleeps d ms before every step: a straggler) it runs DDP on W
ranks and the parameter server (1 server + W workers) in every mode: sync, async, ssp with
s = 1, 2, 4, and backup with k = W - 1. It prints updates/s and examples/s with the ratio to
DDP measured in the same run, and the payload bytes per worker step, predicted (push M + pull
M) and measured on the server. With ``--plot`` it also trains each mode for ``--plot-epochs``
epochs with the straggler at the first nonzero delay, evaluating the held-out accuracy every
few updates, and writes accuracy against wall-clock (``bench/out/ps_accuracy_vs_time.png``):
the price of staleness, seen rather than assumed.

Throughput counts the training loop only (no process start-up). For the parameter server it
is measured while every worker still runs (``ps.all_active``: until the first worker has done
its shard), since afterwards async modes leave the straggler finishing its own shard alone.
``updates/s`` counts optimizer steps: async and ssp apply every gradient on its own (W per
round), sync and backup one per round. Numbers from a loaded 2-core machine are noisy;
compare the ratios to DDP printed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "apps" / "train.py"


def modes(workers: int) -> list[tuple[str, list[str]]]:
    out = [("ddp ring", ["--strategy", "ddp"]),
           ("ps sync", ["--strategy", "ps", "--ps-mode", "sync"]),
           ("ps async", ["--strategy", "ps", "--ps-mode", "async"])]
    out += [(f"ps ssp s={s}", ["--strategy", "ps", "--ps-mode", "ssp", "--staleness", str(s)])
            for s in (1, 2, 4)]
    if workers > 1:
        out.append((f"ps backup k={workers - 1}",
                    ["--strategy", "ps", "--ps-mode", "backup", "--wait-for", str(workers - 1)]))
    return out


def run(args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1",
                   NEEDLE_DIST_BACKEND="tcp")
        proc = subprocess.run([sys.executable, str(TRAIN), *args, "--out", out, "--no-progress"],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"bench_ps: {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(out, "summary.json").read_text())


def slow_rank(strategy_args: list[str], workers: int) -> int:
    """The last worker's rank (servers come first under ps)."""
    return workers if "ps" in strategy_args else workers - 1


def throughput(opts) -> list[dict]:
    rows = []
    for delay in opts.delays:
        for name, extra in modes(opts.workers):
            args = ["--model", opts.model, "--max-steps", str(opts.steps), "--epochs", "50",
                    "--nproc", str(opts.workers), "--seed", "0", *extra]
            if delay:
                args += ["--slow-worker", f"{slow_rank(extra, opts.workers)}:{delay}"]
            s = run(args, opts.timeout)
            ps = s.get("ps")
            row = {"delay_ms": delay, "mode": name, "wall_s": s["wall_s"],
                   "accuracy": s["accuracy"], "steps": s["steps"]}
            if ps:
                # while every worker runs: a fixed shard per worker means that, at the end,
                # async modes wait for the straggler to finish its own shard alone
                window = ps["all_active"]
                pushes = sum(ps["worker_clocks"])
                m = ps["bytes_predicted"]["per_worker_step"] // 2
                row.update(updates_per_s=window["updates_per_s"],
                           examples_per_s=window["examples_per_s"],
                           dropped=ps["gradients_dropped"],
                           max_staleness=ps["max_staleness"],
                           bytes_per_worker_step_predicted=2 * m,
                           bytes_per_worker_step_measured=(ps["bytes_pushed"]
                                                           + ps["bytes_pulled"]) / max(pushes, 1))
            else:
                traffic = s.get("traffic", {})
                sent = traffic.get("sent", 0)
                row.update(updates_per_s=s["steps"] / s["wall_s"],
                           examples_per_s=s["steps"] * opts.batch / s["wall_s"],
                           bytes_per_worker_step_measured=sent / max(s["steps"], 1),
                           bytes_per_worker_step_predicted=traffic.get("predicted_sent", 0)
                           / max(s["steps"], 1))
            rows.append(row)
            print(f"delay {delay:3d} ms  {name:14s}  {row['updates_per_s']:8.1f} updates/s  "
                  f"{row['examples_per_s']:8.0f} examples/s  acc {row['accuracy']:.3f}  "
                  f"bytes/worker-step predicted {row['bytes_per_worker_step_predicted']:,.0f} "
                  f"measured {row['bytes_per_worker_step_measured']:,.0f}", flush=True)
        anchor = next(r for r in rows if r["delay_ms"] == delay and r["mode"] == "ddp ring")
        for r in rows:
            if r["delay_ms"] == delay:
                r["examples_per_s_vs_ddp"] = r["examples_per_s"] / anchor["examples_per_s"]
    print("\nexamples/s relative to ddp ring allreduce in this run (1.00 = ddp):")
    names = [name for name, _ in modes(opts.workers)]
    print("delay ms  " + "  ".join(f"{n:>14s}" for n in names))
    for delay in opts.delays:
        ratios = {r["mode"]: r["examples_per_s_vs_ddp"] for r in rows if r["delay_ms"] == delay}
        print(f"{delay:8d}  " + "  ".join(f"{ratios[n]:14.2f}" for n in names))
    return rows


def accuracy_curves(opts) -> dict:
    delay = next((d for d in opts.delays if d), 0)
    curves = {}
    for name, extra in modes(opts.workers):
        args = ["--model", opts.model, "--epochs", str(opts.plot_epochs), "--nproc",
                str(opts.workers), "--seed", "0", *extra]
        if delay:
            args += ["--slow-worker", f"{slow_rank(extra, opts.workers)}:{delay}"]
        if "ps" in extra:
            args += ["--ps-eval-every", str(opts.eval_every)]
        s = run(args, opts.timeout)
        if "ps" in s:
            curves[name] = [(t, acc) for t, _, acc in s["ps"]["accuracy_timeline"]]
        else:  # ddp: held-out accuracy after each epoch, at the epoch's cumulative time
            h, t, points = s["history"], 0.0, []
            for acc, rate in zip(h["test_acc"], h["examples_per_s"], strict=True):
                t += s["train_examples"] / rate
                points.append((t, acc))
            curves[name] = points
        print(f"curve {name}: {len(curves[name])} points, final accuracy "
              f"{curves[name][-1][1]:.3f} at {curves[name][-1][0]:.1f} s", flush=True)
    return {"delay_ms": delay, "curves": curves}


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in curves["curves"].items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
    ax.set(xlabel="wall-clock (s)", ylabel="held-out accuracy",
           title=f"accuracy vs time, one worker slowed {curves['delay_ms']} ms/step")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--delays", type=int, nargs="+", default=[0, 20, 50])
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch", type=int, default=64, help="train.py's default --batch-size")
    p.add_argument("--plot", action="store_true")
    p.add_argument("--plot-epochs", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=str(ROOT / "bench" / "out" / "bench_ps.json"))
    opts = p.parse_args(argv)
    result = {"throughput": throughput(opts)}
    if opts.plot:
        result["accuracy_vs_time"] = accuracy_curves(opts)
        plot(result["accuracy_vs_time"], ROOT / "bench" / "out" / "ps_accuracy_vs_time.png")
    Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
