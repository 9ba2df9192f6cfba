"""Backward refuses saved data that changed after the op saved it.

An op's gradient reads what the op saved (``save_inputs`` / ``save_output``, or what a
``saved_tensors_hooks`` pack kept). If that data changes between forward and backward, the
gradient is silently wrong. Two kinds of change are recorded, both stamped on the clock that
numbers graph nodes (``needle._core.versions``):

* in-place writes into a backend buffer (``NDArray.__setitem__`` / ``fill``, hence
  ``.flat[j] += eps`` and writes through any view sharing the buffer; the fused optimizer
  updates, which rewrite θ in its buffer), per buffer;
* replacements of a Tensor's data (``Tensor.data = ...``, optimizer steps, which an in-place
  update also notes so that a parameter's version counts steps), per Tensor, here
  (:func:`note_replaced`).

The engine calls :func:`check_saved` on a node only when some change at all happened after the
node was recorded (``LAST[0] > node._seq``), so a backward that follows its forward without
changes pays one integer comparison per node. The check raises ``GraphError`` naming the op,
which saved tensor changed, and its version when saved and now.

NumPy arrays (np mode, ``NEEDLE_BACKEND=np``) cannot be hooked: there only replacements are
seen, not writes into ``cached_data``.

Example:
    >>> import needle as ndl
    >>> x = ndl.Tensor([1.0, 2.0])
    >>> y = ndl.ops.exp(x)
    >>> y.realize_cached_data()[0] = 0.0
    >>> try:
    ...     y.sum().backward()
    ... except ndl.GraphError as exc:
    ...     print(str(exc)[:42])
    backward: Exp saved its output for its gra
"""
from __future__ import annotations

from .._core.errors import GraphError
from .._core.versions import BUFFER_LOGS, LAST, WriteLog, buffer_log
from ..backend_ndarray import NDArray as _NDArray
from .hooks import SAVED_SELF
from .value import Value, describe

__all__ = ["note_replaced", "check_saved", "check_kept", "data_version"]


def note_replaced(tensor) -> None:
    """Record that ``tensor``'s data was replaced (bumps its data version).

    ``Tensor.data = ...`` and the optimizers call this; code that assigns ``cached_data``
    of a tensor that a graph may have saved should call it too.
    """
    log = tensor._data_log
    fresh = log is None
    if fresh:
        log = WriteLog()
    # A leaf no recorded node has read (not _watched) cannot be saved data of any graph:
    # the change is stamped on its own log but not published as the latest change, so
    # backward keeps skipping the check of nodes recorded before it (BatchNorm's running
    # statistics are replaced in every training forward; publishing that made backward
    # check ~24 of an MLPResNet step's 28 nodes, ~20 us). A node that reads the tensor
    # later was recorded after the stamp, which then cannot concern it.
    if tensor.op is None and not tensor._watched:
        log.record_quiet()
    else:
        log.record()
    if fresh:  # published after its first stamp: a reader never sees a log without stamps
        tensor._data_log = log


def data_version(tensor) -> int:
    """How many times ``tensor``'s data was replaced (``Tensor.data = ...``, optimizer steps)."""
    log = tensor._data_log
    return 0 if log is None else log.count


def _handles(data) -> tuple:
    if isinstance(data, _NDArray):
        return (data._handle,)
    if isinstance(data, tuple):
        return tuple(h for part in data for h in _handles(part))
    return ()  # NumPy arrays (np mode), released stand-ins: nothing to look at


def _changed(tensor, seq: int) -> bool:
    """True when ``tensor``'s data was replaced or its buffer written after clock ``seq``.

    The common case (a Tensor over one NDArray) is inlined: this runs for every saved tensor
    of every node whose check cannot be skipped.
    """
    log = tensor._data_log
    if log is not None and log.stamps[-1] > seq:
        return True
    data = tensor.cached_data
    if type(data) is _NDArray:
        log = BUFFER_LOGS.get(id(data._handle))
        return log is not None and log.stamps[-1] > seq
    return any(buffer_log(h) is not None and buffer_log(h).changed_after(seq)
               for h in _handles(data))


def check_saved(node) -> None:
    """Raise ``GraphError`` when data that ``node``'s op saved changed after it was recorded."""
    seq = node._seq
    saved = node._saved
    if saved is None:
        op, inputs = node.op, node.inputs
        for i in range(len(inputs)) if op.save_inputs is None else op.save_inputs:
            if _changed(inputs[i], seq):
                _check(node, f"input {i}", inputs[i])
        if op.save_output and _changed(node, seq):
            _check(node, "its output", node)
        return
    for k, packed in enumerate(saved[1]):
        tensor = node if packed is SAVED_SELF else packed
        if isinstance(tensor, Value) and _changed(tensor, seq):
            _check(node, f"tensor {k}", tensor)


def check_kept(node, kept, op_name: str | None = None) -> None:
    """:func:`check_saved` for data an op keeps outside ``saved_tensors``.

    ``kept()`` returns ``(label, item)`` pairs, each item a Tensor (its replacements and its
    buffer are checked) or a backend array (its buffer); it is called only when something
    changed after ``node`` was recorded. A checkpoint region keeps its arguments' arrays and
    reads captured tensors again when it recomputes: it checks them here first. ``op_name``
    replaces the op's class name in the message.
    """
    if LAST[0] > node._seq:
        for label, item in kept():
            _check(node, label, item, op_name)


def _check(node, label, item, op_name=None) -> None:
    """Raise, explaining the change, when ``item`` changed after ``node`` was recorded."""
    seq = node._seq
    data = item
    if isinstance(item, Value):
        log = item._data_log
        if log is not None and log.changed_after(seq):
            _stale(node, label, item, log, "data was replaced (Tensor.data assignment or an "
                   "optimizer step)", "data version", op_name)
        data = item.cached_data
    for handle in _handles(data):
        log = buffer_log(handle)
        if log is not None and log.changed_after(seq):
            _stale(node, label, item, log, "array was written in place", "version", op_name)


def _stale(node, label, item, log, what, kind, op_name=None):
    op = op_name or type(node.op).__name__
    then, exact = log.version_at(node._seq)
    then = f"{then}" if exact else f"{then} or less"
    name = describe(item) if isinstance(item, Value) else (
        f"array(shape={tuple(item.shape)}, dtype={item.dtype})")
    raise GraphError(
        f"backward: {op} saved {label} for its gradient, {name}, and its {what} after {op} "
        f"ran; expected {kind} {then} (as saved), got version {log.count}. The gradient would "
        f"use the changed values: run the forward again after the change, or change a copy "
        f"(Tensor(t.numpy()); t.detach() shares the array)")
