"""Predicted vs measured memory of one training step of a real model.

:func:`training_step_report` runs forward, backward and the optimiser step once on a device
with a Python caching allocator, measures per-category peaks and an event timeline, and lays
them beside :func:`~needle.memory.ledger.estimate` (:func:`~needle.memory.ledger.compare`).
The activation term of the estimate is not a rule of thumb: it is the bytes the autograd graph
keeps at the end of the forward pass (:func:`saved_activation_bytes`), so what remains in the
comparison is allocator rounding and temporaries.

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
    >>> r.comparison.row("weight").residual
    0
"""
from __future__ import annotations

from dataclasses import dataclass

from .ledger import Comparison, Ledger, compare, estimate
from .registry import reset_peak, stats
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

    def __str__(self) -> str:
        return str(self.comparison)


def training_step_report(model, loss_fn, optimizer, x, y, *, optimizer_name: str = "adam",
                         device=None, margin: float = 0.25, plot=None) -> StepReport:
    """Run one training step and compare :func:`estimate` with the measured peaks.

    Args:
        model: callable on ``x``, with ``parameters()``.
        loss_fn: ``loss_fn(model(x), y)`` returns a scalar tensor.
        optimizer: the optimiser object.
        optimizer_name: its name in the ledger (``adam``, ``sgd``, ``sgd_momentum``).
        device: where to measure (default: ``x``'s device).
        margin: the estimate's margin.
        plot: a PNG path for the timeline, or None.

    Raises:
        BackendUnavailable: the device has no allocator statistics (``cpu`` for now).
    """
    device = device if device is not None else getattr(x, "device", None)
    for p in model.parameters():
        p.grad = None
    stats(device)  # fail early, before the step, on a device without statistics
    reset_peak(device)
    with record(device) as events:
        loss = loss_fn(model(x), y)
        saved = saved_activation_bytes(loss)
        loss.backward()
        optimizer.step()
        value = float(loss.numpy())
        del loss
    measured = stats(device)
    ledger = estimate(model, precision="fp32", optimizer=optimizer_name, activation_bytes=saved,
                      margin=margin)
    if plot is not None:
        plot_timeline(events, plot, title="one training step")
    return StepReport(ledger, measured, compare(ledger, measured), events, saved, value)
