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

On ``cuda`` the backend asks ``fn(nbytes)`` for a buffer owner; the run installs one that
wraps the arena's pieces (:class:`~needle.memory.cuda_allocator.DeviceBlock` over an
:class:`ArenaBlock`, whose ``ptr()`` is the arena's address plus the offset).

On ``cpu`` the C++ allocator itself serves the plan (``allocator_plan_begin``/``_end`` of
``ndarray_backend_cpu``, see src/allocator.h): the same sequence, checked the same way; a run
that leaves the trace there is served from the pools from that request on (its results stay
right) and the error is raised when the call returns.

``strict=False`` (what :func:`needle.compile` uses) never raises for a divergent run: the
Python arena then also serves every later request from the caching allocator, and also
when a planned buffer would reuse bytes that a longer-lived one still holds; the return value
says whether the run followed the plan.

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle.memory import plan, trace
    >>> x = ndl.Tensor(np.ones((4, 64)), device=ndl.cpu_numpy(), requires_grad=False)
    >>> f = lambda t: ((t * 2) + 1).sum()
    >>> p = plan(trace(f, x)); p.run(x).numpy().item() == f(x).numpy().item()
    True
"""
from __future__ import annotations

import bisect
import threading

import numpy as np

from .._core.dtypes import numpy_dtype
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
        dtype = numpy_dtype(dtype)
        if count is None:
            count = self.requested // dtype.itemsize
        nbytes = count * dtype.itemsize
        if self.free or nbytes > self.size:
            raise MemoryArgumentError(
                f"view: expected a live arena block of at least {nbytes} bytes, got "
                f"{self.size} bytes{' (released)' if self.free else ''}")
        data = self.allocator.data
        if data is None:  # a device arena: its bytes are reached through ptr(), not here
            raise MemoryArgumentError("view: expected an arena in host memory, got a device "
                                      "arena (read it through ptr())")
        return data[self.offset:self.offset + nbytes].view(dtype)

    def ptr(self) -> int:
        """Address of the first byte (what the CUDA backend's buffer owner reads)."""
        return self.allocator.block.ptr() + self.offset

    def release(self) -> None:
        self.allocator.release(self)


class _PlannedOwner:
    """What the CUDA backend holds for a buffer of a planned run: its address, and the
    block (arena piece or pool block) until dropped."""

    __slots__ = ("block", "ptr")

    def __init__(self, block):
        self.block, self.ptr = block, block.ptr()

    def __del__(self):
        try:
            self.block.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn the allocator down
            pass


class ArenaAllocator:
    """Serves the traced allocation sequence from one arena block (intermediates) or the
    caching allocator (outputs)."""

    def __init__(self, plan, real, strict: bool = True):
        graph = plan.graph
        self.strict = strict
        self.thread = threading.get_ident()  # only this thread's requests follow the plan
        self.diverged: str | None = None
        # tensor id -> its block in this run (non-strict runs: see previous_occupants)
        self.blocks: dict[int, ArenaBlock] = {}
        self.previous: list[tuple[int, ...]] = previous_occupants(plan) if not strict else []
        self.real = real
        self.sequence = graph.allocations
        self.offsets = plan.assignments
        self.sizes = plan.sizes
        self.count = 0
        self.live = 0
        self.finished = False
        self.block = real.allocate(plan.peak_bytes, category="activation")
        # host bytes for backends that view blocks as NumPy arrays; device ones use ptr()
        segment = getattr(self.block, "segment", None)
        on_host = isinstance(getattr(segment, "data", None), np.ndarray)
        self.data = self.block.view("uint8", plan.peak_bytes) if on_host else None

    def _diverge(self, message: str) -> None:
        if self.strict:
            raise MemoryPlanError(f"run: {message} (is the traced call repeatable?)")
        self.diverged = message

    def allocate(self, nbytes: int, dtype=None, category: str | None = None):
        if threading.get_ident() != self.thread:  # another thread (a data loader): not planned
            return self.real.allocate(nbytes, dtype, category)
        j = self.count
        if self.diverged is not None:
            self.count += 1
            return self.real.allocate(nbytes, dtype, category)
        if j >= len(self.sequence):
            self._diverge(f"more allocations than traced, expected {len(self.sequence)}, got "
                          f"allocation #{j} of {nbytes} bytes")
            return self.allocate(nbytes, dtype, category)
        tensor_id, want = self.sequence[j]
        if nbytes != want:
            self._diverge(f"allocation #{j} differs from the trace, expected {want} bytes, got "
                          f"{nbytes}")
            return self.allocate(nbytes, dtype, category)
        offset = self.offsets.get(tensor_id)
        if offset is None:  # an output: it outlives the run
            self.count += 1
            return self.real.allocate(nbytes, dtype, category)
        size = self.sizes[tensor_id]
        if not self.strict:  # a longer lifetime than traced must not share bytes
            blocks = self.blocks
            for before in self.previous[j]:
                held = blocks.get(before)
                if held is not None and not held.free:
                    self._diverge(f"allocation #{j} would share bytes with a planned buffer "
                                  "still alive (released later than traced)")
                    return self.allocate(nbytes, dtype, category)
        self.count += 1
        self.live += 1
        block = ArenaBlock(self, offset, size, nbytes, tensor_id)
        if not self.strict:
            self.blocks[tensor_id] = block
        return block

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


def previous_occupants(plan) -> list[tuple[int, ...]]:
    """Per traced allocation, the planned buffers that last held some of its arena bytes
    before it (empty for an output); made once per plan.

    A non-strict run checks only these for still being alive, not every live buffer: if any
    older buffer still held one of those bytes, the buffer that took the byte after it would
    have met it alive, and the run would have left the plan there.
    """
    cached = plan.__dict__.get("_previous_occupants")
    if cached is not None:
        return cached
    starts: list[int] = []   # the arena as sorted, disjoint [start, end) pieces
    pieces: list[tuple[int, int, int]] = []  # (start, end, tensor id) in the order of starts
    out: list[tuple[int, ...]] = []
    for tensor_id, _ in plan.graph.allocations:
        offset = plan.assignments.get(tensor_id)
        if offset is None:
            out.append(())
            continue
        lo, hi = offset, offset + plan.sizes[tensor_id]
        i = bisect.bisect_right(starts, lo) - 1
        if i < 0 or pieces[i][1] <= lo:
            i += 1
        j, holders, kept = i, [], []
        while j < len(pieces) and pieces[j][0] < hi:
            start, end, holder = pieces[j]
            holders.append(holder)
            if start < lo:
                kept.append((start, lo, holder))
            if end > hi:
                kept.append((hi, end, holder))
            j += 1
        kept.append((lo, hi, tensor_id))
        kept.sort()
        pieces[i:j] = kept
        starts[i:j] = [p[0] for p in kept]
        out.append(tuple(dict.fromkeys(holders)))
    object.__setattr__(plan, "_previous_occupants", out)  # a frozen dataclass: a cache only
    return out


def _cpp_calls(plan) -> tuple:
    """``(begin, end)`` of a planned run of ``plan`` on its device's C++ allocator; ``end()``
    returns None when the run followed the plan, else the reason. Made once per plan, with
    the plan's entries converted for C++ once: a compiled step begins the same plan every
    call, and converting them costs more than a small step's kernels."""
    cached = plan.__dict__.get("_cpp_calls")
    if cached is not None:
        return cached
    mod = plan.graph.device.mod
    if hasattr(mod, "allocator_plan_prepare"):
        prepared = mod.allocator_plan_prepare(plan.peak_bytes, cpp_entries(plan))

        def begin():
            mod.allocator_plan_begin_prepared(prepared)
    else:
        arena, entries = plan.peak_bytes, cpp_entries(plan)

        def begin():
            mod.allocator_plan_begin(arena, entries)

    def end():
        return mod.allocator_plan_end()[2] or None

    calls = (begin, end)
    object.__setattr__(plan, "_cpp_calls", calls)  # a frozen dataclass: a cache only
    return calls


def cpp_entries(plan) -> list[tuple[int, int, int]]:
    """The traced allocation sequence as ``(requested, offset, size)`` for the C++ allocator
    (offset -1: an output, served from the pools); made once per plan (a compiled step
    replays the same plan every call)."""
    cached = plan.__dict__.get("_cpp_entries")
    if cached is None:
        cached = _entries(plan)
        object.__setattr__(plan, "_cpp_entries", cached)  # a frozen dataclass: a cache only
    return cached


def _entries(plan) -> list[tuple[int, int, int]]:
    out = []
    for tensor_id, nbytes in plan.graph.allocations:
        offset = plan.assignments.get(tensor_id)
        out.append((nbytes, -1, 0) if offset is None else (nbytes, offset, plan.sizes[tensor_id]))
    return out


def run_plan(plan, *inputs, strict: bool = True, fn=None):
    """Execute ``plan.graph``'s traced call on ``inputs`` with intermediates in one arena.

    Returns what the call returns; with ``strict=False``, ``(result, divergence)`` where
    ``divergence`` is None when the run followed the plan, else the reason. ``fn`` replaces
    the traced callable (same program, e.g. a wrapper that adds checks).

    Raises:
        MemoryPlanError: the plan's graph was not traced, or (strict) the call did not repeat
            the traced allocations.
    """
    graph = plan.graph
    if getattr(graph, "fn", None) is None or not hasattr(graph, "allocations"):
        raise MemoryPlanError(
            "run: expected a plan of a graph from needle.memory.trace(fn, ...), got a plan "
            "of a graph without a traced call")
    call = graph.fn if fn is None else fn
    # A plan begun before on the C++ allocator has its calls cached: a compiled step's kernel
    # replays come straight here, without looking up the device's allocator again.
    planned = plan.__dict__.get("_cpp_calls")
    if planned is None:
        from .trace import is_cpp, traceable_allocator

        real = traceable_allocator(graph.device, "run")
        if is_cpp(real):
            planned = _cpp_calls(plan)
    if planned is not None:
        begin, end = planned
        begin()
        try:
            result = call(*inputs)
        finally:
            reason = end()
        if not strict:
            return result, reason
        if reason:
            raise MemoryPlanError(f"run: {reason} (is the traced call repeatable?)")
        return result
    arena = ArenaAllocator(plan, real, strict)
    mod = graph.device.mod
    if getattr(mod, "__device_name__", None) == "cuda":
        # the CUDA backend asks fn(nbytes) for an owner of the buffer: here an arena piece or
        # a pool block (cuda_allocator.DeviceBlock reads the pool's blocks only)
        previous = mod.get_allocator()
        mod.set_allocator(lambda nbytes: _PlannedOwner(arena.allocate(nbytes)))
    else:
        previous = real
        mod.set_allocator(arena)
    try:
        result = call(*inputs)
    finally:
        mod.set_allocator(previous)
        arena.finish()
    if arena.diverged is None and arena.count != len(arena.sequence):
        arena._diverge(f"fewer allocations than traced, expected {len(arena.sequence)}, got "
                       f"{arena.count}")
    return result if strict else (result, arena.diverged)
