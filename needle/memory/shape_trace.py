"""Predict a training step's activations and kernel scratch from shapes alone, before running.

:func:`predict_step` runs one training step (forward, backward, optimizer step) of a model
built by the caller, with every buffer of the device replaced by a :class:`ShapeArray`: a
size, a dtype and a block of a *simulated* :class:`~needle.memory.caching_allocator.
CachingAllocator` whose segments hold no bytes. The step's Python runs as written (autograd
records, saves and releases; the optimizer updates), so what the framework keeps and frees is
exactly what it would keep and free; the kernels do not run. The device is routed through
``needle.backend_ndarray.intercept`` to a :class:`ShapeBackend` standing in for its backend
module: every function the module has is there (so the NDArray layer takes the same paths),
called on shape-only buffers it does nothing but charge the kernel's scratch
(:mod:`needle.memory.kernel_scratch`) to the simulated allocator.

The simulated allocator applies the real one's rules (512 B blocks, small and large pools,
categories resolved from the same thread state), so its per-category statistics are what the
device's allocator will report, block rounding included. Buffers are traced as
:func:`~needle.memory.trace.trace` traces a real call (:class:`~needle.memory.trace.TracedGraph`:
each buffer's producer, consumers and lifetime), and the buffers the graph saves for backward
at the end of the forward pass are listed with their shapes (:class:`SavedBuffer`).

The only freedom the real allocator has that the simulated one cannot know is where a
*large-pool* block (> 1 MiB) lands: it hands out a whole cached or fresh block when the
remainder would be 1 MiB or less, so each large block may count up to 1 MiB more or less than
predicted. :meth:`StepPrediction.tolerance` is that bound (1 MiB per large block live at once
in the category): a property of the trace, never of a measurement. Small-pool blocks are exact.

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle import nn, optim
    >>> d = ndl.cpu_numpy()
    >>> def build():
    ...     np.random.seed(0)
    ...     m = nn.Sequential(nn.Linear(8, 16, device=d), nn.ReLU(), nn.Linear(16, 2, device=d))
    ...     x = ndl.Tensor(np.ones((4, 8)), device=d, requires_grad=False)
    ...     y = ndl.Tensor(np.zeros(4), device=d, requires_grad=False)
    ...     return m, nn.SoftmaxLoss(), optim.SGD(m.parameters()), x, y
    >>> p = predict_step(build, d)
    >>> [(s.shape, s.producer, s.block) for s in p.saved][:2]
    [((4, 16), 'ReLU', 512), ((4, 2), 'FusedLinear', 512)]
    >>> p.held("activation"), p.peak("activation"), p.peak("workspace"), p.tolerance("activation")
    (2560, 3584, 0, 0)
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass, field

import numpy as np

from needle import random as _random

from . import timeline as _timeline
from ._errors import MemoryArgumentError
from .caching_allocator import MIN_LARGE_SPLIT, SMALL_LIMIT, Block, CachingAllocator
from .kernel_scratch import scratch_model
from .observers import add_observer
from .reconcile import declared_saved
from .trace import TracedGraph, _Tracer

__all__ = ["ShapeArray", "ShapeBackend", "SavedBuffer", "StepPrediction", "predict_step",
           "run_step"]

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8,
             "bool": 1, "uint8": 1}


def _no_memory(nbytes: int):
    return None  # a segment of the simulated allocator: sizes only


class ShapeArray:
    """A backend buffer that has a size, a dtype and a block of a simulated allocator, and no
    bytes. ``shape`` is the shape of the NDArray it was made for (None until known)."""

    __slots__ = ("size", "dtype", "itemsize", "shape", "_block", "__weakref__")

    def __init__(self, alloc: CachingAllocator, size: int, dtype: str, min_elements: int):
        self.size, self.dtype = int(size), str(dtype)
        self.itemsize = _ITEMSIZE.get(self.dtype) or np.dtype(self.dtype).itemsize
        self.shape: tuple | None = None
        self._block: Block | None = alloc.allocate(max(self.size, min_elements) * self.itemsize)

    def ptr(self) -> int:
        block = self._block
        return 0 if block is None else (block.segment.id << 40) + block.offset

    def forget(self) -> None:
        """Release the block now (a trace told to drop this buffer); later use is harmless."""
        block, self._block = self._block, None
        if block is not None:
            block.release()

    def __del__(self):
        block = self._block
        if block is not None:
            try:
                block.release()
            except Exception:  # noqa: BLE001 - interpreter shutdown may have torn L2 down
                pass


class _Simulated(CachingAllocator):
    """The simulated allocator: its events go to the trace's tracer alone (a ``record()`` of
    every device, open around the prediction, does not see them)."""

    sink = None

    def _emit(self, kind, block, new_segment, prev_category=None) -> None:
        if self.sink is not None:
            self.sink.append(_timeline.Event(
                kind=kind, device=self.name, nbytes=block.size, requested=block.requested,
                category=block.category, op=None, block=block.id, new_segment=new_segment,
                allocated_bytes=self._all.current, prev_category=prev_category))


def _shape_only(args, depth: int = 0) -> bool:
    for a in args:
        if isinstance(a, ShapeArray):
            return True
        if depth < 3 and isinstance(a, (list, tuple)) and _shape_only(a, depth + 1):
            return True
    return False


class ShapeBackend:
    """Stands in for a backend module (``intercept(device, ShapeBackend(...))``): buffers are
    :class:`ShapeArray` s of ``alloc``; a function of the module called on shape-only buffers
    runs ``scratch.call`` instead of its kernel (``to_numpy`` returns zeros); called on real
    buffers only, or on none (a query such as ``get_num_threads``), it is the module's own."""

    def __init__(self, mod, alloc: CachingAllocator, scratch, min_elements: int = 0):
        self._mod, self._alloc, self._scratch = mod, alloc, scratch
        self._min = min_elements
        self.arrays: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def Array(self, size, dtype="float32") -> ShapeArray:  # noqa: N802 - the protocol's name
        arr = ShapeArray(self._alloc, size, dtype, self._min)
        self.arrays[id(arr)] = arr
        return arr

    new_array = Array

    def __getattr__(self, name):
        real = getattr(self._mod, name)  # absent here exactly when absent there
        if (not callable(real) or isinstance(real, type) or name.startswith("_")
                or getattr(real, "query", False)):
            return real
        scratch, alloc = self._scratch, self._alloc

        def kernel(*args, **kwargs):
            if not _shape_only(args) and not _shape_only(tuple(kwargs.values())):
                return real(*args, **kwargs)
            if name == "to_numpy":  # (a, shape, strides, offset): a host copy of no values
                return np.zeros(tuple(args[1]), dtype=args[0].dtype)
            if scratch is not None:
                scratch.call(name, args, alloc)
            return None

        kernel.__name__ = name
        self.__dict__[name] = kernel
        return kernel


def run_step(model, loss_fn, optimizer, x, y, at_forward=None) -> float:
    """One training step, the same for a measurement and a shape-only prediction: forward,
    ``at_forward(loss)``, backward, the optimizer's step; returns the loss."""
    loss = loss_fn(model(x), y)
    if at_forward is not None:
        at_forward(loss)
    loss.backward()
    optimizer.step()
    value = float(loss.numpy())
    del loss
    return value


@dataclass(frozen=True)
class SavedBuffer:
    """A buffer the graph holds for backward at the end of the forward pass: its shape and
    dtype, requested and block bytes, the op that made it and its lifetime in trace steps
    (``freed`` None: still alive when the step ended)."""

    shape: tuple | None
    dtype: str
    nbytes: int
    block: int
    producer: str | None
    created: int
    freed: int | None


@dataclass
class StepPrediction:
    """What :func:`predict_step` found: the simulated allocator's statistics at the start, at
    the end of the forward pass and at the end of the step (``stats()`` dicts), the traced
    buffer graph, the saved buffers, each kernel's scratch growth ``(kernel, thread, slot,
    bytes)``, kernels whose scratch no model describes, and per category the most large-pool
    blocks live at once."""

    device: str
    start: dict
    forward: dict
    end: dict
    graph: TracedGraph
    saved: tuple
    scratch: tuple
    unmodelled: tuple
    large_blocks: dict = field(default_factory=dict)
    scratch_modelled: bool = True

    def held(self, category: str = "activation") -> int:
        """Block bytes of ``category`` held at the end of the forward pass, above the start."""
        return (self.forward["by_category"][category]["current"]
                - self.start["by_category"][category]["current"])

    def peak(self, category: str) -> int:
        """Peak block bytes of ``category`` during the step, above its bytes at the start
        (workspace starts empty: no kernel scratch exists in the trace before the step)."""
        return (self.end["by_category"][category]["peak"]
                - self.start["by_category"][category]["current"])

    def tolerance(self, category: str) -> int:
        """How far the device may differ from :meth:`peak` through allocator rounding alone:
        1 MiB per large-pool block of ``category`` live at once (0 with small blocks only)."""
        return MIN_LARGE_SPLIT * self.large_blocks.get(category, 0)

    def __str__(self) -> str:
        counts = {k: sum(t.kind == k for t in self.graph.tensors)
                  for k in ("intermediate", "output")}
        lines = [f"shape-only trace of the step on {self.device} (no kernel ran): "
                 f"{len(self.graph.ops)} ops and backward steps, {counts['intermediate']} "
                 f"buffers made and freed, "
                 f"{counts['output']} left alive (gradients, optimizer state, ...)",
                 f"  saved for backward at the end of forward: {len(self.saved)} buffers, "
                 f"{sum(s.block for s in self.saved):,} B in blocks; the largest:"]
        for s in sorted(self.saved, key=lambda s: -s.block)[:4]:
            life = "to the end" if s.freed is None else f"to step {s.freed}"
            lines.append(f"    {s.shape} {s.dtype} {s.block:,} B by {s.producer}, from step "
                         f"{s.created} {life}")
        grown: dict = {}
        for kernel, thread, slot, nbytes in self.scratch:
            grown[(thread, slot)] = (kernel, nbytes)
        scratch = ", ".join(f"thread {t} {slot.upper()} {n:,} B ({k})"
                            for (t, slot), (k, n) in sorted(grown.items()))
        lines.append("  kernel scratch kept: " + (scratch or "none") + (
            "" if self.scratch_modelled else " (no scratch model for this device)"))
        large = ", ".join(f"{c} {n}" for c, n in sorted(self.large_blocks.items()))
        lines.append("  rounding tolerance: 1 MiB per large-pool block live at once ("
                     + (large or "none: every block is in the small pool, predictions exact")
                     + ")")
        return "\n".join(lines)


class _ShapeTracer(_Tracer):
    """The trace's buffer graph without kernel scratch (kept apart, as on ``cpu``), counting
    large-pool blocks per category."""

    def __init__(self, alloc):
        super().__init__(alloc)
        self.large: dict = {}
        self.most: dict = {}

    def _large(self, category: str, delta: int) -> None:
        n = self.large[category] = self.large.get(category, 0) + delta
        self.most[category] = max(self.most.get(category, 0), n)

    def append(self, event) -> None:
        if event.nbytes > SMALL_LIMIT:
            if event.kind == "retag":
                self._large(event.prev_category, -1)
            self._large(event.category, -1 if event.kind == "free" else 1)
        if event.category != "workspace":
            super().append(event)


def _device(device):
    from needle.backend_ndarray import default_device, device_by_name

    if device is None:
        return default_device()
    return device_by_name(device) if isinstance(device, str) else device


def _built(build) -> tuple:
    built = build()
    if not isinstance(built, (tuple, list)) or len(built) != 5:
        raise MemoryArgumentError(
            f"predict_step: expected build() to return (model, loss_fn, optimizer, x, y), got "
            f"{type(built).__name__}"
            + (f" of {len(built)}" if isinstance(built, (tuple, list)) else ""))
    return tuple(built)


@contextlib.contextmanager
def _observed(tracer, sim: _Simulated):
    """``tracer`` sees ``sim``'s events and autograd's ops for the block."""
    sim.sink = tracer
    sink = _timeline.add_sink(tracer, frozenset([sim.name]))  # allocators emit while any is
    observing = add_observer(tracer)
    try:
        yield tracer
    finally:
        observing.remove()
        _timeline.remove_sink(sink)
        sim.sink = None


def predict_step(build, device, *, drop_saved: int = 0,
                 scratch_scale: dict | None = None) -> StepPrediction:
    """Trace one training step of what ``build()`` makes, on shapes alone.

    Args:
        build: ``build() -> (model, loss_fn, optimizer, x, y)`` on ``device``; called inside
            the trace, so everything it makes is shape-only (its random draws do not advance
            needle's or NumPy's generators outside).
        device: the device whose backend and allocator are predicted (``cpu``,
            ``cpu_numpy``; another device is traced without a scratch model).
        drop_saved, scratch_scale: for tests that plant a wrong prediction: forget that many
            saved buffers at the end of the forward pass; scale one kernel's scratch
            (``{"matmul_strided": 0.5}``).

    Raises:
        DeviceError: an unknown device name.
        MemoryArgumentError: ``build`` is not callable or does not return five things.
    """
    if not callable(build):
        raise MemoryArgumentError(f"predict_step: expected build, a callable returning "
                                  f"(model, loss_fn, optimizer, x, y), got {build!r}")
    from needle.backend_ndarray import ndarray as _nd
    from needle.backend_ndarray.devices import intercept

    device = _device(device)
    scratch = scratch_model(device)
    if scratch is not None and scratch_scale:
        scratch.scale = dict(scratch_scale)
    sim = _Simulated(f"shape-only {device.name}", segment_factory=_no_memory)
    backend = ShapeBackend(device.mod, sim, scratch, 1 if device.name == "cpu_numpy" else 0)
    tracer = _ShapeTracer(sim)
    found: dict = {}

    def shapes(array) -> None:  # L1's buffer observer: every new buffer with its NDArray
        if isinstance(array._handle, ShapeArray):
            array._handle.shape = array._shape
        elif previous is not None:
            previous(array)

    def at_forward(loss) -> None:
        keys, _, _ = declared_saved(loss, found["exclude"])
        arrays = [backend.arrays[k] for k in keys if k in backend.arrays]
        found["saved"] = [(_saved(a), tracer.live.get(a._block.id)) for a in arrays]
        for a in sorted(arrays, key=lambda a: -a._block.size)[:drop_saved]:
            a.forget()  # a planted error: the prediction forgets the largest saved buffers
        found["forward"] = sim.stats()

    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    previous = _nd.set_buffer_observer(shapes)
    try:
        with _random.fork_rng(), intercept(device, backend):
            model, loss_fn, optimizer, x, y = _built(build)
            found["exclude"] = [id(getattr(t.realize_cached_data(), "_handle", None))
                                for t in (*model.parameters(), x, y)]
            sim.reset_peak()
            start = sim.stats()
            with _observed(tracer, sim):
                run_step(model, loss_fn, optimizer, x, y, at_forward)
            end = sim.stats()
            graph = tracer.build(None, device)
            saved = tuple(sorted((_lifetime(s, b) for s, b in found.pop("saved")),
                                 key=lambda s: s.created))
            del model, loss_fn, optimizer, x, y
    finally:
        _nd.set_buffer_observer(previous)
        if gc_was_enabled:
            gc.enable()
    return StepPrediction(
        device.name, start, found["forward"], end, graph, saved,
        tuple(getattr(scratch, "log", ())), tuple(sorted(getattr(scratch, "unmodelled", ()))),
        dict(tracer.most), scratch is not None)


def _saved(array: ShapeArray) -> SavedBuffer:
    block = array._block
    return SavedBuffer(array.shape, array.dtype, array.size * array.itemsize,
                       0 if block is None else block.size, None, 0, None)


def _lifetime(saved: SavedBuffer, buf) -> SavedBuffer:
    """``saved`` with the producer and lifetime its trace buffer had by the end of the step."""
    if buf is None:
        return saved
    return SavedBuffer(saved.shape, saved.dtype, saved.nbytes, saved.block, buf.producer,
                       buf.def_index, buf.last if buf.freed else None)
