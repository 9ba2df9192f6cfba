"""Fusion of elementwise chains in a kernel program: many passes over memory become one.

A recorded step is full of short chains of elementwise kernels over buffers of one size: a
bias add and its activation, the backward of an activation, an optimiser's update
(``g + wd·θ``, ``μ·u + g``, ``θ − lr·u``: five kernels per parameter for SGD with momentum
and weight decay). :func:`fuse` finds maximal runs of such kernels in program order and
replaces each run of two or more by one ``ewise_program`` call (src/ewise_program_impl.h),
which runs the run block by block in registers: each input is read once, each buffer needed
after the run is written once, and buffers used only inside the run are never written.

The fused kernel runs the very loops of the separate kernels, in the same order per element,
so a fused program's numbers are bitwise those of the unfused one (tests:
python_tests/compiler/test_fusion.py).

A run stops at any other kernel, at a kernel that writes one of its own inputs, at buffers
of another size or dtype, at more than 16 distinct buffers, where two of its buffers
share arena bytes (the planner reuses the bytes of a dead buffer: within one fused pass both
would be in use at once), and where a buffer from the device's pools would be allocated
after another pool buffer of the run was last used (a fused run makes all its buffers before
it starts and frees them after it ends: that buffer would then be made before the other one
is freed, and the step would hold more memory than its plan says).

Example:
    >>> from needle.compiler.recorder import Alloc, Call, Ref
    >>> ops = [Alloc(1, 8, "float32"), Call("scalar_mul", None, (Ref(0), 2.0, Ref(1))),
    ...        Alloc(2, 8, "float32"), Call("ewise_add", None, (Ref(1), Ref(0), Ref(2)))]
    >>> sizes = {0: (8, "float32"), 1: (8, "float32"), 2: (8, "float32")}
    >>> fused = fuse(ops, sizes, keep={2}, kernel=None)
    >>> [type(op).__name__ for op in fused], fused[-1].ins, fused[-1].outs
    (['Alloc', 'Alloc', 'FusedCall'], (0,), (2,))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from needle.backend_ndarray.ewise_codes import (
    BINARY,
    BINARY_OPS,
    LOAD,
    MAX_REGISTERS,
    RSCALAR,
    SCALAR,
    STORE,
    UNARY,
    UNARY_OPS,
)

from .recorder import Alloc, Call, Ref

__all__ = ["FusedCall", "fuse", "slots_of", "FUSIBLE", "MAX_REGISTERS"]

# kernel name -> (instruction kind, op code)
FUSIBLE: dict[str, tuple[int, int]] = {f"ewise_{n}": (BINARY, c) for n, c in BINARY_OPS.items()}
FUSIBLE.update({f"ewise_{n}": (UNARY, c) for n, c in UNARY_OPS.items()})
FUSIBLE.update({f"scalar_{n}": (SCALAR, BINARY_OPS[n]) for n in
                ("add", "sub", "mul", "div", "power", "maximum", "minimum", "eq", "ge")})
FUSIBLE.update({f"scalar_{name}": (RSCALAR, BINARY_OPS[op]) for name, op in
                (("rsub", "sub"), ("rdiv", "div"), ("rpower", "power"), ("le", "ge"))})


@dataclass(frozen=True)
class FusedCall:
    """``fn(ins, outs, code, scalars, n)``: the fused run ``members`` (see the module
    docstring); ``ins``/``outs`` are slots."""

    ins: tuple
    outs: tuple
    code: tuple
    scalars: tuple
    n: int
    members: tuple = field(repr=False)
    fn: Any = field(default=None, compare=False, repr=False)


def _describe(op, sizes: dict):
    """(kind, code, reads, write, scalar, (n, dtype)) of a fusible call, else None."""
    if not isinstance(op, Call) or op.name not in FUSIBLE:
        return None
    kind, code = FUSIBLE[op.name]
    args = op.args
    if kind == BINARY and len(args) == 3 and all(isinstance(a, Ref) for a in args):
        reads, write, scalar = (args[0].slot, args[1].slot), args[2].slot, None
    elif kind in (SCALAR, RSCALAR) and len(args) == 3 and isinstance(args[0], Ref) \
            and isinstance(args[2], Ref) and type(args[1]) in (int, float):
        reads, write, scalar = (args[0].slot,), args[2].slot, float(args[1])
    elif kind == UNARY and len(args) == 2 and all(isinstance(a, Ref) for a in args):
        reads, write, scalar = (args[0].slot,), args[1].slot, None
    else:
        return None
    if write in reads:
        return None  # in place: a block would read what the run already wrote
    shape = {sizes.get(s) for s in (*reads, write)}
    if len(shape) != 1 or None in shape:
        return None
    (layout,) = shape
    if layout[1] not in ("float32", "float64") or layout[0] <= 0:
        return None
    return kind, code, reads, write, scalar, layout


class _Run:
    def __init__(self, layout):
        self.layout = layout
        self.members: list = []  # (op, description)
        self.allocs: list = []
        self.slots: list = []  # distinct slots in first-use order

    def admits(self, desc, overlaps: Callable[[int, int], bool]) -> bool:
        _, _, reads, write, _, layout = desc
        if layout != self.layout:
            return False
        new = [s for s in dict.fromkeys((*reads, write)) if s not in self.slots]
        if len(self.slots) + len(new) > MAX_REGISTERS:
            return False
        return not any(overlaps(a, b) for a in new for b in self.slots)

    def add(self, op, desc) -> None:
        self.members.append((op, desc))
        for s in (*desc[2], desc[3]):
            if s not in self.slots:
                self.slots.append(s)


def fuse(ops: list, sizes: dict, keep: set, kernel, overlaps=None, pooled=None) -> list:
    """``ops`` with every fusible run of two or more kernels replaced by a :class:`FusedCall`.

    Args:
        ops: the recorded ops (Alloc, Call, RandomFill) in program order.
        sizes: slot -> (element count, dtype) for every slot the calls may touch.
        keep: slots read after the program (its outputs and the buffers it leaves in place).
        kernel: the backend's ``ewise_program``.
        overlaps: ``overlaps(a, b)`` -> True when slots a and b share bytes (arena reuse).
        pooled: slots whose buffers come from the pools, not the arena (None: no such
            constraint).
    """
    overlaps = overlaps or (lambda a, b: False)
    pooled = pooled if pooled is not None else set()
    last_use: dict[int, int] = {}
    for i, op in enumerate(ops):
        for s in slots_of(op):
            last_use[s] = i
    out: list = []
    run: _Run | None = None
    pending: list = []  # allocations met while a run is open

    def close(end: int) -> None:
        nonlocal run
        if run is not None:
            if len(run.members) >= 2:
                out.extend(run.allocs)
                out.append(_compile(run, end, last_use, keep, kernel))
            else:
                ordered = sorted(run.allocs + [m[0] for m in run.members], key=position.get)
                out.extend(ordered)
        run = None

    position = {id(op): i for i, op in enumerate(ops)}
    for i, op in enumerate(ops):
        if isinstance(op, Alloc):
            (pending if run is not None else out).append(op)
            continue
        desc = _describe(op, sizes)
        if desc is not None and run is not None and run.admits(desc, overlaps) \
                and not _frees_before_pool_alloc(run, pending, i, last_use, pooled):
            run.allocs.extend(pending)
            pending = []
            run.add(op, desc)
            continue
        close(i)
        out.extend(pending)
        pending = []
        if desc is not None:
            run = _Run(desc[5])
            run.add(op, desc)
        else:
            out.append(op)
    close(len(ops))
    out.extend(pending)
    return out


def _frees_before_pool_alloc(run: _Run, pending: list, i: int, last_use: dict,
                             pooled: set) -> bool:
    """Would op ``i`` joining ``run`` make a pool buffer (one of ``pending``) before a pool
    buffer the run already finished with is freed?"""
    return any(a.slot in pooled for a in pending) and \
        any(s in pooled and last_use.get(s, -1) < i for s in run.slots)


def _compile(run: _Run, end: int, last_use: dict, keep: set, kernel) -> FusedCall:
    """The instructions of a run: loads of what it reads before writing, one instruction per
    member, stores of what is read after the run (or kept)."""
    reg = {s: r for r, s in enumerate(run.slots)}
    written: set = set()
    ins: list = []
    code: list = []
    scalars: list = []
    for _, (kind, op, reads, write, scalar, _) in run.members:
        for s in reads:
            if s not in written and s not in ins:
                ins.append(s)
                code += [LOAD, 0, reg[s], ins.index(s), 0]
        if kind == BINARY:
            code += [kind, op, reg[write], reg[reads[0]], reg[reads[1]]]
        elif kind == UNARY:
            code += [kind, op, reg[write], reg[reads[0]], 0]
        else:
            scalars.append(scalar)
            code += [kind, op, reg[write], reg[reads[0]], len(scalars) - 1]
        written.add(write)
    outs = [s for s in run.slots if s in written and (last_use.get(s, -1) >= end or s in keep)]
    for j, s in enumerate(outs):
        code += [STORE, 0, j, reg[s], 0]
    return FusedCall(tuple(ins), tuple(outs), tuple(code), tuple(scalars), run.layout[0],
                     tuple(m[0] for m in run.members), kernel)


def slots_of(op) -> list:
    """The slots an op of a program touches (reads, writes or makes)."""
    if isinstance(op, Alloc):
        return [op.slot]
    if isinstance(op, FusedCall):
        return [*op.ins, *op.outs]
    out: list = []
    stack = [getattr(op, "args", ())]
    while stack:  # nested argument lists, without a self-referencing closure
        a = stack.pop()
        if isinstance(a, Ref):
            out.append(a.slot)
        elif isinstance(a, (tuple, list)):
            stack.extend(reversed(a))
    slot = getattr(op, "slot", None)
    if slot is not None:
        out.append(slot)
    return out
