"""Thread-local autograd state: whether ops record a graph, and the saved-tensor hooks.

Example:
    >>> with no_grad():
    ...     is_grad_enabled()
    False
"""
from __future__ import annotations

import functools
import threading


class _State(threading.local):
    # Class attributes are the per-thread defaults: a fresh thread records graphs.
    grad_enabled = True
    saved_hooks = None  # (pack, unpack) of the innermost saved_tensors_hooks, or None
    # Mixed precision (needle.amp.autocast installs it): ``policy(op, args) -> args`` may cast
    # an op's Tensor arguments before the op runs; None (the default) costs one attribute read.
    cast_policy = None


STATE = _State()


def is_grad_enabled() -> bool:
    """True when new ops record the graph for backward (in this thread)."""
    return STATE.grad_enabled


class _GradMode:
    """Context manager (and decorator) that sets grad mode and restores it on exit."""

    _enabled = True

    def __enter__(self):
        self._prev = STATE.grad_enabled
        STATE.grad_enabled = self._enabled
        return self

    def __exit__(self, *exc) -> None:
        STATE.grad_enabled = self._prev

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with type(self)():
                return fn(*args, **kwargs)

        return wrapper


class no_grad(_GradMode):  # noqa: N801 - lowercase like the PyTorch name users expect
    """Ops inside do not record a graph; results have ``requires_grad=False``.

    Thread-local and nestable; also usable as a decorator.

    Example:
        >>> import needle as ndl
        >>> x = ndl.Tensor([1.0, 2.0])
        >>> with ndl.no_grad():
        ...     (x * 2).requires_grad
        False
    """

    _enabled = False


class enable_grad(_GradMode):  # noqa: N801
    """Turn graph recording back on inside a :class:`no_grad` block.

    Example:
        >>> import needle as ndl
        >>> x = ndl.Tensor([1.0])
        >>> with ndl.no_grad(), ndl.enable_grad():
        ...     (x * 2).requires_grad
        True
    """

    _enabled = True


class set_grad_enabled(_GradMode):  # noqa: N801
    """Set grad mode to ``mode`` for the block (``set_grad_enabled(False)`` = ``no_grad()``)."""

    def __init__(self, mode: bool):
        self._enabled = bool(mode)

    def __call__(self, fn):
        mode = self._enabled

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with set_grad_enabled(mode):
                return fn(*args, **kwargs)

        return wrapper
