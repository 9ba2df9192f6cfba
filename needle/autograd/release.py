"""Free recorded outputs that backward will not read once nothing but the graph holds them.

A needle graph node *is* the Tensor the user got back, and each consumer keeps its inputs in
``node.inputs``. Without help, a recorded forward therefore keeps every intermediate array
alive until backward, where PyTorch keeps only what the ops save: a Linear+ReLU layer held
three arrays (x@W, +b, relu) instead of one.

Rule (nd mode): an output whose own op does not save it (``save_output``) and that no consumer
saves (``save_inputs``) is *released* — its array
replaced by a :class:`Released` stand-in that still answers ``shape``/``dtype``/``device``,
the only things the engine reads of an unsaved input — as soon as no Python reference other
than consumers' ``inputs`` reaches it. CPython's reference count makes that exact: the count
is compared with the graph links counted when consumers were recorded. Only outputs of at
least ``RELEASE_MIN_ELEMENTS`` elements are tracked. A tensor the user still names is never
released; it is looked at again at each later op (at most
``_MAX_SWEEPS`` times, then left alone, as before this module) and once more when
``backward()`` starts.

Under ``saved_tensors_hooks`` what an op keeps is what ``pack`` returned (held in the
consumer's ``_saved``), so there the reference count alone decides: a tensor ``pack`` kept is
referenced and stays; one it replaced (by a copy, or by nothing, as a checkpoint region's first
forward does) is released like any unsaved output.

This is needle's one release mechanism: checkpoint regions and
:func:`release_unsaved` use it too.

Example:
    >>> r = Released((2, 3), "float32", None, "EWiseAdd")
    >>> r.shape, r.size
    ((2, 3), 6)
"""
from __future__ import annotations

import contextlib
import math
import sys
from weakref import ref as _ref

from .._core.errors import ReleasedDataError
from .hooks import SAVED_SELF

__all__ = ["Released", "track", "sweep", "release_unsaved", "released_total"]

_MAX_SWEEPS = 16
# Outputs smaller than this are kept until backward as before: their memory is negligible and
# tracking them would cost small, dispatch-bound models more time (~1.5 µs an op) than it saves.
RELEASE_MIN_ELEMENTS = 16384


class Released:
    """What is left of a released array: its shape, dtype and device, nothing to compute on."""

    __slots__ = ("shape", "dtype", "device", "op_name")

    def __init__(self, shape, dtype, device, op_name: str):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device
        self.op_name = op_name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def _fail(self, what: str):
        raise ReleasedDataError(
            f"autograd: the output of {self.op_name} was released after the forward because "
            f"no op saves it for backward and nothing referenced it, expected no further "
            f"reads, got a read of {what} (keep a reference to the tensor to keep its data)")

    def __getattr__(self, name):
        self._fail(repr(name))

    def __array__(self, *args, **kwargs):
        self._fail("its values")

    def __repr__(self) -> str:
        return f"Released(shape={self.shape}, dtype={self.dtype}, op={self.op_name})"


def _refuse(name: str):
    def method(self, *args):
        self._fail(f"its values (through {name})")

    method.__name__ = name
    return method


# Dunder methods bypass __getattr__: refuse arithmetic, comparisons and indexing explicitly.
for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "matmul",
              "rmatmul", "pow", "rpow", "neg", "abs", "gt", "ge", "lt", "le", "getitem",
              "setitem", "iter", "float", "int"):
    setattr(Released, f"__{_name}__", _refuse(f"__{_name}__"))


_TOTAL = [0]  # releases since import (read through released_total)


def released_total() -> int:
    """How many arrays autograd has released since ``import needle``."""
    return _TOTAL[0]


def release(node) -> None:
    """Replace ``node``'s array by a :class:`Released` stand-in."""
    data = node.cached_data
    if data is None or isinstance(data, Released):
        return
    node.cached_data = Released(data.shape, data.dtype, getattr(data, "device", None),
                                type(node.op).__name__)
    _TOTAL[0] += 1


# Candidates: [weakref to node, sweeps survived]. Weak, so the list keeps nothing alive; an
# entry leaves at its first sweep unless the user still names the node (at most _MAX_SWEEPS).
CANDIDATES: list = []


def track(node, op, inputs) -> None:
    """Count ``node``'s links to tracked inputs and note what ``op`` saves; the next recorded
    op sweeps before it computes."""
    saved = node._saved  # set when saved_tensors_hooks were active: references decide then
    if CANDIDATES:
        # links matter only for candidates still listed: with none listed (every output of a
        # small model) there is nothing to count
        save = op.save_inputs
        i = 0
        for x in inputs:
            if x._tracked:
                x._links += 1
                if saved is None and (save is None or i in save):
                    x._keep = True
            i += 1
    keeps_self = op.save_output and (saved is None or saved[1][-1] is SAVED_SELF)
    if not keeps_self and not node._is_tuple:
        handle = getattr(node.cached_data, "_handle", None)
        if handle is not None and handle.size >= RELEASE_MIN_ELEMENTS:
            node._tracked = True
            CANDIDATES.append([_ref(node), 0])
    # the sweep runs at the start of the next recorded op, before it allocates (value.py)


def sweep(final: bool = False) -> None:
    """Release candidates that only graph links reach; forget the kept and the long-held."""
    survivors = []
    for entry in CANDIDATES:
        node = entry[0]()
        if node is None or node._keep or node._freed:
            continue
        # references now: this frame's ``node`` and getrefcount's argument, plus the links
        if sys.getrefcount(node) - _BASE <= node._links:
            release(node)
        elif final or entry[1] < _MAX_SWEEPS:
            entry[1] += 1
            survivors.append(entry)
    node = entry = None
    CANDIDATES[:] = survivors


def _calibrate() -> int:
    """References :func:`sweep` itself holds on a node (measured the way ``sweep`` looks,
    so an interpreter change shows up here rather than as a wrong release)."""
    holder = [_Probe()]  # stands for exactly one graph link
    entries = [[_ref(holder[0]), 0]]
    for entry in entries:
        node = entry[0]()
        return sys.getrefcount(node) - 1
    raise AssertionError("unreachable")


class _Probe:
    pass


_BASE = _calibrate()


class _ReleaseCount:
    """What :func:`release_unsaved` yields: ``released`` counts the arrays released since
    the block opened."""

    def __init__(self):
        self._start = _TOTAL[0]
        self._end = None

    @property
    def released(self) -> int:
        end = _TOTAL[0] if self._end is None else self._end
        return end - self._start


@contextlib.contextmanager
def release_unsaved():
    """Inside the block, release unsaved outputs of every size, and all of them on exit.

    Autograd already releases what backward will not read (this module), but skips outputs
    under ``RELEASE_MIN_ELEMENTS`` elements to keep small models fast, and a tensor the forward
    still named when the last op ran is looked at again only when backward starts. The block
    lowers the threshold to zero and makes that last look on exit, so a graph recorded inside
    holds about one array per layer right away. Yields a counter (``released``). Not
    thread-safe: the threshold is process-wide.

    Example:
        >>> import numpy as np
        >>> from needle import ops
        >>> from needle.autograd import Tensor
        >>> w = Tensor(np.ones((3, 3), dtype="float32"))
        >>> with release_unsaved() as count:
        ...     y = ops.relu(Tensor(np.ones((2, 3), dtype="float32")) @ w + 1).sum()
        >>> y.backward(); count.released, w.grad.numpy()[0, 0].item()
        (2, 2.0)
    """
    global RELEASE_MIN_ELEMENTS
    previous = RELEASE_MIN_ELEMENTS
    RELEASE_MIN_ELEMENTS = 0
    count = _ReleaseCount()
    try:
        yield count
    finally:
        RELEASE_MIN_ELEMENTS = previous
        sweep(final=True)
        count._end = _TOTAL[0]
