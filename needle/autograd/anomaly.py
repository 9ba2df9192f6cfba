"""Anomaly mode: stop at the first op whose output holds a NaN or an Inf, and say where it is.

Inside ``with detect_anomaly():`` every op's output is checked as the op returns, in forward
and in backward (the ops a gradient rule runs are ops too). The first non-finite output
raises :class:`NonFiniteError` naming the op, whether its inputs were still finite (if not,
the op only passed a bad value on: the data or a gradient from outside was already bad), and
the user's source line: the first frame outside ``needle`` on the stack. In backward that
line is where the op being differentiated was called in forward, which is why every op
recorded in anomaly mode remembers its call site (one walk up the stack per op).

It is built on the observer slots of :mod:`needle.memory.observers`, so outside the block it
costs nothing. Inside, each op pays a host copy of its output and a finiteness test: a
debugging mode, not a training mode (``docs/debugging.md`` has the measured overhead). The
mode is process-wide (every thread's ops are checked).

Example:
    >>> import needle as ndl
    >>> try:
    ...     with ndl.autograd.detect_anomaly():
    ...         y = ndl.log(ndl.Tensor([1.0, 0.0]))
    ... except ndl.autograd.NonFiniteError as err:
    ...     print(err.op, err.phase, err.values, err.inputs_finite)
    Log forward -inf True
"""
from __future__ import annotations

import linecache
import os
import sys
from types import FrameType

import numpy as np

from .._core.errors import NeedleError
from ..memory.observers import Observer, add_observer

__all__ = ["NonFiniteError", "detect_anomaly"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class NonFiniteError(NeedleError, ArithmeticError):
    """An op produced a NaN or an Inf under :func:`detect_anomaly`.

    Attributes: ``op`` (class name), ``phase`` ("forward", "backward" or a marked phase such
    as "optimizer"), ``values`` ("nan", "inf", "-inf", joined by " and "), ``site``
    ("path:line: source" of the user's call), ``backward_of`` (in backward: the op whose
    gradient was being computed), ``inputs_finite``.
    """

    def __init__(self, op: str, phase: str, values: str, site: str, inputs_finite: bool,
                 backward_of: str | None = None):
        self.op, self.phase, self.values, self.site = op, phase, values, site
        self.inputs_finite, self.backward_of = inputs_finite, backward_of
        where = f"in the backward of {backward_of}" if backward_of else f"in {phase}"
        cause = ("from finite inputs" if inputs_finite
                 else "from inputs that already held NaN/Inf")
        super().__init__(f"{op} produced {values} {where}, {cause}, at {site}")


def call_site(skip: str = _PACKAGE) -> tuple[str, int]:
    """(file, line) of the innermost frame outside the ``needle`` package."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return ("<unknown>", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def _describe(site: tuple[str, int] | None) -> str:
    if site is None:
        return "<not recorded: the op ran before anomaly mode started>"
    path, line = site
    text = linecache.getline(path, line).strip()
    shown = os.path.relpath(path) if os.path.isabs(path) else path
    return f"{shown}:{line}" + (f": {text}" if text else "")


def _bad_values(data) -> str | None:
    """None when ``data`` (an array, or a tuple of them) is finite, else what it holds."""
    if data is None:
        return None
    if isinstance(data, (tuple, list)):
        found = [v for v in map(_bad_values, data) if v]
        return " and ".join(found) if found else None
    array = data.numpy() if hasattr(data, "numpy") else np.asarray(data)
    if array.dtype.kind not in "fc" or np.isfinite(array).all():
        return None
    kinds = [("nan", np.isnan(array).any()), ("inf", np.isposinf(array).any()),
             ("-inf", np.isneginf(array).any())]
    return " and ".join(name for name, present in kinds if present)


class _Anomaly(Observer):
    """The observer: checks each op's output, remembers forward call sites for backward."""

    def __init__(self) -> None:
        self.differentiating: list = []  # (op name, forward site) of the nodes in backward
        self.phases: list[str] = []

    def op_end(self, token, node) -> None:
        if node is None:  # compute raised: that error is the news
            return
        if node.op is not None and not self.differentiating:
            node._anomaly_site = call_site()
        values = _bad_values(node.cached_data)
        if values is None:
            return
        op, inputs = token  # a gradient rule's ops are not recorded: node.op is None there
        inputs_finite = all(_bad_values(x.cached_data) is None for x in inputs)
        if self.differentiating:
            name, site = self.differentiating[-1]
            raise NonFiniteError(op, "backward", values, _describe(site), inputs_finite,
                                 backward_of=name)
        phase = self.phases[-1] if self.phases else "forward"
        raise NonFiniteError(op, phase, values, _describe(call_site()), inputs_finite)

    def op_begin(self, op, inputs):
        return type(op).__name__, inputs

    def node_begin(self, node):
        self.differentiating.append((type(node.op).__name__,
                                     getattr(node, "_anomaly_site", None)))

    def node_end(self, token) -> None:
        self.differentiating.pop()

    def backward_end(self) -> None:
        self.differentiating.clear()  # also after a backward that raised

    def phase_begin(self, name: str, label: str | None = None):
        self.phases.append(label or name)

    def phase_end(self, token) -> None:
        self.phases.pop()


class detect_anomaly:  # noqa: N801 - a context manager, named like one
    """Within the block, the first op (forward or backward) whose output holds a NaN or an
    Inf raises :class:`NonFiniteError` with the op and the user's source line (module doc).

    Example:
        >>> import needle as ndl
        >>> x = ndl.Tensor([4.0, 1.0])
        >>> with ndl.autograd.detect_anomaly():
        ...     ndl.log(x).sum().backward()
        >>> x.grad.numpy().tolist()
        [0.25, 1.0]
    """

    def __enter__(self) -> "detect_anomaly":
        self._handle = add_observer(_Anomaly())
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
