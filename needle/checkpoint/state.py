"""Module state around a recomputation: replay from the state the first forward saw, then put
back the state that was current, so stateful layers act once per step.

BatchNorm in training mode updates ``running_mean``/``running_var`` on every forward; a counter
module bumps an int. Recomputing such a region would apply the update twice and could even
compute different outputs (the state has moved on). The region therefore snapshots, at its first
forward, the Tensor attributes (buffers and parameters, by their arrays) and plain scalar
attributes of every module it can see (by reference: nothing is copied), and around the
recomputation it (1) saves the current values, (2) restores the snapshot, (3) recomputes,
(4) restores the saved current values.

Which modules are seen: ``fn`` itself when it is a Module, the Module behind a bound method, Modules
held in ``fn``'s closure or ``functools.partial`` arguments (also inside lists, tuples, dicts),
and Module arguments; each with all its sub-modules. State kept anywhere else (globals, other
objects, containers inside modules) is not rolled back: guard it with
:func:`needle.checkpoint.is_recomputing` or pass ``verify=True`` to detect the divergence.

Example:
    >>> from needle import nn
    >>> bn = nn.BatchNorm1d(2); state = ModuleState(modules_of(bn, ()))
    >>> state.capture_before(); len(state.modules)
    1
"""
from __future__ import annotations

import contextlib
import functools

__all__ = ["ModuleState", "modules_of"]

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _is_module(value) -> bool:
    # Duck-typed so that this package does not import needle.nn (a sibling in layer L5).
    return callable(getattr(value, "_children", None)) and hasattr(value, "training")


def _collect(value, out: list, seen: set, depth: int = 0) -> None:
    if depth > 3:
        return
    if _is_module(value):
        for m in [value] + value._children():
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, out, seen, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, out, seen, depth + 1)


def modules_of(fn, args) -> list:
    """The Modules a region can see through ``fn`` and its arguments (see the module doc)."""
    out: list = []
    seen: set = set()
    targets = [fn, getattr(fn, "__self__", None)]
    if isinstance(fn, functools.partial):
        targets += [fn.func, list(fn.args), dict(fn.keywords)]
    for target in list(targets):
        closure = getattr(target, "__closure__", None) or ()
        for cell in closure:
            try:
                targets.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    targets += list(args)
    for target in targets:
        _collect(target, out, seen)
    return out


class ModuleState:
    """Snapshot and restore of the buffers and scalar attributes of some modules."""

    def __init__(self, modules: list):
        self.modules = modules
        self.before = None

    def _snapshot(self) -> list:
        from ..autograd import Tensor

        snap = []
        for m in self.modules:
            entries = []
            for key, value in m.__dict__.items():
                # parameters too: unchanged by a forward, so restoring them costs nothing, and
                # a recomputation then always sees the weights the first forward saw
                if isinstance(value, Tensor):
                    entries.append((key, value, value.cached_data))
                elif isinstance(value, _SCALARS):
                    entries.append((key, value, None))
            snap.append((m, entries))
        return snap

    def snapshot_arrays(self) -> list:
        """``(attribute name, array)`` of every Tensor attribute in the first forward's
        snapshot: the arrays a recomputation reads."""
        if not self.before:
            return []
        return [(key, data) for _, entries in self.before for key, _, data in entries
                if data is not None]

    @staticmethod
    def _restore(snap: list) -> None:
        from ..autograd import Tensor

        for m, entries in snap:
            for key, value, data in entries:
                m.__dict__[key] = value
                if isinstance(value, Tensor):
                    value.cached_data = data

    def capture_before(self) -> None:
        """Remember the state the first forward starts from."""
        if self.modules:
            self.before = self._snapshot()

    @contextlib.contextmanager
    def replay(self):
        """Inside: the state of the first forward; after: the state current before entering."""
        if not self.before:
            yield
            return
        current = self._snapshot()
        self._restore(self.before)
        try:
            yield
        finally:
            self._restore(current)
