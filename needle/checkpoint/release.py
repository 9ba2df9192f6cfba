"""Keep a checkpoint region's graph lean while it is built: release what backward will not read.

A needle graph node owns its output array (``cached_data``) and its consumers hold the node
through ``inputs``, so a recorded graph keeps *every* intermediate alive, while backward reads
only the tensors the ops save (``Op.save_inputs`` / ``save_output``). Inside a checkpoint region
we do better, with no change to the engine:

* the region runs under :class:`~needle.autograd.saved_tensors_hooks`; ``pack`` is called for
  every tensor an op saves, which tells the tracker both *what* backward needs and *when* a new
  op was recorded (each call is a point where earlier nodes can be examined);
* a node can be released once no Python code can reach it except through graph links. That is
  exact in CPython: its reference count equals the links the tracker has counted (from the
  consumers it has walked) plus the tracker's own references. A node someone still names, or one
  with a consumer the tracker has not walked yet, has more references and is left alone;
* *released* means ``cached_data`` becomes a :class:`Released` stand-in that still answers
  ``shape``, ``dtype`` and ``device`` (all the engine checks on an unsaved input) and raises
  :class:`~needle._core.errors.CheckpointError` on any other use.

Two modes: ``keep_saved=True`` (recomputation inside backward: saved tensors stay) and
``keep_saved=False`` (the first forward, whose graph is only read for its structure, so every
unreachable array goes and the forward costs what a ``no_grad`` forward costs).

Example:
    >>> r = Released((2, 3), "float32", None, "EWiseAdd")
    >>> r.shape, r.ndim, r.size
    ((2, 3), 2, 6)
"""
from __future__ import annotations

import contextlib
import sys
import weakref

from ..autograd.release import Released as _EngineReleased
from .._core.errors import CheckpointError

__all__ = ["Released", "Tracker", "release", "release_unsaved"]


class Released(_EngineReleased):
    """A stand-in released inside a checkpoint region: reads raise :class:`CheckpointError`.

    The fields and refusals are the engine's (:class:`needle.autograd.release.Released`).
    """

    __slots__ = ()

    def _fail(self, what: str):
        raise CheckpointError(
            f"checkpoint: the output of {self.op_name} inside a checkpoint region was released "
            f"because no op declares it saved (save_inputs/save_output), expected backward not "
            f"to read it, got a read of {what}")


def release(node) -> None:
    """Replace ``node``'s array by a :class:`Released` stand-in (tuples and lazies untouched)."""
    data = node.cached_data
    if data is None or node._is_tuple or isinstance(data, _EngineReleased):
        return
    op_name = type(node.op).__name__ if node.op is not None else "a leaf"
    node.cached_data = Released(data.shape, data.dtype, getattr(data, "device", None), op_name)


def _unpack_unavailable(packed):
    raise CheckpointError(
        "checkpoint: backward through the first forward of a checkpoint region, expected "
        "gradients to flow through the region's checkpoint node, got a direct use of its "
        "internal graph")


class Tracker:
    """Walk the nodes a region records and release those backward cannot need.

    ``mark``: nodes with ``_seq <= mark`` were made before the region and are never touched.
    Use ``pack``/``unpack`` as the region's saved-tensor hooks and call :meth:`finish` with the
    region's outputs once ``fn`` has returned.
    """

    def __init__(self, mark: int, keep_saved: bool):
        self.mark = mark
        self.keep_saved = keep_saved
        self._visited: dict[int, weakref.ref] = {}
        self._links: dict[int, list] = {}  # id -> [weakref, graph links counted so far]
        self._saved: dict[int, weakref.ref] = {}
        self._pending: dict[int, object] = {}  # candidates for release (strong refs)
        self.released = 0

    # -- saved-tensor hooks ------------------------------------------------------------------
    def pack(self, tensor):
        if self.keep_saved:
            self._saved[id(tensor)] = weakref.ref(tensor)
        self._visit(tensor)
        self._sweep()
        return tensor if self.keep_saved else None

    @property
    def unpack(self):
        return _identity if self.keep_saved else _unpack_unavailable

    def finish(self, outputs) -> None:
        """Walk from the region's outputs and release whatever became unreachable."""
        for out in outputs:
            self._visit(out)
        self._sweep()
        self._pending.clear()

    # -- walking and releasing ------------------------------------------------------------------
    def _known(self, table: dict, node) -> bool:
        ref = table.get(id(node))
        return ref is not None and ref() is node

    def _visit(self, start) -> None:
        mark = self.mark
        stack = [start]
        while stack:
            node = stack.pop()
            if node._seq <= mark or self._known(self._visited, node):
                continue
            self._visited[id(node)] = weakref.ref(node)
            if not node._is_tuple:
                self._pending[id(node)] = node
            for inp in node.inputs:
                if inp._seq > mark:
                    self._count_link(inp)
                    stack.append(inp)

    def _count_link(self, node) -> None:
        entry = self._links.get(id(node))
        if entry is None or entry[0]() is not node:
            self._links[id(node)] = [weakref.ref(node), 1]
        else:
            entry[1] += 1

    def _sweep(self) -> None:
        for key in list(self._pending):
            node = self._pending[key]
            if self.keep_saved and self._known(self._saved, node):
                del self._pending[key]  # backward reads it: never a candidate again
                continue
            entry = self._links.get(key)
            links = entry[1] if entry is not None and entry[0]() is node else 0
            if sys.getrefcount(node) == links + _BASE_REFS:
                release(node)
                self.released += 1
                del self._pending[key]
            del node


def _identity(packed):
    return packed


def _calibrate() -> int:
    """References ``_sweep`` itself holds on a node that nothing else names (dict + local +
    the call's argument), measured rather than assumed so an interpreter change shows up."""
    pending = {0: _Probe()}
    for key in list(pending):
        node = pending[key]
        count = sys.getrefcount(node)
        del node
        return count
    raise AssertionError("unreachable")


class _Probe:
    pass


_BASE_REFS = _calibrate()


@contextlib.contextmanager
def release_unsaved():
    """Record graphs inside the block keeping only what backward reads (no recomputation).

    Ops still record as usual, but an intermediate that no op saves is dropped as soon as
    nothing but the graph refers to it, so a plain training step holds about one array per
    layer instead of every intermediate. Nodes are examined each time an op saves a tensor, so
    the unsaved tail after the last such op is kept (until backward frees it). Yields the
    :class:`Tracker` (``released`` counts what was dropped).

    Example:
        >>> import numpy as np
        >>> from needle import ops
        >>> from needle.autograd import Tensor
        >>> w = Tensor(np.ones((3, 3), dtype="float32"))
        >>> with release_unsaved() as tracker:
        ...     y = ops.relu(Tensor(np.ones((2, 3), dtype="float32")) @ w + 1).sum()
        >>> y.backward(); tracker.released, w.grad.numpy()[0, 0].item()
        (2, 2.0)
    """
    from ..autograd import Tensor, saved_tensors_hooks

    tracker = Tracker(Tensor.make_const(None)._seq, keep_saved=True)
    with saved_tensors_hooks(tracker.pack, tracker.unpack):
        yield tracker
    tracker.finish([])
