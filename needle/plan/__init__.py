"""needle.plan: a time and memory model of training, calibrated on this machine or set for a
cluster.

* ``model``: memory by term, traffic, step time and bubble, time to train
  (:func:`predict`, :func:`memory`, :func:`traffic`, :class:`Model`, :class:`Layout`,
  :class:`Device`);
* ``calibration``: this machine's link, device and noise (``python -m needle.plan
  calibrate``); the link itself is ``needle.distributed.calibrate`` (α-β, fitted by a probe);
* ``profile``: compute costs from a profiled step (pipeline stages as the runtime runs them).

Command line: ``python -m needle.plan``. User guide: ``docs/plan.md``.

Example:
    >>> from needle import plan
    >>> plan.memory(plan.Model.dense(70e9), plan.Layout(dp=64, zero=3))["model_state"]
    17500000000.0
"""
from __future__ import annotations

from .model import (
    Device,
    Layer,
    Layout,
    Link,
    Model,
    Noise,
    PlanError,
    Prediction,
    iteration_time,
    memory,
    predict,
    time_to_train,
    traffic,
    years,
)
from .profile import profile_optimizer, profile_schedule, profile_stage, time_calls

__all__ = ["Model", "Layer", "Layout", "Device", "Link", "Noise", "Prediction", "PlanError",
           "predict", "memory", "traffic", "iteration_time", "time_to_train", "years",
           "profile_stage", "profile_schedule", "profile_optimizer", "time_calls"]
