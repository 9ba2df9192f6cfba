"""The run metrics (apps/training/metrics.py): measured between steps, never inside one.

A single-process step makes no call into ``needle.distributed``: every Python function call
is recorded with ``sys.setprofile`` (the module a called function belongs to is its frame's
``__name__``) while steps run, and none may belong to ``needle.distributed``. A planted call
shows the recorder catches one. The loop samples the meters after the run's first step and
after each epoch's last step only, and ``summary.json``'s ``memory`` block keeps its keys.
"""
from __future__ import annotations

import sys
import threading

import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)
from training.data import global_batches, load_data
from training.loop import RunContext
from training.metrics import CounterRate, Meter, ModelStateMemory, RunMetrics
from training.models import device_by_name
from training.strategies import STRATEGIES

FORBIDDEN = "needle.distributed"


def distributed_calls(fn) -> list[str]:
    """Run ``fn()``; every Python function it calls (in any thread) whose module is
    ``needle.distributed`` or below, as ``module.function``."""
    calls: list[str] = []

    def record(frame, event, arg):
        if event == "call":
            module = frame.f_globals.get("__name__") or ""
            if module == FORBIDDEN or module.startswith(FORBIDDEN + "."):
                calls.append(f"{module}.{frame.f_code.co_name}")

    threading.setprofile(record)
    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return calls


def assert_no_distributed_calls(fn) -> None:
    calls = distributed_calls(fn)
    assert not calls, f"calls into {FORBIDDEN}: {sorted(set(calls))}"


def _strategy(*args):
    """A set-up strategy of the main job's command line and its first batch."""
    cfg = train.parse_args([*args, "--no-progress"])
    X, y, _, _ = load_data(cfg)
    strategy = STRATEGIES[cfg.strategy](cfg)
    strategy.setup(RunContext(cfg, device_by_name(cfg.device), X.shape[1],
                              int(y.max()) + 1, 0, 1))
    batch = global_batches(X.shape[0], cfg.batch_size, cfg.seed, 1)[0]
    return strategy, X[batch], y[batch]


STEPS = {
    "default": (),
    "mixed-accumulate-clip": ("--precision", "fp16-mixed", "--accumulate", "2",
                              "--clip-grad", "1.0", "--optimizer", "sgd"),
    "data-shares": ("--data-shares", "2"),
    "mlp-resnet-sgd": ("--optimizer", "sgd", "--model", "mlp"),
}


@pytest.mark.parametrize("case", sorted(STEPS))
def test_single_process_steps_make_no_call_into_needle_distributed(case):
    strategy, X, y = _strategy(*STEPS[case])
    strategy.train_step(X, y)  # first-call work (imports, caches) is part of the check too

    def steps():
        for _ in range(3):
            strategy.train_step(X, y)

    assert_no_distributed_calls(steps)


def test_a_whole_single_process_run_makes_no_call_into_needle_distributed():
    """The loop, the meters, evaluation and the summary included."""
    cfg = train.parse_args(["--max-steps", "3", "--no-progress", "--model", "mlp"])
    summaries = []
    assert_no_distributed_calls(lambda: summaries.append(train.train(cfg)))
    assert summaries[0]["memory"]["per_rank"]


def test_the_recorder_catches_a_planted_call(monkeypatch):
    """The check can fail: a step that calls into needle.distributed is reported."""
    import needle.distributed as dist

    strategy, X, y = _strategy()
    update = strategy._update

    def planted(*args, **kwargs):
        update(*args, **kwargs)
        dist.zero.shard_bounds(10, 2)

    monkeypatch.setattr(strategy, "_update", planted)
    with pytest.raises(AssertionError, match="shard_bounds"):
        assert_no_distributed_calls(lambda: strategy.train_step(X, y))


class _Counting(Meter):
    def __init__(self):
        self.started, self.marked, self.sampled, self.finished = 0, [], [], 0

    def start(self):
        self.started += 1

    def mark(self, steps):
        self.marked.append(steps)

    def sample(self, steps):
        self.sampled.append(steps)

    def finish(self):
        self.finished += 1

    def blocks(self):
        return {"counting": {"samples": list(self.sampled)}}


def test_the_loop_samples_after_the_first_step_and_each_epochs_last(monkeypatch):
    """The digits job has 23 steps per epoch (1,437 examples, batch 64): 30 steps sample
    after steps 1, 23 (the first epoch's last) and 30 (the run's last), mark before the
    steps that follow (before steps 1, 2 and 24: after 0, 1 and 23 steps), finish once."""
    meter = _Counting()
    single = STRATEGIES["single"]
    monkeypatch.setattr(single, "meters", lambda self: [meter])
    summary = train.train(train.parse_args(["--max-steps", "30", "--no-progress",
                                            "--model", "mlp"]))
    assert summary["steps"] == 30 and summary["steps_per_epoch"] == 23
    assert (meter.started, meter.sampled, meter.finished) == (1, [1, 23, 30], 1)
    assert meter.marked == [0, 1, 23]
    assert summary["counting"] == {"samples": [1, 23, 30]}
    assert "memory" not in summary  # the meters chose nothing else


def test_run_metrics_without_meters_measures_nothing():
    metrics = RunMetrics([])
    metrics.start()
    for i in range(5):
        metrics.before_step()
        metrics.after_step(last=i == 4)
    metrics.finish()
    assert metrics.steps == 5 and metrics.summary_blocks() == {}


def test_memory_row_is_the_measurement_right_after_the_last_step():
    """The row equals a direct read of the allocator right after the step; predicted is the
    ledger's; the block keeps summary.json's keys."""
    from needle.memory import accounting

    strategy, X, y = _strategy("--model", "mlp")
    (meter,) = strategy.meters()
    metrics = RunMetrics([meter])
    metrics.start()
    for i in range(3):
        metrics.before_step()
        strategy.train_step(X, y)
        metrics.after_step(last=i == 2)
    direct = accounting.measured(strategy.ctx.device)
    metrics.finish()
    block = metrics.summary_blocks()["memory"]
    assert set(block) == {"per_rank", "when", "measured", "allocated", "predicted", "peak"}
    (row,) = block["per_rank"]
    assert set(row) == {"rank", "measured", "allocated", "predicted", "peak"}
    assert row["measured"] == direct["requested"] and row["allocated"] == direct["allocated"]
    assert row["predicted"] == accounting.predicted(strategy.model, strategy.optimizer, 0, 1, 0)
    assert row["measured"] == row["predicted"]
    assert set(row["measured"]) == {"weight", "gradient", "master", "optimizer"}


def test_memory_meter_with_no_step_reports_no_rows():
    meter = ModelStateMemory(lambda: None, 0, 1)
    meter.sample(1)
    meter.finish()
    assert meter.blocks()["memory"]["per_rank"] == []


def test_counter_rate_counts_steps_only_and_takes_the_median_after_the_first():
    """Marks open an interval before a step, samples close it after one: what the counter
    gains between a sample and the next mark (evaluation) is not a step's."""
    counter = {"sent": 100}  # set-up sent 100
    rate = CounterRate(lambda: counter["sent"])
    metrics = RunMetrics([rate])
    metrics.start()

    def step(sent, last=False):
        metrics.before_step()
        counter["sent"] += sent
        metrics.after_step(last)

    step(1000)  # the first step: set-up traffic of its own
    for _ in range(3):
        step(500)
    step(500, last=True)  # an epoch's last step: 4 steps of 500 since the first
    counter["sent"] += 7777  # evaluation between epochs
    step(300)
    step(300, last=True)  # 2 steps of 300
    assert rate.intervals == [(1, 1000), (4, 2000), (2, 600)]
    assert rate.per_step() == 400  # the median of 500 and 300: the evaluation left out
    only_first = CounterRate(iter([0, 7]).__next__)
    only_first.mark(0)
    only_first.sample(1)
    only_first.sample(2)  # no mark since the last sample: not an interval
    assert only_first.intervals == [(1, 7)] and only_first.per_step() == 7
    assert CounterRate(lambda: 0).per_step() is None


def test_zero_accounting_stays_importable_from_needle_distributed():
    from needle.distributed.zero import accounting as old
    from needle.memory import accounting as new

    assert old.measured is new.measured and old.predicted is new.predicted
    assert old.MODEL_STATE == new.MODEL_STATE == ("weight", "gradient", "master", "optimizer")
    assert callable(old.report)
