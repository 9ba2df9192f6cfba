"""``Plan.run``: replay a traced call with every intermediate at its planned arena offset.

The call is executed again, eagerly, while the device's backend module allocates through an
:class:`ArenaAllocator` instead of the caching allocator. The backend asks for buffers in the
same order as during the trace (the program is the same); the k-th request is served from
the k-th traced allocation's plan: an intermediate gets a view of the arena at its offset
(releasing it does nothing: its bytes are reused by the plan), an output gets a real block
from the caching allocator. Kernels write into those views (the NDArray layer hands them the
buffer as ``out``), so the numbers are the eager ones.

Because the arena is one block held for the whole run, the caching allocator measures
``p.peak_bytes`` (the arena) plus the outputs plus whatever existed before: the planned peak.

A request whose size differs from the trace, or one more than were traced, raises
:class:`MemoryPlanError`: the call is not repeatable (e.g. ``.grad`` accumulating into an
existing gradient, or an optimiser creating its state on the first step only).

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle.memory import plan, trace
    >>> x = ndl.Tensor(np.ones((4, 64)), device=ndl.cpu_numpy(), requires_grad=False)
    >>> f = lambda t: ((t * 2) + 1).sum()
    >>> p = plan(trace(f, x)); p.run(x).numpy().item() == f(x).numpy().item()
    True
"""
from __future__ import annotations

import numpy as np

from ._errors import MemoryArgumentError, MemoryPlanError

__all__ = ["ArenaAllocator", "run_plan"]


class ArenaBlock:
    """A piece of the arena handed to one backend ``Array`` (the allocator block protocol)."""

    __slots__ = ("allocator", "offset", "size", "requested", "free", "id")

    def __init__(self, allocator: "ArenaAllocator", offset: int, size: int, requested: int,
                 block_id: int):
        self.allocator, self.offset, self.size = allocator, offset, size
        self.requested, self.free, self.id = requested, False, block_id

    def view(self, dtype="uint8", count: int | None = None):
        dtype = np.dtype(dtype)
        if count is None:
            count = self.requested // dtype.itemsize
        nbytes = count * dtype.itemsize
        if self.free or nbytes > self.size:
            raise MemoryArgumentError(
                f"view: expected a live arena block of at least {nbytes} bytes, got "
                f"{self.size} bytes{' (released)' if self.free else ''}")
        return self.allocator.data[self.offset:self.offset + nbytes].view(dtype)

    def release(self) -> None:
        self.allocator.release(self)


class ArenaAllocator:
    """Serves the traced allocation sequence from one arena block (intermediates) or the
    caching allocator (outputs)."""

    def __init__(self, plan, real):
        graph = plan.graph
        self.real = real
        self.sequence = graph.allocations
        self.offsets = plan.assignments
        self.sizes = plan.sizes
        self.count = 0
        self.live = 0
        self.finished = False
        self.block = real.allocate(plan.peak_bytes, category="activation")
        self.data = self.block.view("uint8", plan.peak_bytes)

    def allocate(self, nbytes: int, dtype=None, category: str | None = None):
        j = self.count
        if j >= len(self.sequence):
            raise MemoryPlanError(
                f"run: more allocations than traced, expected {len(self.sequence)}, got "
                f"allocation #{j} of {nbytes} bytes (is the traced call repeatable?)")
        tensor_id, want = self.sequence[j]
        if nbytes != want:
            raise MemoryPlanError(
                f"run: allocation #{j} differs from the trace, expected {want} bytes, got "
                f"{nbytes} (is the traced call repeatable?)")
        self.count += 1
        offset = self.offsets.get(tensor_id)
        if offset is None:  # an output: it outlives the run
            return self.real.allocate(nbytes, dtype, category)
        self.live += 1
        return ArenaBlock(self, offset, self.sizes[tensor_id], nbytes, tensor_id)

    def release(self, block: ArenaBlock) -> None:
        if block.free:
            raise MemoryArgumentError(f"release: arena block of tensor {block.id} released twice")
        block.free = True
        self.live -= 1
        if self.finished and not self.live:
            self._close()

    def finish(self) -> None:
        """The run is over: give the arena back once no intermediate is alive any more."""
        self.finished = True
        if not self.live:
            self._close()

    def _close(self) -> None:
        if self.block is not None:
            self.data = None
            self.block.release()
            self.block = None


def run_plan(plan, *inputs):
    """Execute ``plan.graph``'s traced call on ``inputs`` with intermediates in one arena.

    Returns what the call returns.

    Raises:
        MemoryPlanError: the plan's graph was not traced, or the call did not repeat the
            traced allocations.
    """
    graph = plan.graph
    if getattr(graph, "fn", None) is None or not hasattr(graph, "allocations"):
        raise MemoryPlanError(
            "run: expected a plan of a graph from needle.memory.trace(fn, ...), got a plan "
            "of a graph without a traced call")
    from .trace import traceable_allocator

    real = traceable_allocator(graph.device, "run")
    mod = graph.device.mod
    arena = ArenaAllocator(plan, real)
    mod.set_allocator(arena)
    try:
        result = graph.fn(*inputs)
    finally:
        mod.set_allocator(real)
        arena.finish()
    if arena.count != len(arena.sequence):
        raise MemoryPlanError(
            f"run: fewer allocations than traced, expected {len(arena.sequence)}, got "
            f"{arena.count} (is the traced call repeatable?)")
    return result
