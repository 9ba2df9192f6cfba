"""Activation checkpointing (L5): trade recomputation for activation memory, exactly.

* :func:`checkpoint` — one region: ``fn(*args)`` keeps only its inputs and the random state at
  entry; backward recomputes it (same dropout masks, same module state) and backpropagates
  through the recomputed segment alone. Gradients are bitwise those of the plain graph.
* :func:`checkpoint_sequential` — a chain cut into segments, one region each.
* :func:`plan_checkpoints` — where to cut, from per-layer costs: ``sqrt`` policy or the least
  recompute under a byte budget, each with the cost model's predicted peak;
  :func:`measure_layer_costs` measures the costs on the real layers, so that the measured
  activation peak of running the plan stays within the budget.
* :func:`checkpoint_report` — what policies change, measured (``python -m needle.memory
  checkpoint-report``): saved vs recomputed tensors, bytes, FLOPs, random draws, peaks,
  and the recompute overhead R/(F+B), counted from the ops and measured.
* :func:`is_recomputing` — for stateful code that must act once per step.
* :func:`release_unsaved` — record a plain graph that keeps only what backward reads, at every
  size (autograd's own release, ``needle/autograd/release.py``, with its size threshold off).

See docs/checkpointing.md for the cost model, the guarantees and the caveats.

Example:
    >>> import numpy as np
    >>> from needle import nn
    >>> from needle.autograd import Tensor
    >>> np.random.seed(0); net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> y = checkpoint_sequential(net, 2, Tensor(np.ones((3, 4), dtype="float32")))
    >>> y.sum().backward(); net.modules[2].weight.grad.shape
    (4, 1)
"""
from __future__ import annotations

from ..autograd.release import Released, release_unsaved
from .costs import measure_layer_costs
from .plan import CheckpointPlan, LayerCost, equal_segments, plan_checkpoints, predict_peak
from .region import checkpoint, is_recomputing
from .report import CheckpointReport, checkpoint_report
from .sequential import checkpoint_sequential

__all__ = ["checkpoint", "checkpoint_sequential", "plan_checkpoints", "CheckpointPlan",
           "LayerCost", "measure_layer_costs", "predict_peak", "equal_segments",
           "is_recomputing", "Released", "release_unsaved", "checkpoint_report",
           "CheckpointReport"]
