"""``trace(fn, *inputs)``: the buffer graph of one call, ready for :func:`needle.memory.plan`.

The call runs once, eagerly, while two observers watch it:

* the device's :class:`~needle.memory.caching_allocator.CachingAllocator` reports every
  allocation and release (a timeline sink);
* the autograd layer reports every op dispatch and every backward step
  (:mod:`needle.memory.hooks`).

Time is a step counter that advances at each allocation, each release and each op or backward
step. Every *buffer* is one :class:`~needle.memory.planner.TensorSpec` (views share their
base's buffer, so a reshape costs nothing): ``def_index`` is the step that allocated it,
``last_use`` the step that released it, ``producer`` the op (or ``Op.gradient`` step) running
then, ``consumers`` the ops that read it. Lifetimes come from the releases, not from the op
reads, because code between ops (optimisers, ``.numpy()``) reads buffers the ops never see: a
buffer is certainly dead once released. Kinds: ``intermediate`` (allocated and released inside
the call: planned), ``output`` (allocated and still alive at the end: gradients, optimiser
state, the result), ``input``/``parameter`` (existing before, read by an op; a leaf that
requires grad is a parameter).

On ``cpu_numpy`` and ``cuda`` the Python allocator reports its events as they happen; on
``cpu`` the C++ allocator logs them and the tracer drains the log at every op boundary, so
both orders are the same. Kernel workspaces of the C++ backend (category ``workspace``,
allocated by worker threads in no fixed order) are not part of the graph: they live inside
one kernel call.
The trace runs ``fn`` for real (gradients accumulate, optimisers step); other threads must not
allocate on the device meanwhile. The garbage collector is paused during the call so that
releases happen at the same steps every time.

Example:
    >>> import numpy as np, needle as ndl
    >>> x = ndl.Tensor(np.ones((4, 64)), device=ndl.cpu_numpy(), requires_grad=False)
    >>> g = trace(lambda t: (t * 2 + 1).sum(), x)
    >>> [(s.kind, s.producer) for s in g.tensors]  # doctest: +NORMALIZE_WHITESPACE
    [('input', None), ('intermediate', 'MulScalar'), ('intermediate', 'AddScalar'),
     ('output', 'Summation')]
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

from needle._core.errors import BackendUnavailable

from . import timeline as _timeline
from .caching_allocator import CachingAllocator
from .cpp_adapter import CppAllocatorAdapter
from .observers import Observer, add_observer
from .planner import Graph, OpNode, TensorSpec
from .registry import get_allocator

__all__ = ["trace", "TracedGraph"]


@dataclass(frozen=True)
class TracedGraph(Graph):
    """A :class:`Graph` from :func:`trace`, with what :meth:`Plan.run` needs to replay it.

    ``allocations``: ``(tensor id, requested bytes)`` in allocation order; ``end_index``: the
    step after the call returned; ``outside_deltas``: in event order, the change of requested
    bytes of every allocation and release that is not a planned intermediate (outputs made,
    buffers from before released, also those no op read), from which
    :meth:`planned_peak_bytes` follows; ``eager_peak_bytes``: the peak of requested bytes above
    those live before the call, during the traced (eager) call itself.
    """

    fn: object = field(default=None, compare=False, repr=False)
    device: object = field(default=None, compare=False)
    allocations: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    end_index: int = 0
    outside_deltas: tuple[int, ...] = field(default=(), repr=False)
    eager_peak_bytes: int = 0

    def planned_peak_bytes(self, plan) -> int:
        """Peak requested bytes above those live before the call, for a run of ``plan``: the
        arena is held for the whole run, everything else comes and goes as traced."""
        level = top = 0
        for delta in self.outside_deltas:
            level += delta
            top = max(top, level)
        return plan.peak_bytes + top

    def bytes_of(self, *kinds: str) -> int:
        """Requested bytes of the tensors of the given kinds."""
        return sum(t.nbytes for t in self.tensors if t.kind in kinds)

    @property
    def output_bytes(self) -> int:
        return self.bytes_of("output")

    def __str__(self) -> str:
        counts = {k: sum(t.kind == k for t in self.tensors)
                  for k in ("input", "parameter", "intermediate", "output")}
        return (f"TracedGraph({len(self.ops)} ops, {len(self.allocations)} allocations, "
                + ", ".join(f"{n} {k}" for k, n in counts.items()) + ")")


class _Buf:
    __slots__ = ("id", "nbytes", "def_index", "last", "producer", "consumers", "phase",
                 "kind", "freed")

    def __init__(self, buf_id, nbytes, def_index, producer, phase, kind):
        self.id, self.nbytes, self.def_index = buf_id, nbytes, def_index
        self.last, self.producer, self.consumers = def_index, producer, []
        self.phase, self.kind, self.freed = phase, kind, False


class _Tracer(Observer):
    """Allocator sink (``append``) and L3 observer at once; builds the graph as events come."""

    def __init__(self, allocator, cpp_mod=None):
        self.alloc = allocator
        # the C++ module whose Array handles this tracer reads (cpu), None for Python ones
        self.cpp_mod = cpp_mod
        self.tick = 0
        self.bufs: list[_Buf] = []
        self.live: dict[int, _Buf] = {}  # block id -> buffer allocated during the call
        self.pre: dict[int, _Buf] = {}   # block id -> buffer that existed before it
        self.order: list[tuple[int, int]] = []
        self.ops: list[OpNode] = []
        self.steps: list[str] = []
        self.backward_depth = 0
        self.deltas: list[tuple[int, int]] = []  # (buffer id or -1 if unknown, bytes)

    def _phase(self) -> str:
        if self.backward_depth:
            return "backward"
        return "forward" if self.steps else "other"

    def _new(self, nbytes, def_index, kind) -> _Buf:
        buf = _Buf(len(self.bufs), nbytes, def_index, self.steps[-1] if self.steps else None,
                   self._phase(), kind)
        self.bufs.append(buf)
        return buf

    # ---- allocator events -------------------------------------------------------------
    def _sync(self) -> None:
        # the C++ allocator logs its events; deliver those logged so far before going on
        if self.cpp_mod is not None:
            self.alloc.drain()

    def append(self, event) -> None:
        if self.cpp_mod is not None and event.category == "workspace":
            return
        if event.kind == "alloc":
            self.tick += 1
            buf = self._new(event.requested, self.tick, "intermediate")
            self.live[event.block] = buf
            self.order.append((buf.id, event.requested))
            self.deltas.append((buf.id, event.requested))
        elif event.kind == "free":
            self.tick += 1
            buf = self.live.pop(event.block, None) or self.pre.pop(event.block, None)
            if buf is not None:
                buf.last, buf.freed = self.tick, True
            self.deltas.append((-1 if buf is None else buf.id, -event.requested))

    # ---- what the ops read --------------------------------------------------------------
    def _buffers(self, value) -> list[_Buf]:
        data = getattr(value, "cached_data", None)
        arrays = data if isinstance(data, tuple) else (data,)
        out = []
        for array in arrays:
            handle = getattr(array, "_handle", None)
            if self.cpp_mod is not None:
                if not isinstance(handle, self.cpp_mod.Array):
                    continue
                block_id, requested = handle.block_id, handle.size * handle.itemsize
            else:
                # numpy backend: the Array keeps its block; cuda: its owner (a DeviceBlock) does
                block = getattr(handle, "_block", None)
                if block is None:
                    block = getattr(getattr(handle, "_owner", None), "block", None)
                if block is None or getattr(block, "allocator", None) is not self.alloc:
                    continue
                block_id, requested = block.id, block.requested
            buf = self.live.get(block_id) or self.pre.get(block_id)
            if buf is None:
                kind = "parameter" if value.op is None and value.requires_grad else "input"
                buf = self.pre[block_id] = self._new(requested, 0, kind)
                buf.producer, buf.phase = None, "other"
            out.append(buf)
        return out

    def _begin(self, name: str, values) -> tuple:
        self._sync()
        self.tick += 1
        reads = []
        for value in values:
            for buf in self._buffers(value):
                buf.consumers.append(name)
                buf.last = max(buf.last, self.tick)
                reads.append(buf.id)
        token = (self.tick, name, tuple(reads), self._phase(), len(self.bufs))
        self.steps.append(name)
        return token

    # Tokens and OpNodes hold names and buffer ids only: keeping an op (or a node) would keep
    # the arrays it holds (SoftmaxCrossEntropy's lse) alive to the end of the traced call,
    # and the plan would count them as outputs that an untraced run frees during backward.
    def op_begin(self, op, inputs):
        return self._begin(type(op).__name__, inputs)

    def op_end(self, token, node) -> None:
        self._sync()
        self.steps.pop()
        index, name, reads, phase, _ = token
        outs = tuple(b.id for b in self._buffers(node)) if node is not None else ()
        self.ops.append(OpNode(index, name, reads, outs, phase))

    def node_begin(self, node):
        return self._begin(type(node.op).__name__ + ".gradient", (*node.inputs, node))

    def node_end(self, token) -> None:
        self._sync()
        self.steps.pop()
        index, name, reads, phase, first = token
        outs = tuple(b.id for b in self.bufs[first:] if not b.freed and b.kind == "intermediate")
        self.ops.append(OpNode(index, name, reads, outs, phase))

    def backward_begin(self) -> None:
        self.backward_depth += 1

    def backward_end(self) -> None:
        self.backward_depth -= 1

    # ---- the result -----------------------------------------------------------------
    def build(self, fn, device) -> TracedGraph:
        self._sync()
        end = self.tick + 1
        specs = []
        for b in self.bufs:
            kind = "output" if b.kind == "intermediate" and not b.freed else b.kind
            last = b.last if b.freed else end
            specs.append(TensorSpec(b.id, b.nbytes, b.def_index, last, b.producer,
                                    tuple(b.consumers), b.phase, kind))
        ops = tuple(sorted(self.ops, key=lambda n: n.index))
        planned = {s.id for s in specs if s.kind == "intermediate"}
        outside = tuple(d for b, d in self.deltas if b not in planned)
        level = top = 0
        for _, delta in self.deltas:
            level += delta
            top = max(top, level)
        return TracedGraph(tuple(specs), ops, fn=fn, device=device,
                           allocations=tuple(self.order), end_index=end,
                           outside_deltas=outside, eager_peak_bytes=top)


def _device_of(inputs, device):
    from needle.backend_ndarray import default_device, device_by_name

    if device is None:
        for x in inputs:
            dev = getattr(x, "device", None)
            if dev is not None and hasattr(dev, "mod"):
                return dev
        return default_device()
    return device_by_name(device) if isinstance(device, str) else device


def is_cpp(alloc) -> bool:
    """True for the C++ allocator's adapter (``cpu``): planned runs go through its module."""
    return isinstance(alloc, CppAllocatorAdapter)


def traceable_allocator(device, op: str = "trace"):
    """The allocator of ``device`` that a trace can observe and a plan can steer: a Python
    :class:`CachingAllocator` the backend module lets one swap (``cpu_numpy``, ``cuda``) or
    the C++ allocator of ``cpu`` built with planned runs; a clear error otherwise."""
    mod = getattr(device, "mod", None)
    try:
        alloc = get_allocator(device)
    except Exception:  # noqa: BLE001 - every failure means the same thing here
        alloc = None
    if isinstance(alloc, CachingAllocator) and hasattr(mod, "set_allocator"):
        return alloc
    if is_cpp(alloc) and hasattr(mod, "allocator_plan_begin"):
        return alloc
    raise BackendUnavailable(
        f"{op}: device {device!r} has no allocator to observe and steer, expected cpu(), "
        f"cpu_numpy() or cuda() (a cpu() build from this tree: pip install -e .), got "
        f"{device!r}")


def trace(fn, *inputs, device=None) -> TracedGraph:
    """Run ``fn(*inputs)`` once and return its buffer graph (see the module docstring).

    Args:
        fn: any callable; it may call ``backward`` and an optimiser's ``step``.
        inputs: passed to ``fn`` (and again by :meth:`Plan.run`).
        device: the device to observe (default: the first input's, else the default device).

    Raises:
        BackendUnavailable: the device's allocator can be neither observed nor steered.
    """
    dev = _device_of(inputs, device)
    alloc = traceable_allocator(dev)
    cpp = is_cpp(alloc)
    tracer = _Tracer(alloc, dev.mod if cpp else None)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    if cpp:
        alloc.begin_recording(tracer)
    else:
        sink = _timeline.add_sink(tracer, frozenset([alloc.name]))
    observing = add_observer(tracer)
    try:
        result = fn(*inputs)
        graph = tracer.build(fn, dev)  # before ``result`` dies: its buffers are outputs
        del result
    finally:
        observing.remove()
        if cpp:
            alloc.end_recording(tracer)
        else:
            _timeline.remove_sink(sink)
        if gc_was_enabled:
            gc.enable()
    return graph
