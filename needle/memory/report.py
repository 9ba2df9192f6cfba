"""Predicted vs measured memory of one training step of a real model.

:func:`training_step_report` first predicts the step from shapes alone when given ``build``
(:func:`~needle.memory.shape_trace.predict_step`: activations, kernel scratch and every
buffer's lifetime, before anything runs), then runs forward, backward and the optimiser step
once, measures the per-category peaks, the activation bytes at the end of the forward pass and
an event timeline, and reconciles them with the predictions (:mod:`needle.memory.reconcile`:
the ledger's bytes per parameter, block rounding from the shapes, the optimizer's update rule,
the shape-only trace): every row names its terms and says whether it is within its stated
tolerance, or why it could not be predicted. The ledger's own comparison
(:func:`~needle.memory.ledger.compare`) is kept beside it as ``comparison``.

Everything here is duck-typed (a model is callable and has ``parameters()``, a loss is a
tensor with ``backward()``, an optimiser has ``step()``): L2 does not import the layers above.

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle import nn, optim
    >>> d = ndl.cpu_numpy(); np.random.seed(0)
    >>> model = nn.Sequential(nn.Linear(8, 8, device=d), nn.ReLU(), nn.Linear(8, 2, device=d))
    >>> x = ndl.Tensor(np.ones((4, 8)), device=d, requires_grad=False)
    >>> y = ndl.Tensor(np.zeros(4), device=d, requires_grad=False)
    >>> r = training_step_report(model, nn.SoftmaxLoss(), optim.SGD(model.parameters()), x, y,
    ...                          optimizer_name="sgd")
    >>> r.reconciliation.row("weight").gap, r.reconciliation.ok, r.reconciliation.unpredicted
    (0, True, ('activation (end of forward)', 'activation (peak)', 'workspace'))
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import numpy as np

from .ledger import Comparison, Ledger, compare, estimate
from .reconcile import (
    Reconciliation,
    branch_points,
    buffer_key,
    declared_saved,
    reconcile_step,
)
from .registry import reset_peak, stats
from .shape_trace import StepPrediction, predict_step, run_step
from .timeline import Timeline, plot_timeline, record

__all__ = ["saved_activation_bytes", "StepReport", "training_step_report"]


def _buffer(array):
    """(key, requested bytes) of the buffer behind a backend array, or None."""
    handle = getattr(array, "_handle", None)
    if handle is None:
        return None
    block = getattr(handle, "_block", None)
    if block is not None:
        return id(block), block.requested
    return id(handle), handle.size * handle.itemsize


def saved_activation_bytes(root) -> int:
    """Requested bytes of the distinct buffers held by the recorded graph behind ``root``.

    Every non-leaf node reachable from ``root`` keeps its data until its backward step (a node
    is a Tensor); views count once, with their base buffer. Buffers of leaves (inputs,
    parameters) are not activations, also when a node is a view of one (a broadcast bias).

    Example:
        >>> import needle as ndl, numpy as np
        >>> w = ndl.Tensor(np.ones((2, 128)), device=ndl.cpu_numpy())
        >>> saved_activation_bytes(((w * 2) + 1).sum())  # two (2, 128) float32 + one scalar
        2052
    """
    seen_nodes: set[int] = set()
    held: dict[int, int] = {}   # buffer key -> requested bytes, for non-leaf nodes
    leaves: set[int] = set()    # buffer keys of leaves
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        data = node.cached_data
        for array in data if isinstance(data, tuple) else (data,):
            buf = _buffer(array)
            if buf is None:
                continue
            if node.op is None:
                leaves.add(buf[0])
            else:
                held[buf[0]] = buf[1]
        stack.extend(node.inputs)
    return sum(nbytes for key, nbytes in held.items() if key not in leaves)


@dataclass
class StepReport:
    """Result of :func:`training_step_report`."""

    ledger: Ledger
    stats: dict
    comparison: Comparison
    timeline: Timeline
    saved_bytes: int
    loss: float
    reconciliation: Reconciliation | None = None
    prediction: StepPrediction | None = None

    def __str__(self) -> str:
        return str(self.reconciliation or self.comparison)


def _bytes_of(tensor) -> int:
    data = tensor.realize_cached_data()
    return int(math.prod(data.shape)) * np.dtype(str(data.dtype)).itemsize


def _fused_update(params) -> bool:
    """Whether needle.optim updates these parameters with one fused kernel each (and so with
    no temporaries): their arrays are ones an ``ewise_program`` takes."""
    from needle.backend_ndarray import ewise_program

    arrays = [p.realize_cached_data() for p in params]
    return bool(arrays) and all(ewise_program.available((a, a)) for a in arrays)


def training_step_report(model, loss_fn, optimizer, x, y, *, optimizer_name: str = "adam",
                         device=None, margin: float = 0.25, plot=None, build=None,
                         prediction: StepPrediction | None = None) -> StepReport:
    """Predict one training step from shapes (with ``build``), run it, and reconcile.

    Args:
        model: callable on ``x``, with ``parameters()``.
        loss_fn: ``loss_fn(model(x), y)`` returns a scalar tensor.
        optimizer: the optimiser object.
        optimizer_name: its name in the ledger (``adam``, ``sgd``, ``sgd_momentum``).
        device: where to measure (default: ``x``'s device).
        margin: the estimate's margin.
        plot: a PNG path for the timeline, or None.
        build: ``build() -> (model, loss_fn, optimizer, x, y)``, the same on ``device``: the
            shape-only trace runs its first step before the measured one. Without it (and
            without ``prediction``) the activation and workspace rows are not predicted.
        prediction: a :func:`~needle.memory.shape_trace.predict_step` result made earlier,
            used instead of tracing ``build``.
    """
    device = device if device is not None else getattr(x, "device", None)
    stats(device)  # fail early, before the step, on a device without statistics
    if prediction is None and build is not None:
        prediction = predict_step(build, device)
    params = list(model.parameters())
    for p in params:
        p.grad = None
    first_step = not any(getattr(optimizer, slot, None)
                         for slot in getattr(optimizer, "_slots", ()))
    found: dict = {}

    def at_forward(loss) -> None:
        found["held"] = stats(device)["by_category"]
        exclude = [buffer_key(t) for t in (*params, x, y)]
        found["saved"], _, found["largest"] = declared_saved(loss, exclude)
        found["saved_bytes"] = saved_activation_bytes(loss)
        found["branches"] = branch_points(loss)
        found["seed"] = _bytes_of(loss)

    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # releases at the same points as in the trace (which runs without the GC)
    try:
        reset_peak(device)
        start = stats(device)
        with record(device) as events:
            value = run_step(model, loss_fn, optimizer, x, y, at_forward)
        measured = stats(device)
    finally:
        if gc_was_enabled:
            gc.enable()
    saved = found["saved"]
    ledger = estimate(model, precision="fp32", optimizer=optimizer_name,
                      activation_bytes=sum(saved.values()), margin=margin)
    recon = reconcile_step(
        ledger=ledger, param_bytes=[_bytes_of(p) for p in params], optimizer=optimizer_name,
        first_step=first_step, weight_decay=bool(getattr(optimizer, "weight_decay", 0)),
        largest_activation=found["largest"], seed_bytes=found["seed"], start=start,
        held=found["held"], end=measured, branches=found["branches"],
        fused_update=_fused_update(params), prediction=prediction)
    if plot is not None:
        plot_timeline(events, plot, title="one training step")
    return StepReport(ledger, measured, compare(ledger, measured), events,
                      found["saved_bytes"], value, recon, prediction)
