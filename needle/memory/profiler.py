"""Profile memory: every allocation with the tensor, op, phase and Python line behind it.

``with needle.memory.profile() as prof: ...`` records, for every allocator event of every
device (or of ``device=``), what :func:`~needle.memory.record` records plus:

* the tensor: shape and dtype of the buffer (L1 tells the profiler about each new buffer);
* the op that was running (``MatMul``, or a backward step ``MatMul.gradient``), its position in
  op order, and the Python line that called the op (the first frame outside needle's
  autograd, ops, backend and memory code, e.g. ``nn_basic.py:66`` inside ``Linear.forward``)
  plus the first line outside needle (your script);
* the phase: ``forward`` (from the first op after a phase ended), ``backward`` (marked by the
  autograd engine), ``optimizer`` (marked by ``Optimizer.step``), else ``other``;
* the time since the block opened.

Buffers alive when the block opens are the baseline: their bytes, categories and (found through
the garbage collector) shapes and the ops that made them. Peaks are reset when the block opens.
``prof.report()`` and ``prof.save(DIR)`` turn the record into the report of
:mod:`needle.memory.profile_report`. The C++ allocator logs its events on its side; the profiler
collects them at every op boundary, so each event still gets the right op and phase.

Cost: a few microseconds per op and per allocation while the block is open (frames are walked
once per op), nothing otherwise. Recording is for one thread's training step; events of other
threads are recorded with the context of whichever thread collects them.

Example:
    >>> import numpy as np, needle as ndl
    >>> d = ndl.cpu_numpy()
    >>> x = ndl.Tensor(np.ones((64, 64)), device=d)
    >>> with profile(d) as prof:
    ...     (x * 2).sum().backward()
    >>> r = prof.report()["devices"]["cpu_numpy"]
    >>> r["phases"]["forward"]["peak_bytes"] > 0, r["peak"]["live"][0]["op"] is not None
    (True, True)
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import time

from . import oom as _oom
from . import timeline as _timeline
from .observers import Observer, add_observer
from .registry import _allocators_for, _device_name

__all__ = ["Profile", "profile", "Rec"]

_NEEDLE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Frames in these packages are needle's machinery, not "the line that called the op".
_MACHINERY = tuple(_NEEDLE + d + os.sep for d in ("autograd", "ops", "backend_ndarray",
                                                    "memory", "_core"))


class Rec:
    """One allocator event with its context (see the module docstring)."""

    __slots__ = ("index", "t", "device", "kind", "nbytes", "requested", "category",
                 "prev_category", "block", "allocated", "op", "op_index", "phase", "line",
                 "user_line", "shape", "dtype")
    index: int                 # position in the profile's records
    t: float                   # seconds since the profile started
    device: str
    kind: str                  # "alloc", "free", "retag", ...
    nbytes: int                # allocator block bytes
    requested: int             # bytes asked for (before rounding)
    category: str
    prev_category: str | None  # a retag's previous category
    block: int                 # allocator block id
    allocated: int             # the device's allocated bytes after the event
    op: str | None             # the innermost running op, if any
    op_index: int | None
    phase: str                 # "forward", "backward", "optimizer", "other" or yours
    line: str | None           # the op's call site
    user_line: str | None      # the first call site outside needle
    shape: tuple | None
    dtype: str | None

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class _Ctx(threading.local):
    def __init__(self) -> None:
        self.ops: list = []   # (op index, name, line, user line), innermost last
        self.phases: list = []  # phase names, innermost last
        self.forward = False  # an op ran since the last phase ended


def _short(path: str, cache: dict = {}) -> str:  # noqa: B006 - a deliberate per-process cache
    out = cache.get(path)
    if out is None:
        cwd = os.getcwd() + os.sep
        if path.startswith(_NEEDLE):
            out = "needle/" + path[len(_NEEDLE):]
        elif path.startswith(cwd):
            out = path[len(cwd):]
        else:
            out = os.path.basename(path)
        cache[path] = out
    return out


def call_sites(frame) -> tuple[str | None, str | None]:
    """(first frame outside needle's machinery, first frame outside needle) as ``file:line``."""
    line = user = None
    while frame is not None:
        name = frame.f_code.co_filename
        if line is None and not name.startswith(_MACHINERY):
            line = f"{_short(name)}:{frame.f_lineno}"
        if not name.startswith(_NEEDLE):
            user = f"{_short(name)}:{frame.f_lineno}"
            break
        frame = frame.f_back
    return line, user


class _CppSink:
    """Where a C++ adapter delivers drained events: the profiler, with the context of now."""

    def __init__(self, profile: "Profile"):
        self.profile = profile

    def append(self, event) -> None:
        self.profile._add(event)


class Profile(Observer):
    """A memory profile being recorded (``with``) or recorded (see the module docstring)."""

    def __init__(self, device=None):
        self.devices = None if device is None else frozenset([_device_name(device)])
        self.records: list[Rec] = []
        self.ops: list[tuple[str, int]] = []  # (name, index of the next record) in op order
        self.start_stats: dict = {}
        self.end_stats: dict = {}
        self.baseline: dict = {}  # device -> {block id: Rec-like dict of a live buffer}
        self.wall_s = 0.0
        self._ctx = _Ctx()
        self._last_alloc: dict = {}
        self._handles: list = []
        self._cpp: list = []
        self._active = False

    # ---- the block ----------------------------------------------------------------------
    def __enter__(self) -> "Profile":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        from needle.backend_ndarray import ndarray as _nd

        gc.collect()  # dead objects' buffers go now, not in the middle of the record
        allocs = [a for a in _allocators_for(None)
                  if self.devices is None or a.name in self.devices]
        self._allocs = allocs
        for alloc in allocs:
            alloc.reset_peak()
            self.start_stats[alloc.name] = alloc.stats()
            self.baseline[alloc.name] = self._baseline(alloc)
        names = frozenset(a.name for a in allocs)
        self._sink = _timeline.add_sink(self, names)
        sink = _CppSink(self)
        self._cpp = [(a, sink) for a in allocs if hasattr(a, "drain")]
        for alloc, s in self._cpp:
            alloc.begin_recording(s)
        self._observing = add_observer(self)
        self._prev_buffer_observer = _nd.set_buffer_observer(self._on_buffer)
        self._prev_origin = _oom._ORIGIN
        _oom.set_origin_source(self.origin)
        self._t0 = time.perf_counter()
        self._active = True

    def stop(self) -> None:
        from needle.backend_ndarray import ndarray as _nd

        if not self._active:
            return
        self._sync()
        self.wall_s = time.perf_counter() - self._t0
        self._active = False
        _nd.set_buffer_observer(self._prev_buffer_observer)
        _oom.set_origin_source(self._prev_origin)
        self._observing.remove()
        for alloc, sink in self._cpp:
            alloc.end_recording(sink)
        _timeline.remove_sink(self._sink)
        for alloc in self._allocs:
            self.end_stats[alloc.name] = alloc.stats()
        self._last_alloc.clear()

    def _baseline(self, alloc) -> dict:
        if not hasattr(alloc, "live_blocks"):
            return {}
        known = _oom.live_tensors(alloc.name)
        out = {}
        for block, size, requested, category in alloc.live_blocks():
            meta = known.get(block, {})
            out[block] = {"block": block, "nbytes": size, "requested": requested,
                          "category": category, "shape": meta.get("shape"),
                          "dtype": meta.get("dtype"), "op": meta.get("op"), "phase": "before",
                          "line": None, "user_line": None, "index": -1, "t": 0.0}
        return out

    # ---- events ---------------------------------------------------------------------------
    def append(self, event) -> None:
        """Timeline sink: an event of a Python allocator, as it happens."""
        self._add(event)

    def _add(self, event) -> None:
        ctx = self._ctx
        rec = Rec()
        rec.index = len(self.records)
        rec.t = time.perf_counter() - self._t0
        rec.device, rec.kind, rec.nbytes = event.device, event.kind, event.nbytes
        rec.requested, rec.category = event.requested, event.category
        rec.prev_category, rec.block = event.prev_category, event.block
        rec.allocated = event.allocated_bytes
        if ctx.ops:
            rec.op_index, rec.op, rec.line, rec.user_line = ctx.ops[-1]
        else:
            rec.op_index = rec.op = rec.line = rec.user_line = None
        rec.phase = ctx.phases[-1] if ctx.phases else ("forward" if ctx.forward else "other")
        rec.shape = rec.dtype = None
        self.records.append(rec)
        if rec.kind == "alloc":
            self._last_alloc[(rec.device, rec.block)] = rec

    def _sync(self) -> None:
        for alloc, _ in self._cpp:
            alloc.drain()

    def _on_buffer(self, array) -> None:
        """L1's buffer observer: the shape and dtype of the buffer just allocated."""
        handle = array._handle
        if getattr(handle, "block_id", None) is not None:
            self._sync()  # a C++ buffer: its event is in the C++ log until drained
        key = (array._device.name, _oom.block_id(handle))
        rec = self._last_alloc.get(key)
        if rec is not None and rec.shape is None:
            rec.shape, rec.dtype = tuple(array._shape), str(handle.dtype)
            if rec.line is None:
                rec.line, rec.user_line = call_sites(sys._getframe(1))
        if self._prev_buffer_observer is not None:
            self._prev_buffer_observer(array)

    def origin(self, device: str, block: int) -> dict | None:
        """What made the live buffer ``block`` of ``device`` (for out-of-memory reports)."""
        self._sync()
        rec = self._last_alloc.get((device, block))
        if rec is None:
            return self.baseline.get(device, {}).get(block)
        return {"op": rec.op, "line": rec.line or rec.user_line, "shape": rec.shape,
                "dtype": rec.dtype}

    # ---- what L3 and L5 report (memory.observers protocol) ------------------------------
    def _push_op(self, name: str, line, user) -> int:
        self._sync()
        ctx = self._ctx
        index = len(self.ops)
        self.ops.append((name, len(self.records)))
        ctx.ops.append((index, name, line, user))
        if not ctx.phases:
            ctx.forward = True
        return index

    def _pop_op(self) -> None:
        self._sync()
        self._ctx.ops.pop()

    def op_begin(self, op, inputs):
        line, user = call_sites(sys._getframe(2))
        return self._push_op(type(op).__name__, line, user)

    def op_end(self, token, node) -> None:
        self._pop_op()

    def node_begin(self, node):
        ctx = self._ctx
        user = ctx.ops[-1][3] if ctx.ops else getattr(ctx, "backward_line", None)
        return self._push_op(type(node.op).__name__ + ".gradient", None, user)

    def node_end(self, token) -> None:
        self._pop_op()

    def backward_begin(self) -> None:
        self._phase_begin("backward")

    def backward_end(self) -> None:
        self._phase_end()

    def phase_begin(self, name: str, label: str | None = None):
        self._phase_begin(name)
        if label is None:
            return False
        # what runs in the phase stands in for an op: allocations outside ops get its name
        self._push_op(label, None, self._ctx.backward_line)
        return True

    def phase_end(self, token) -> None:
        if token:
            self._pop_op()
        self._phase_end()

    def _phase_begin(self, name: str) -> None:
        self._sync()
        ctx = self._ctx
        if not ctx.phases:
            ctx.backward_line = call_sites(sys._getframe(1))[1]
        ctx.phases.append(name)

    def _phase_end(self) -> None:
        self._sync()
        ctx = self._ctx
        ctx.phases.pop()
        if not ctx.phases:
            ctx.forward = False

    # ---- results ------------------------------------------------------------------------
    def report(self) -> dict:
        """The report as a JSON-ready dict (see :mod:`needle.memory.profile_report`)."""
        from .profile_report import build_report

        return build_report(self)

    def save(self, directory, *, html: bool = True, title: str | None = None,
             x_axis: str = "event") -> dict:
        """Write ``memory.json``, ``memory.png`` (and ``memory.html``) into ``directory``;
        returns their paths by name. ``x_axis``: the plot's x, ``"event"`` (allocator events
        in op order) or ``"time"`` (seconds since the profile opened)."""
        from .profile_report import save_report

        return save_report(self, directory, html=html, title=title, x_axis=x_axis)


def profile(device=None) -> Profile:
    """A :class:`Profile` to use as ``with needle.memory.profile() as prof:``.

    Args:
        device: a device or name to watch (default: every device with an allocator).

    Example:
        >>> import needle as ndl
        >>> with profile("cpu_numpy") as prof:
        ...     pass
        >>> prof.report()["devices"]["cpu_numpy"]["events"]
        0
    """
    return Profile(device)
