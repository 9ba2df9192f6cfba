"""Refusal of data-dependent Python inside a compiled step.

A compiled step's plan is fixed by its trace: reading a tensor's values on the host inside the
step (``loss.numpy()``, ``float(loss)`` through ``__array__``, ``if (x > 0).numpy().any()``)
would let the Python take a different path from the traced one. While a compiled step runs,
every such read of a value the step *computed* (a tensor made by an op) raises
:class:`~needle.CompileError` naming the line of the step that made it. Leaves (the step's
inputs, parameters, detached tensors) may be read: class labels turned into a one-hot on the
host are part of the input, not of the program (reading ``loss.detach()`` escapes the check).

Example:
    >>> import needle as ndl
    >>> t = ndl.Tensor([1.0]) * 2
    >>> try:
    ...     with refuse_host_reads("step"):
    ...         t.numpy()
    ... except ndl.CompileError as e:
    ...     str(e)[:46]
    'compile: step reads tensor values on the host,'
"""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
from typing import Iterator

from needle._core.errors import CompileError
from needle.autograd.tensor import set_host_read_guard

__all__ = ["refuse_host_reads", "user_frame"]

_NEEDLE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_frame(depth: int = 2) -> tuple[str, int, str]:
    """``(file, line, source)`` of the innermost caller outside the needle package (the line
    of the user's step), or of the innermost frame when every frame is needle's."""
    frame = sys._getframe(depth)
    first = frame
    while frame is not None and frame.f_code.co_filename.startswith(_NEEDLE_DIR):
        frame = frame.f_back
    frame = frame or first
    path, line = frame.f_code.co_filename, frame.f_lineno
    return path, line, linecache.getline(path, line).strip()


@contextlib.contextmanager
def refuse_host_reads(name: str) -> Iterator[None]:
    """While the block runs, a host read of tensor values raises :class:`CompileError`."""

    def guard(tensor, what):
        if tensor.op is None:  # a leaf: input data, not a value the step computed
            return
        path, line, source = user_frame()
        raise CompileError(
            f"compile: {name} reads tensor values on the host, {what} at {path}:{line}"
            f"{f' ({source})' if source else ''}; expected a step whose Python does not depend "
            "on tensor values (the captured plan replays one path), got a host read: return "
            "the tensor from the step and read it after the call, or call the step uncompiled")

    prev = set_host_read_guard(guard)
    try:
        yield
    finally:
        set_host_read_guard(prev)
