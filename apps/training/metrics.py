"""Run metrics, measured beside the training step instead of inside it.

The step computes; what is reported about it (model-state memory, communication bytes) is
read here, at the points where the loop logs. The loop (``loop.py``) builds one
:class:`RunMetrics` per rank from the strategy's :meth:`meters` and calls

* ``start()`` before the first step;
* ``before_step()`` before every optimizer step: a flag test; the meters mark the point
  only before the first step after a sample (where a counter's next interval starts, so
  that evaluation between epochs is not counted as steps);
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

from typing import Any, Callable, NamedTuple

import numpy as np

_KINDS = ("measured", "allocated", "predicted")


class ModelState(NamedTuple):
    """What a memory meter measures: the device and this rank's model, optimizer and ZeRO
    stage (the prediction's inputs)."""

    device: Any
    model: Any
    optimizer: Any
    zero_stage: int = 0


class Meter:
    """One measurement of a run; every hook is optional (the defaults do nothing)."""

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
        self.steps = 0
        self._mark_due = True

    def start(self) -> None:
        for meter in self.meters:
            meter.start()
        self._mark_due = True

    def before_step(self) -> None:
        """Before an optimizer step."""
        if self._mark_due:
            self._mark_due = False
            for meter in self.meters:
                meter.mark(self.steps)

    def after_step(self, last: bool = False) -> None:
        """After an optimizer step; ``last``: the epoch's (or the run's) last step."""
        self.steps += 1
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
    on shapes, dtypes, optimizer and layout, so it is computed once, at the end."""

    def __init__(self, probe: Callable[[], ModelState | None], rank: int, world_size: int,
                 when: str = "right after the last optimizer step", at_end: bool = False):
        self.probe, self.rank, self.world_size = probe, rank, world_size
        self.when, self.at_end = when, at_end
        self._state: ModelState | None = None
        self._measured: dict | None = None
        self.row: dict | None = None  # this rank's, after finish
        self.rows: list[dict] = []  # every rank's, on the reporting rank

    def sample(self, steps: int) -> None:
        if not self.at_end:
            self._measure()

    def _measure(self) -> None:
        from needle.memory import accounting

        state = self.probe()
        if state is not None:
            self._state, self._measured = state, accounting.measured(state.device)

    def finish(self) -> None:
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
        self.rows = [self.row] if self.world_size == 1 else _gather_rows(self.row,
                                                                         self.world_size)

    def blocks(self) -> dict:
        return {"memory": {
            "per_rank": self.rows, "when": self.when,
            "measured": "requested bytes held per category (needle.memory)",
            "allocated": "the same in 512-byte-rounded allocator blocks",
            "predicted": "needle.memory.estimate for this rank"}}


def _gather_rows(row: dict, world_size: int) -> list[dict]:
    """Every rank's memory row, in rank order (collective)."""
    import needle.distributed as dist
    from needle.memory.accounting import MODEL_STATE

    mine = np.array([row[k][c] for k in _KINDS for c in MODEL_STATE], dtype=np.int64)
    every = [np.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    rows = []
    for r, values in enumerate(every):
        v = values.reshape(len(_KINDS), len(MODEL_STATE))
        rows.append({"rank": r, **{k: {c: int(v[i][j]) for j, c in enumerate(MODEL_STATE)}
                                   for i, k in enumerate(_KINDS)}})
    return rows


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
