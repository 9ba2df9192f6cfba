"""Python that a kernel program runs on every replay: a step's own bookkeeping.

A kernel program replays what a step did to device buffers and nothing else, so a step that
also updates Python state (Adam's step counter ``t``) and feeds numbers derived from it to the
kernels (the bias corrections ``1 - β^t``) would replay stale numbers. Code like that wraps
the bookkeeping in :func:`replayed`: the function runs now, as always, and a kernel program
recorded from this step calls it again at the same point of every replay, passing its new
results wherever the recorded results went into a kernel (matched by identity: pass the
returned floats on as they are). Changes it makes to plain numbers of ``owner`` are its own:
the compiler neither refuses nor guards them.

The per-thread state lives in :mod:`needle.autograd.grad_mode`, beside the other per-thread
modes, so that ``nn`` and ``optim`` read it without importing the compiler; this module is
the compiler's name for it.

Example (outside a recording nothing is compiling, and ``replayed`` just calls):
    >>> compiling(), replayed(lambda: 0.25, owner=None)
    (False, 0.25)
"""
from __future__ import annotations

from needle.autograd.grad_mode import compiling, replayed, set_compiling
from needle.autograd.grad_mode import set_replay_listener as set_listener

__all__ = ["replayed", "set_listener", "compiling", "set_compiling"]
