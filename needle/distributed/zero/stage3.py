"""ZeRO stage 3: gather a module's weights around its forward and its backward, free them
after, and start the next module's gather while the current one computes.

A *unit* is a module that owns parameters directly (``Linear``, ``BatchNorm1d``, ...). Its
``forward`` is wrapped: gather (or wait for the prefetched gather), start the next unit's
gather, run, put a hook on the outputs, free. The output hook fires when the output's
gradient is complete, i.e. right before the unit's own backward steps read its weights: it
gathers them again (prefetching the unit that ran before it in the forward). When every
parameter of the unit has its final gradient (post-accumulate hooks) the weights are freed.
The forward order of the units is recorded in the first forward and used for prefetching.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from needle.autograd import Tensor

from ..collectives import all_gather_v
from ..flat_layout import FlatLayout
from .shards import Entry, mine, new_flat, pack_mine, to_device, unpack_all


class _Unit:
    """A module's parameters: one gather per dtype (a flat buffer holds one dtype)."""

    def __init__(self, module: Any, entries: list[Entry], world_size: int):
        self.module, self.entries = module, entries
        dtypes = sorted({e.dtype for e in entries})
        self.groups = [[e for e in entries if e.dtype == d] for d in dtypes]
        self.layouts = [FlatLayout([e.size for e in g], world_size) for g in self.groups]
        self.state = "sharded"  # -> "pending" (gathers in flight) -> "materialized"
        self.works: list = []
        self.flats: list[np.ndarray] = []
        self.grads_left = 0
        self.original_forward: Any = None


def _direct_parameters(module: Any) -> list[int]:
    """ids of the Parameters a module holds itself (through lists and dicts, not through
    sub-modules)."""
    from needle.nn import Module, Parameter

    found: list[int] = []

    def visit(value: Any) -> None:
        if isinstance(value, Parameter):
            found.append(id(value))
        elif isinstance(value, Module):
            return
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for v in module.__dict__.values():
        visit(v)
    return found


def discover_units(module: Any, entries: list[Entry], world_size: int) -> list[_Unit]:
    """One unit per module that owns parameters directly, in ``parameters()`` order of their
    first parameter; a parameter belongs to the first module that owns it."""
    by_id = {id(e.param): e for e in entries}
    taken: set[int] = set()
    units = []
    for m in [module, *module._children()]:
        mine = [by_id[i] for i in _direct_parameters(m) if i in by_id and i not in taken]
        if mine:
            taken.update(id(e.param) for e in mine)
            units.append(_Unit(m, sorted(mine, key=lambda e: e.index), world_size))
    left = [e for e in entries if id(e.param) not in taken]
    if left:  # parameters no module owns directly: gather them with the root
        units.append(_Unit(module, left, world_size))
    return units


class GatherUnits:
    """The stage-3 machinery of one :class:`ZeroDataParallel`."""

    def __init__(self, zero: Any, prefetch: bool):
        self.zero, self.prefetch = zero, prefetch
        self.units = discover_units(zero.module, zero.entries, zero.world_size)
        self.unit_of = {id(e): u for u in self.units for e in u.entries}
        self.order: list[_Unit] = []
        self.gathers = 0  # all-gathers issued (each is one unit's weights)

    # ----- wiring ----------------------------------------------------------------------------
    def attach(self) -> None:
        for unit in self.units:
            unit.original_forward = unit.module.forward
            unit.module.forward = functools.partial(self._forward, unit)

    def detach(self) -> None:
        for unit in self.units:
            if unit.original_forward is not None:
                unit.module.__dict__.pop("forward", None)
                unit.original_forward = None

    # ----- gather / free ---------------------------------------------------------------------
    def _start(self, unit: _Unit) -> None:
        if unit.state != "sharded":
            return
        zero = self.zero
        for group, layout in zip(unit.groups, unit.layouts, strict=True):
            flat = new_flat(layout.numel, group[0].dtype, zero.sync.device)
            pack_mine(layout, mine(group, group[0].dtype, zero.sync.device), zero.rank, flat)
            unit.flats.append(flat)
            unit.works.append(all_gather_v(flat, layout.bounds, zero.comm, async_op=True))
            self.gathers += 1
        unit.state = "pending"

    def materialize(self, unit: _Unit) -> None:
        if unit.state == "materialized":
            return
        self._start(unit)
        for group, layout, flat, work in zip(unit.groups, unit.layouts, unit.flats,
                                             unit.works, strict=True):
            work.wait()
            for e, full in zip(group, unpack_all(layout, flat), strict=True):
                e.param.cached_data = to_device(full, e, "weight", e.shape)
        unit.flats, unit.works, unit.state = [], [], "materialized"
        unit.grads_left = len(unit.entries)

    def release(self, unit: _Unit) -> None:
        if unit.state == "pending":  # a prefetch nobody used: let it finish, drop it
            for work in unit.works:
                work.wait()
            unit.flats, unit.works = [], []
        for e in unit.entries:
            e.release()
        unit.state = "sharded"

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    def materialize_all(self) -> None:
        for unit in self.order or self.units:
            self.materialize(unit)
        for unit in self.units:
            self.materialize(unit)

    def gather_all_host(self) -> list[np.ndarray]:
        self.materialize_all()
        try:
            return [e.param.numpy() for e in self.zero.entries]
        finally:
            self.release_all()

    # ----- the hooks -------------------------------------------------------------------------
    def _neighbour(self, unit: _Unit, step: int) -> _Unit | None:
        if unit not in self.order:
            return None
        i = self.order.index(unit) + step
        return self.order[i] if 0 <= i < len(self.order) else None

    def _forward(self, unit: _Unit, *args: Any, **kwargs: Any) -> Any:
        self.materialize(unit)
        if unit not in self.order:
            self.order.append(unit)
        nxt = self._neighbour(unit, +1) if self.prefetch else None
        if nxt is not None:
            self._start(nxt)
        try:
            out = unit.original_forward(*args, **kwargs)
        finally:
            self.release(unit)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(functools.partial(self._pre_backward, unit))
        return out

    def _pre_backward(self, unit: _Unit, grad: Any) -> None:
        self.materialize(unit)
        prev = self._neighbour(unit, -1) if self.prefetch else None
        if prev is not None:
            self._start(prev)

    def grad_ready(self, e: Entry) -> None:
        unit = self.unit_of[id(e)]
        unit.grads_left -= 1
        if unit.grads_left <= 0 and unit.state == "materialized":
            self.release(unit)
