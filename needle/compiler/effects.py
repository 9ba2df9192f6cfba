"""Python that a kernel program runs on every replay: a step's own bookkeeping.

A kernel program replays what a step did to device buffers and nothing else, so a step that
also updates Python state (Adam's step counter ``t``) and feeds numbers derived from it to the
kernels (the bias corrections ``1 - β^t``) would replay stale numbers. Code like that wraps
the bookkeeping in :func:`replayed`: the function runs now, as always, and a kernel program
recorded from this step calls it again at the same point of every replay, passing its new
results wherever the recorded results went into a kernel (matched by identity: pass the
returned floats on as they are). Changes it makes to plain numbers of ``owner`` are its own:
the compiler neither refuses nor guards them.

Example:
    >>> class Counter:
    ...     def __init__(self): self.t = 0
    ...     def advance(self):
    ...         self.t += 1
    ...         return 0.5 ** self.t
    >>> c = Counter(); replayed(c.advance, c), c.t
    (0.5, 1)
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from needle import random as _random

__all__ = ["replayed", "set_listener", "compiling", "set_compiling"]


class _Local(threading.local):
    # class defaults: a thread that never set a field reads them without the AttributeError
    # that getattr(local, name, default) would raise and catch (the optimizers ask per
    # parameter whether a compiled step runs)
    listener = None
    compiling = False


_LOCAL = _Local()


def replayed(fn: Callable[[], Any], owner: object) -> Any:
    """``fn()``, also run by every kernel replay of a step recorded around this call (see the
    module docstring). ``fn`` returns a float or a tuple of floats."""
    value = fn()
    listener = _LOCAL.listener
    if listener is not None:
        listener(fn, owner, value)
    return value


def set_listener(fn) -> Any:
    """Install ``fn(fn, owner, value)`` for this thread's :func:`replayed` calls (None: off);
    returns the previous one. needle.compiler's recorder listens while it records a step."""
    prev = _LOCAL.listener
    _LOCAL.listener = fn
    return prev



def compiling() -> bool:
    """True while a compiled step (``needle.compile``) runs on this thread: its warm-up,
    trace, planned and recorded calls all run the step's Python under it.

    Code with a fused shortcut of its own takes its composed path then, so that the trace,
    the plan and the recordings see one and the same sequence of kernels, which the compiler
    fuses itself (the optimizers' updates do this)."""
    return _LOCAL.compiling


def set_compiling(flag: bool) -> None:
    """Mark this thread as running a compiled step's Python (or no longer). Random draws then
    go through NumPy, not a device kernel (``needle.random.draw_through_numpy``): the trace,
    the plan and the recordings see the same allocations and kernels."""
    _LOCAL.compiling = flag
    _random.draw_through_numpy(flag)
