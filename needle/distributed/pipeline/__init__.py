"""Pipeline parallelism: stages on ranks, schedules as data, a simulator checked against runs.

* autograd-aware point-to-point: :func:`send_forward`, :func:`recv_forward`,
  :func:`wait_sends` (``autograd_p2p.py``);
* stages: :class:`PipelineStage`, :func:`split_sequential`, :func:`balance`;
* schedules: :func:`make_plan` builds per-rank action lists (``schedules.py``) that one
  runtime executes (:class:`ScheduleGPipe`, :class:`Schedule1F1B`,
  :class:`ScheduleInterleaved1F1B`, :class:`ScheduleZeroBubble`, ``step(inputs, targets)``)
  and that :func:`simulate` reads;
* measurement: ``record=True`` and ``schedule.report()`` (predicted vs measured bubble and
  activation bytes per stage).

Command line: ``python -m needle.distributed.pipeline simulate --schedule gpipe --stages 4
--microbatches 8 [--plot FILE]``. User guide: ``docs/pipeline.md``.

Example:
    >>> from needle.distributed import pipeline
    >>> round(pipeline.simulate("gpipe", 4, 8).bubble_fraction, 4)
    0.2727
"""
from __future__ import annotations

from .autograd_p2p import Link, recv_forward, send_forward
from .report import PipelineReport
from .runtime import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    schedule_class,
)
from .schedules import SCHEDULES, Action, Plan, ScheduleError, make_plan, validate_plan
from .simulator import Event, Simulation, min_microbatches, simulate
from .split_backward import SplitBackward
from .stage import PipelineStage, balance, measure_costs, parameter_costs, split_sequential
from .wire import PipelineAborted, wait_sends

__all__ = ["send_forward", "recv_forward", "wait_sends", "Link", "PipelineStage",
           "split_sequential", "balance", "measure_costs", "parameter_costs",
           "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble", "schedule_class", "make_plan", "validate_plan", "Plan",
           "Action", "SCHEDULES", "ScheduleError", "simulate", "min_microbatches",
           "Simulation", "Event", "PipelineReport", "PipelineAborted", "SplitBackward"]
