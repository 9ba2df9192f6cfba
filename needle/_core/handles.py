"""One way to undo a registration: every ``register_*`` / ``add_*`` call returns a handle.

Tensor hooks, random-draw observers, memory observers, category and op-name listeners and
device hooks all keep their callbacks in a :class:`Callbacks` (or, on the autograd hot path, a
plain dict) and hand back a :class:`RemovableHandle`; ``handle.remove()`` unregisters, and a
handle is also a context manager that removes on exit.

Example:
    >>> seen = []
    >>> listeners = Callbacks()
    >>> h = listeners.add(seen.append)
    >>> for fn in listeners:
    ...     fn("first")
    >>> h.remove()
    >>> for fn in listeners:
    ...     fn("second")
    >>> seen
    ['first']
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable, Iterator

__all__ = ["RemovableHandle", "Callbacks"]

_IDS = itertools.count()


class RemovableHandle:
    """Returned by a registration; :meth:`remove` unregisters the callback.

    ``registry`` is anything with ``pop(key, default)`` (a dict or a :class:`Callbacks`).
    """

    __slots__ = ("_registry", "id")

    def __init__(self, registry):
        self._registry = registry
        self.id = next(_IDS)

    def remove(self) -> None:
        """Unregister the callback; removing twice is harmless."""
        self._registry.pop(self.id, None)

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"RemovableHandle(id={self.id})"


class Callbacks:
    """An ordered collection of callbacks: :meth:`add` returns a :class:`RemovableHandle`.

    Iterating gives a snapshot, so a callback may remove itself (or add others) while the
    collection is being walked. ``on_change()`` runs after every add and remove (the memory
    observers re-publish the active set there).
    """

    def __init__(self, on_change: Callable[[], None] | None = None):
        self._fns: dict[int, Callable] = {}
        self._on_change = on_change
        self._lock = threading.Lock()

    def add(self, fn: Callable) -> RemovableHandle:
        """Register ``fn``; returns the handle that removes it."""
        handle = RemovableHandle(self)
        with self._lock:
            self._fns[handle.id] = fn
            if self._on_change is not None:
                self._on_change()
        return handle

    def pop(self, key: int, default=None):
        """Remove the callback registered under ``key`` (what ``RemovableHandle.remove`` calls)."""
        with self._lock:
            fn = self._fns.pop(key, default)
            if self._on_change is not None:
                self._on_change()
        return fn

    def __iter__(self) -> Iterator[Callable]:
        return iter(list(self._fns.values()))

    def __len__(self) -> int:
        return len(self._fns)

    def __bool__(self) -> bool:
        return bool(self._fns)
