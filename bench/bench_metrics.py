"""What the run metrics cost the main job's step, side by side.

The job is ``apps/train.py``'s default (``--strategy single``, MLP-ResNet, hidden 100, 8×8
digits, batch 64, Adam): one epoch of its steps (23: 22 of 64 examples and one of 29),
driven as ``training/loop.py`` drives them, in three modes alternated per repeat (each mode
first in turn):

* ``off``: ``RunMetrics([])``, the component inactive (the anchor);
* ``on``: the strategy's meters as the loop runs them: sampled after the run's first step and
  after the epoch's last, so once per epoch here;
* ``every step``: the same meters sampled after every step, the ledger's prediction
  included, which is what the step itself used to do (the cost moved out of it).

Each mode keeps one ``RunMetrics`` over all its epochs, as a long run does (the sample after
the run's first step falls in the warm-up), and its time is the median over repeats of one
epoch, per step. The overhead of ``on`` is also counted directly: the time spent inside the
metrics calls during the ``on`` epochs over the time of those epochs (a sum of small
intervals, steadier than the difference of two noisy medians on a shared machine).
``--clock process`` times with the process's CPU time instead of the wall clock (steadier
when other jobs load the machine). The header records the date, CPU, load and clock.

Run:  python bench/bench_metrics.py [--repeats 15] [--epochs-per-repeat 1] [--clock process]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))

import train  # noqa: E402
from _machine import cpu_model  # noqa: E402
from training.data import global_batches, load_data  # noqa: E402
from training.loop import RunContext  # noqa: E402
from training.metrics import RunMetrics  # noqa: E402
from training.models import device_by_name  # noqa: E402
from training.strategies import STRATEGIES  # noqa: E402

CLOCK = time.perf_counter


class _Timed(RunMetrics):
    """RunMetrics that adds up the time spent inside its own calls."""

    def __init__(self, meters, every_step: bool = False):
        super().__init__(meters)
        self.every_step, self.spent = every_step, 0.0

    def before_step(self) -> None:
        start = CLOCK()
        super().before_step()
        self.spent += CLOCK() - start

    def after_step(self, last: bool = False) -> None:
        start = CLOCK()
        if self.every_step:
            self.steps += 1
            self.sample()
            for meter in self.meters:  # the prediction too, as the step used to compute it
                meter.finish()
        else:
            super().after_step(last)
        self.spent += CLOCK() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--epochs-per-repeat", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "process"], default="wall")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "process" else time.perf_counter
    cfg = train.parse_args(["--no-progress"])  # the default job
    X, y, _, _ = load_data(cfg)
    strategy = STRATEGIES[cfg.strategy](cfg)
    strategy.setup(RunContext(cfg, device_by_name(cfg.device), X.shape[1],
                              int(y.max()) + 1, 0, 1))
    batches = global_batches(X.shape[0], cfg.batch_size, cfg.seed, 1)
    shares = [(X[b], y[b]) for b in batches]

    def epochs(metrics: RunMetrics) -> float:
        start = CLOCK()
        for _ in range(args.epochs_per_repeat):
            for i, (Xb, yb) in enumerate(shares):
                metrics.before_step()
                strategy.train_step(Xb, yb)
                metrics.after_step(last=i == len(shares) - 1)
        return CLOCK() - start

    modes = {"off": _Timed([]), "on": _Timed(strategy.meters()),
             "every step": _Timed(strategy.meters(), every_step=True)}
    for metrics in modes.values():  # warm: caches, first-touch pages, the first sample
        metrics.start()
        epochs(metrics)
        metrics.spent = 0.0
    times: dict[str, list[float]] = {name: [] for name in modes}
    time_on = 0.0
    names = list(modes)
    for r in range(args.repeats):
        for name in names[r % 3:] + names[:r % 3]:  # each mode first in turn
            metrics = modes[name]
            elapsed = epochs(metrics)
            times[name].append(elapsed)
            time_on += elapsed if name == "on" else 0.0
    spent_on = modes["on"].spent
    steps = len(shares) * args.epochs_per_repeat
    per_step = {name: 1e3 * statistics.median(t) / steps for name, t in times.items()}
    print(f"# {datetime.date.today()} {cpu_model()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; default job: {cfg.strategy}, {cfg.model} hidden "
          f"{cfg.hidden}, {cfg.data}, batch {cfg.batch_size}, {cfg.optimizer}; median of "
          f"{args.repeats} alternating repeats of {steps} steps; clock {args.clock}")
    print(f"{'metrics':<12}{'ms/step':>10}{'/ off':>8}")
    for name, ms in per_step.items():
        print(f"{name:<12}{ms:10.3f}{ms / per_step['off']:8.3f}")
    share = 100 * spent_on / time_on
    print(f"metrics calls while 'on': {1e6 * spent_on / (args.repeats * steps):.2f} us per "
          f"step, {share:.3f}% of the step time (limit 1%)")
    print(f"per-step measurement moved out of the step: "
          f"{100 * (per_step['every step'] - per_step['off']) / per_step['every step']:.1f}% "
          f"of the step it was in ({per_step['every step']:.3f} -> {per_step['on']:.3f} ms)")
    return 0 if share < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
