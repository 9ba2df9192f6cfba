"""Observer slots through which L2 watches the autograd layer (L3) without importing it.

L3 modules register a setter at import (:func:`bind`); while at least one observer is active
(:func:`add_observer`, which returns a handle whose ``remove()`` stops it:
:func:`needle.memory.record` names ops, :func:`needle.memory.trace` builds a graph), every setter
receives it, else ``None``. L3 tests one module global per op,
so observation costs nothing when it is off.

The protocol L3 calls on the observer it was given (all methods optional to implement, see
:class:`Observer`):

* ``op_begin(op, inputs) -> token`` / ``op_end(token, node)``: around ``op.compute`` in the
  op dispatch (``node`` is None when compute raised);
* ``backward_begin()`` / ``backward_end()``: around one ``backward`` call;
* ``node_begin(node) -> token`` / ``node_end(token)``: around one node's backward step
  (gradient summation, hooks and ``op.gradient``);
* ``phase_begin(name, label) -> token`` / ``phase_end(token)``: around a phase of a training
  step that is not autograd's own (L5 optimizers mark ``"optimizer"``, labelled
  ``"Adam.step"``, with :func:`phase`).

Example:
    >>> seen = []
    >>> class Names(Observer):
    ...     def op_begin(self, op, inputs):
    ...         seen.append(type(op).__name__)
    >>> handle = add_observer(Names())
    >>> import needle as ndl
    >>> _ = ndl.Tensor([1.0]) * 2
    >>> handle.remove(); seen
    ['MulScalar']
"""
from __future__ import annotations

from typing import Callable

from .._core.handles import Callbacks, RemovableHandle

__all__ = ["Observer", "bind", "add_observer", "active_observer", "phase"]

_CURRENT: "Observer | None" = None


class Observer:
    """Base class: every callback does nothing (subclasses override what they need)."""

    def op_begin(self, op, inputs):
        return None

    def op_end(self, token, node) -> None:
        pass

    def backward_begin(self) -> None:
        pass

    def backward_end(self) -> None:
        pass

    def node_begin(self, node):
        return None

    def node_end(self, token) -> None:
        pass

    def phase_begin(self, name: str, label: str | None = None):
        return None

    def phase_end(self, token) -> None:
        pass


class _Many(Observer):
    """Several observers behind one slot (e.g. a trace inside a record block)."""

    def __init__(self, observers):
        self.observers = tuple(observers)

    def op_begin(self, op, inputs):
        return [o.op_begin(op, inputs) for o in self.observers]

    def op_end(self, token, node) -> None:
        for o, t in zip(reversed(self.observers), reversed(token), strict=True):
            o.op_end(t, node)

    def backward_begin(self) -> None:
        for o in self.observers:
            o.backward_begin()

    def backward_end(self) -> None:
        for o in reversed(self.observers):
            o.backward_end()

    def node_begin(self, node):
        return [o.node_begin(node) for o in self.observers]

    def node_end(self, token) -> None:
        for o, t in zip(reversed(self.observers), reversed(token), strict=True):
            o.node_end(t)

    def phase_begin(self, name: str, label: str | None = None):
        return [o.phase_begin(name, label) for o in self.observers]

    def phase_end(self, token) -> None:
        for o, t in zip(reversed(self.observers), reversed(token), strict=True):
            o.phase_end(t)


def _publish() -> None:
    """Hand the active observer (one, several behind one slot, or None) to every setter."""
    global _CURRENT
    active = list(_OBSERVERS)
    if not active:
        _CURRENT = None
    elif len(active) == 1:
        _CURRENT = active[0]
    else:
        _CURRENT = _Many(active)
    for setter in _SETTERS:
        setter(_CURRENT)


_SETTERS = Callbacks()
_OBSERVERS = Callbacks(on_change=_publish)


def bind(setter: Callable[[object], None]) -> RemovableHandle:
    """Register ``setter(observer_or_None)`` (called now and whenever the observers change)."""
    handle = _SETTERS.add(setter)
    setter(_CURRENT)
    return handle


def add_observer(observer: Observer) -> RemovableHandle:
    """Start delivering L3 events to ``observer``; ``remove()`` on the handle stops it."""
    return _OBSERVERS.add(observer)


def active_observer() -> Observer | None:
    """The observer L3 currently sees (``None`` when observation is off)."""
    return _CURRENT


class phase:  # noqa: N801 - a context manager, named like one
    """Mark a phase (``with phase("optimizer", "SGD.step"): ...``) for whoever observes; free
    otherwise. ``label`` names what runs (it stands in for an op name in timelines).

    Example:
        >>> with phase("optimizer"):
        ...     pass
    """

    __slots__ = ("name", "label", "observer", "token")

    def __init__(self, name: str, label: str | None = None):
        self.name = name
        self.label = label

    def __enter__(self):
        self.observer = _CURRENT
        if self.observer is not None:
            self.token = self.observer.phase_begin(self.name, self.label)
        return self

    def __exit__(self, *exc) -> None:
        if self.observer is not None:
            self.observer.phase_end(self.token)
