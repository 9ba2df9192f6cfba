"""Adapter between ``needle.memory`` and the C++ allocator of the ``cpu`` backend.

The C++ backend owns its allocator (``src/allocator.cc``); L2 only reads it. The adapter
needs these functions in the pybind module ``ndarray_backend_cpu`` (:data:`REQUIRED`):

* ``allocator_stats() -> dict``: the fields of :meth:`CachingAllocator.stats` (docs/memory.md),
  ``by_category`` keyed by the category names (``categories.CATEGORIES``);
* ``allocator_reset_peak() -> None`` and ``allocator_empty_cache() -> int`` (bytes returned);
* ``allocator_retag(array: Array, category: str) -> None``: move a live buffer's bytes;
* ``allocator_set_category_resolver(fn) -> None``: C++ calls ``fn(hint)`` (``hint`` is
  ``None`` or ``"workspace"``) with the GIL held when it allocates an ``Array``, and uses the
  returned name; ``fn`` is :func:`needle.memory.categories.resolve`, so user scopes, framework
  scopes and the per-op ``activation`` default all apply. Kernel workspaces allocated without
  the GIL use ``"workspace"`` directly.
* optional, preferred when present: ``allocator_set_category_state(state) -> previous``: C++
  resolves as ``resolve`` does by reading the fields ``user_top``, ``framework_top`` and
  ``op_category`` of ``state`` (:func:`categories.thread_state`, a ``threading.local``)
  itself, so an allocation costs no call into Python.

Until the module has them, :func:`make_adapter` explains what is missing and
``stats(cpu())`` raises :class:`~needle._core.errors.BackendUnavailable` instead of reporting
zeros.

Example:
    >>> missing_api(object())[:2]
    ['allocator_stats', 'allocator_reset_peak']
"""
from __future__ import annotations

from needle._core.errors import BackendUnavailable

from . import categories, timeline

__all__ = ["REQUIRED", "CppAllocatorAdapter", "missing_api", "make_adapter"]

REQUIRED = ("allocator_stats", "allocator_reset_peak", "allocator_empty_cache",
            "allocator_retag", "allocator_set_category_resolver")


def missing_api(mod) -> list[str]:
    """Names of :data:`REQUIRED` that ``mod`` lacks."""
    return [name for name in REQUIRED if not hasattr(mod, name)]


class CppAllocatorAdapter:
    """The allocator protocol of docs/memory.md over the C++ module's functions."""

    def __init__(self, mod, name: str = "cpu"):
        self.mod = mod
        self.name = name
        self._was_recording = False
        self._listeners: list = []
        if hasattr(mod, "allocator_set_category_state"):
            # C++ reads the thread-local fields itself: no Python call per allocation
            mod.allocator_set_category_state(categories.thread_state())
        else:
            mod.allocator_set_category_resolver(categories.resolve)
        if hasattr(mod, "allocator_set_op"):
            timeline.add_op_listener(mod.allocator_set_op)
        if hasattr(mod, "allocator_set_oom_handler"):
            from .oom import out_of_memory_error

            mod.allocator_set_oom_handler(out_of_memory_error)

    def _need(self, name: str):
        fn = getattr(self.mod, name, None)
        if fn is None:
            raise BackendUnavailable(
                f"memory: the C++ allocator of {self.name}() lacks {name}, expected a build of "
                f"ndarray_backend_cpu from this tree, got a stale one (pip install -e .)")
        return fn

    def set_limit(self, nbytes: int | None) -> int | None:
        return self._need("allocator_set_limit")(nbytes)

    @property
    def limit(self) -> int | None:
        fn = getattr(self.mod, "allocator_limit", None)
        return fn() if fn is not None else None

    def largest_free_block(self) -> int:
        return int(self._need("allocator_largest_free_block")())

    def live_blocks(self) -> list:
        return [tuple(t) for t in self._need("allocator_live_blocks")()]

    # ---- the event log: C++ keeps it; listeners get it when someone drains ----------------
    def begin_recording(self, sink=None) -> None:
        """Deliver the C++ events from now on to ``sink.append`` (each listener gets every
        event once, when :meth:`drain` runs: at :meth:`end_recording` or when a profiler
        syncs). ``sink=None`` keeps them for :meth:`end_recording`'s return value."""
        if not hasattr(self.mod, "allocator_record"):
            return
        self.drain()  # what happened before belongs to the listeners already there
        if not self._listeners:
            self.mod.allocator_events(True)  # drop whatever an earlier log left behind
            self._was_recording = bool(self.mod.allocator_record(True))
        self._listeners.append(sink if sink is not None else _Collect())

    def end_recording(self, sink=None) -> list:
        """Stop delivering to ``sink`` (None: the last listener added without a sink) and
        return what it collected when it had no sink of its own."""
        if not hasattr(self.mod, "allocator_record"):
            return []
        self.drain()
        if sink is None:
            sink = next((s for s in reversed(self._listeners) if isinstance(s, _Collect)), None)
        # by identity: two collected lists with the same events compare equal
        self._listeners = [s for s in self._listeners if s is not sink]
        if not self._listeners:
            self.mod.allocator_record(self._was_recording)
        return list(sink) if isinstance(sink, _Collect) else []

    def drain(self) -> None:
        """Hand the events logged since the last drain to every listener, oldest first."""
        if not self._listeners:
            return
        events = [timeline.Event(*t) for t in self.mod.allocator_events(True)]
        for sink in list(self._listeners):
            for event in events:
                sink.append(event)

    def stats(self) -> dict:
        out = dict(self.mod.allocator_stats())
        out["device"] = self.name
        by_cat = out.get("by_category", {})
        out["by_category"] = {c: dict(by_cat.get(c, {"current": 0, "peak": 0,
                                                         "current_requested": 0,
                                                         "peak_requested": 0}))
                              for c in categories.CATEGORIES}
        return out

    def reset_peak(self) -> None:
        self.mod.allocator_reset_peak()

    def empty_cache(self) -> int:
        return int(self.mod.allocator_empty_cache())

    def retag(self, handle, category: str) -> None:
        categories.check_category(category, "retag")
        if isinstance(handle, self.mod.Array):
            self.mod.allocator_retag(handle, categories.resolve(category))


class _Collect(list):
    """Events kept for :meth:`CppAllocatorAdapter.end_recording` (a ``record()`` block)."""


def make_adapter(mod, name: str = "cpu") -> CppAllocatorAdapter:
    """An adapter over ``mod``.

    Raises:
        BackendUnavailable: ``mod`` is missing (backend not built) or lacks statistics.
    """
    if mod is None:
        raise BackendUnavailable(
            f"memory: {name}() backend is not available, expected a built "
            f"ndarray_backend_cpu module, got none")
    missing = missing_api(mod)
    if missing:
        raise BackendUnavailable(
            f"memory: the C++ allocator of {name}() exposes no statistics yet, expected "
            f"ndarray_backend_cpu to define {list(REQUIRED)}, got a module without "
            f"{missing}; use device cpu_numpy() for memory measurements")
    return CppAllocatorAdapter(mod, name)
