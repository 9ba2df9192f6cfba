"""Run metrics, measured beside the training step instead of inside it.

The step computes; what is reported about it (model-state memory, communication bytes) is
read here, at the points where the loop logs. The loop (``loop.py``) builds one
:class:`RunMetrics` per rank from the strategy's :meth:`meters` and calls

* ``start()`` before the first step;
* ``before_step(X, y)`` before every optimizer step (``X, y``: this rank's share): a flag
  test; the meters mark the point only before the first step after a sample (where a
  counter's next interval starts, so that evaluation between epochs is not counted as
  steps); meters with ``per_step`` set see every step (``step_begin``, ``step_end``);
* ``after_step(last)`` after every optimizer step: a counter; the meters sample only after
  the run's first step and after each epoch's last step (``last``), where the loop logs.
  Both points are right after a step, with the step's gradients still held;
* ``finish()`` on every rank at the end of the run (collective where distributed: every
  rank's memory row is gathered on the reporting rank);
* ``summary_blocks()`` on the reporting rank: the meters' blocks of ``summary.json``.

A meter is a :class:`Meter`: any of ``start``, ``mark``, ``sample``, ``finish`` and
``blocks`` it overrides. A strategy chooses its meters in ``meters()`` and may keep a
reference to read a result into its own block (``zero`` reads its traffic meter). With no
meters, ``RunMetrics([])``, the loop measures nothing; ``bench/bench_metrics.py`` times the
step both ways.
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import numpy as np

_KINDS = ("measured", "allocated", "predicted")
_PEAK = ("predicted", "measured", "step", "max_measured", "held_predicted", "held_measured")


class ModelState(NamedTuple):
    """What a memory meter measures: the device and this rank's model, optimizer and ZeRO
    stage (the prediction's inputs)."""

    device: Any
    model: Any
    optimizer: Any
    zero_stage: int = 0


class Meter:
    """One measurement of a run; every hook is optional (the defaults do nothing)."""

    per_step = False  # whether step_begin and step_end are called around every step

    def step_begin(self, steps: int, X, y) -> None:
        """Right before a step (``per_step`` meters); ``X, y``: this rank's share."""

    def step_end(self, steps: int) -> None:
        """Right after a step (``per_step`` meters); ``steps`` counts it."""

    def start(self) -> None:
        """Before the run's first step."""

    def mark(self, steps: int) -> None:
        """Right before the first step after a sample (and before the run's first step);
        ``steps``: steps run so far."""

    def sample(self, steps: int) -> None:
        """Right after a step; ``steps``: steps this process has run so far."""

    def finish(self) -> None:
        """At the end of the run, on every rank in the same order (may be collective)."""

    def blocks(self) -> dict:
        """This meter's blocks of ``summary.json`` (reporting rank, after :meth:`finish`)."""
        return {}


class RunMetrics:
    """The meters of one rank's run, called by the loop (see the module doc)."""

    def __init__(self, meters: list[Meter]):
        self.meters = list(meters)
        self._per_step = [m for m in self.meters if m.per_step]
        self.steps = 0
        self._mark_due = True

    def start(self) -> None:
        for meter in self.meters:
            meter.start()
        self._mark_due = True

    def before_step(self, X=None, y=None) -> None:
        """Before an optimizer step on this rank's share ``X, y``."""
        if self._mark_due:
            self._mark_due = False
            for meter in self.meters:
                meter.mark(self.steps)
        for meter in self._per_step:
            meter.step_begin(self.steps, X, y)

    def after_step(self, last: bool = False) -> None:
        """After an optimizer step; ``last``: the epoch's (or the run's) last step."""
        self.steps += 1
        for meter in self._per_step:
            meter.step_end(self.steps)
        if self.steps == 1 or last:
            self.sample()

    def sample(self) -> None:
        for meter in self.meters:
            meter.sample(self.steps)
        self._mark_due = True

    def finish(self) -> None:
        for meter in self.meters:
            meter.finish()

    def summary_blocks(self) -> dict:
        blocks: dict = {}
        for meter in self.meters:
            blocks.update(meter.blocks())
        return blocks


class ModelStateMemory(Meter):
    """``summary.json``'s ``memory``: this rank's model-state bytes by category, measured by
    ``needle.memory`` beside the ledger's prediction; every rank's row on the reporting rank.

    ``probe()`` returns the :class:`ModelState` to measure (None: nothing yet). With
    ``at_end``, the meter measures once, in :meth:`finish` (strategies whose ranks free
    set-up state late); else at every sample, keeping the latest. The prediction depends only
    on shapes, dtypes, optimizer and layout, so it is computed once, at the end. ``gather``:
    every rank's row reaches the reporting rank by an all-gather (False: the strategy carries
    this rank's :attr:`row` itself, as the parameter server's workers do)."""

    def __init__(self, probe: Callable[[], ModelState | None], rank: int, world_size: int,
                 when: str = "right after the last optimizer step", at_end: bool = False,
                 peak: "PeakMemory | None" = None, gather: bool = True):
        self.probe, self.rank, self.world_size, self.gather = probe, rank, world_size, gather
        self.when, self.at_end = when, at_end
        self.peak = peak  # each row gains this rank's step peak (``PeakMemory.row``)
        self.per_step = peak is not None
        self._state: ModelState | None = None
        self._measured: dict | None = None
        self.row: dict | None = None  # this rank's, after finish
        self.rows: list[dict] = []  # every rank's, on the reporting rank

    def step_begin(self, steps: int, X, y) -> None:
        self.peak.step_begin(steps, X, y)

    def step_end(self, steps: int) -> None:
        self.peak.step_end(steps)

    def mark(self, steps: int) -> None:
        if self.peak is not None:
            self.peak.mark(steps)

    def sample(self, steps: int) -> None:
        if self.peak is not None:
            self.peak.sample(steps)
        if not self.at_end:
            self._measure()

    def _measure(self) -> None:
        from needle.memory import accounting

        state = self.probe()
        if state is not None:
            self._state, self._measured = state, accounting.measured(state.device)

    def finish(self) -> None:
        if self.row is not None:  # finished already (a strategy that sends its row itself)
            return
        if self.at_end:
            self._measure()
        state, got = self._state, self._measured
        if state is None or got is None:  # no step ran: nothing to report (on every rank)
            return
        from needle.memory import accounting

        want = accounting.predicted(state.model, state.optimizer, state.zero_stage,
                                    self.world_size, self.rank)
        self.row = {"rank": self.rank, "measured": got["requested"],
                    "allocated": got["allocated"], "predicted": want}
        if self.peak is not None:
            self.row["peak"] = self.peak.row()
        self.rows = [self.row] if self.world_size == 1 or not self.gather else _gather_rows(
            self.row, self.world_size)

    def blocks(self) -> dict:
        block = {
            "per_rank": self.rows, "when": self.when,
            "measured": "requested bytes held per category (needle.memory)",
            "allocated": "the same in 512-byte-rounded allocator blocks",
            "predicted": "needle.memory.estimate for this rank"}
        if self.peak is not None:
            block["peak"] = self.peak.describe()
        return {"memory": block}


def _gather_rows(row: dict, world_size: int) -> list[dict]:
    """Every rank's memory row, in rank order (collective)."""
    import needle.distributed as dist
    from needle.memory.accounting import MODEL_STATE

    peak = row.get("peak")
    cells = [row[k][c] for k in _KINDS for c in MODEL_STATE]
    if peak is not None:  # None (not predicted, not run) travels as -1
        cells += [-1 if peak[k] is None else peak[k] for k in _PEAK]
    mine = np.array(cells, dtype=np.int64)
    every = [np.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    rows = []
    size = len(_KINDS) * len(MODEL_STATE)
    for r, values in enumerate(every):
        v = values[:size].reshape(len(_KINDS), len(MODEL_STATE))
        rows.append({"rank": r, **{k: {c: int(v[i][j]) for j, c in enumerate(MODEL_STATE)}
                                   for i, k in enumerate(_KINDS)}})
        if peak is not None:
            rows[-1]["peak"] = {k: None if x < 0 else int(x)
                                for k, x in zip(_PEAK, values[size:], strict=True)}
    return rows


class PeakMemory:
    """The peak of one step on this rank (``summary.json``'s ``memory.per_rank[r].peak``):
    ``predict(X, y, first)`` (``apps/training/peak.py``) before the run's second step (its
    first when only one runs), the device allocator's ``peak_requested_bytes`` over that step
    (peaks reset right before it) beside it; and ``max_measured``, the highest peak of every
    step: the peaks are reset where the meters mark (before the first step after a sample)
    and read where they sample (after the epoch's last step), so evaluation between epochs
    is left out and the steps in between pay nothing."""

    def __init__(self, predict: Callable, device: Any):
        self.predict, self.device = predict, device
        self.prediction: dict = {}
        self.measured = self.step = self.held = None
        self.max_measured = 0
        self.seconds: list[float] = []  # seconds per step, per interval from mark to sample
        self._open: tuple[float, int] | None = None

    def _allocator(self):
        from needle.memory import get_allocator

        return get_allocator(self.device)

    def mark(self, steps: int) -> None:
        self._allocator().reset_peak()
        self._open = (time.perf_counter(), steps)

    def sample(self, steps: int) -> None:
        self.max_measured = max(self.max_measured,
                                int(self._allocator().stats()["peak_requested_bytes"]))
        if self._open is not None and steps > self._open[1]:
            self.seconds.append((time.perf_counter() - self._open[0]) / (steps - self._open[1]))
        self._open = None

    def step_begin(self, steps: int, X, y) -> None:
        if steps >= 2:
            return
        self.prediction = self.predict(X, y, steps == 0) if X is not None else {
            "predicted": None, "why": "the step's batch was not given"}
        allocator = self._allocator()
        allocator.reset_peak()  # after the prediction: its copies are not the step's
        self.held = int(allocator.stats()["requested_bytes"])
        self._open = (time.perf_counter(), steps)

    def step_end(self, steps: int) -> None:
        if steps <= 2:
            self.measured, self.step = int(self._allocator().stats()["peak_requested_bytes"]), steps
            self.max_measured = max(self.max_measured, self.measured)

    def row(self) -> dict:
        p = self.prediction
        return {"predicted": p.get("predicted"), "measured": self.measured, "step": self.step,
                "max_measured": self.max_measured, "held_predicted": p.get("held_at_start"),
                "held_measured": self.held}

    def describe(self) -> dict:
        """What the numbers are (the reporting rank's prediction terms included)."""
        out = {"measured": "peak_requested_bytes of the device allocator over the step "
                           "(needle.memory; peaks reset right before it)",
               "predicted": "computed before the step (apps/training/peak.py, "
                            "docs/training.md)",
               "max_measured": "the highest measured peak of every step of the run",
               "step_s_median": float(np.median(self.seconds)) if self.seconds else None}
        out.update({k: v for k, v in self.prediction.items()
                    if k in ("why", "where", "terms", "activations")})
        return out


class CounterRate(Meter):
    """Per-step growth of a counter that only grows (bytes a rank has sent), over intervals
    from a mark (before a step) to the next sample (after a later step), so that what runs
    between a sample and the next step (evaluation) is left out. :meth:`per_step` is the
    median over the intervals after the first (the first step may differ: set-up), else
    the first's."""

    def __init__(self, read: Callable[[], int]):
        self.read = read
        self._open: tuple[int, int] | None = None  # (steps, counter) at the last mark
        self.intervals: list[tuple[int, int]] = []  # (steps, growth) per interval

    def mark(self, steps: int) -> None:
        self._open = (steps, int(self.read()))

    def sample(self, steps: int) -> None:
        if self._open is not None and steps > self._open[0]:
            self.intervals.append((steps - self._open[0], int(self.read()) - self._open[1]))
            self._open = None

    def per_step(self) -> int | None:
        rates = [grown / steps for steps, grown in self.intervals]
        if not rates:
            return None
        return int(round(float(np.median(rates[1:] or rates))))


class CommunicationLedger(Meter):
    """``summary.json``'s ``traffic``: this rank's communication ledger (predicted beside
    measured bytes per call and per step, ``needle.distributed.traffic``), read at the end."""

    def __init__(self, rank: int):
        self.rank = rank

    def blocks(self) -> dict:
        import needle.distributed as dist

        block = dist.traffic.ledger().summary()
        block["rank"] = self.rank
        return {"traffic": block}
