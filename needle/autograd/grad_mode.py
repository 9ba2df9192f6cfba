"""Thread-local autograd state: whether ops record a graph, the saved-tensor hooks, and
whether a compiled step's Python runs (:func:`compiling`, with :func:`replayed` for the
bookkeeping a kernel replay must run again).

The compiler (``needle.compiler``, a layer above) sets the last two; the modules below it
(``nn``, ``optim``) read them here, so that none of them imports the compiler.

Example:
    >>> with no_grad():
    ...     is_grad_enabled()
    False
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from .. import random as _random


class _State(threading.local):
    # Class attributes are the per-thread defaults: a fresh thread records graphs.
    grad_enabled = True
    saved_hooks = None  # (pack, unpack) of the innermost saved_tensors_hooks, or None
    # Mixed precision (needle.amp.autocast installs it): ``policy(op, args) -> args`` may cast
    # an op's Tensor arguments before the op runs; None (the default) costs one attribute read.
    cast_policy = None
    # Set by needle.compiler while a compiled step's Python runs on this thread / while it
    # records that step's kernels (the optimizers ask per parameter: one attribute read).
    compiling = False
    replay_listener: Callable[[Callable, object, Any], None] | None = None


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


# ----- compiled steps ---------------------------------------------------------------------------
def compiling() -> bool:
    """True while a compiled step (``needle.compile``) runs on this thread: its warm-up,
    trace, planned and recorded calls all run the step's Python under it.

    Code with a fused shortcut of its own takes its composed path then, so that the trace,
    the plan and the recordings see one and the same sequence of kernels, which the compiler
    fuses itself (the optimizers' updates and BatchNorm's running averages do this).

    Example:
        >>> compiling()
        False
        >>> set_compiling(True); compiling()
        True
        >>> set_compiling(False)
    """
    return STATE.compiling


def set_compiling(flag: bool) -> None:
    """Mark this thread as running a compiled step's Python (or no longer). Random draws then
    go through NumPy, not a device kernel (``needle.random.draw_through_numpy``): the trace,
    the plan and the recordings see the same allocations and kernels."""
    STATE.compiling = bool(flag)
    _random.draw_through_numpy(flag)


def replayed(fn: Callable[[], Any], owner: object) -> Any:
    """``fn()``, also run by every kernel replay of a compiled step recorded around this
    call. ``fn`` returns a float or a tuple of floats; the replay passes its new results
    wherever the recorded ones went into a kernel (``needle.compiler.effects`` explains).

    Example:
        >>> class Counter:
        ...     def __init__(self): self.t = 0
        ...     def advance(self):
        ...         self.t += 1
        ...         return 0.5 ** self.t
        >>> c = Counter(); replayed(c.advance, c), c.t
        (0.5, 1)
    """
    value = fn()
    listener = STATE.replay_listener
    if listener is not None:
        listener(fn, owner, value)
    return value


def set_replay_listener(fn: Callable[[Callable, object, Any], None] | None) -> Any:
    """Install ``fn(fn, owner, value)`` for this thread's :func:`replayed` calls (None: off);
    returns the previous one. needle.compiler's recorder listens while it records a step."""
    previous = STATE.replay_listener
    STATE.replay_listener = fn
    return previous
