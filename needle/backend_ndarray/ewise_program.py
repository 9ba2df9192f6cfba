"""Elementwise programs: a short chain of elementwise ops run over arrays in one kernel call.

A backend may offer ``ewise_program(ins, outs, code, scalars, n)`` (optional in the backend
protocol; the C++ ``cpu()`` backend and the NumPy reference have it): it runs ``code`` over
the first ``n`` elements of every input, block by block in registers, so each input is read
once and each output written once, and values used only inside the chain are never written
to memory. The fused kernel applies the very loops of the separate kernels in the same order
per element, so its results are bitwise those of the separate kernel calls.

This module runs such a program on NDArrays eagerly (the optimizers' updates); the instruction
set is in :mod:`.ewise_codes`.

Example:
    >>> import numpy as np
    >>> from needle.backend_ndarray import NDArray, cpu_numpy
    >>> p = Program(2)                       # two inputs, in registers 0 and 1
    >>> p.store(p.binary("sub", 0, p.scalar("mul", 1, 0)))   # in0 - in1 * s0
    >>> x, g = (NDArray(np.full(3, v, "float32"), device=cpu_numpy()) for v in (1.0, 4.0))
    >>> (out,) = run(p, (x, g), [0.5]); out.numpy().tolist()
    [-1.0, -1.0, -1.0]
"""
from __future__ import annotations

from math import prod as _prod

from . import ewise_codes as _codes
from .ndarray import NDArray, _alloc

__all__ = ["Program", "available", "run", "empty_like", "Batch", "run_launches"]


class Program:
    """A program under construction: inputs ``0 .. n_inputs-1`` are loaded into registers of
    the same numbers; each op writes a register no live value holds and returns it. Values no
    longer needed are handed back with :meth:`free` (there are only 16:
    ``ewise_codes.MAX_REGISTERS``).
    Build a program once and run it many times with different scalars."""

    def __init__(self, n_inputs: int):
        self.code: list[int] = []
        self.n_inputs = n_inputs
        self.n_outputs = 0
        self._next = n_inputs
        self._free: list[int] = []
        for i in range(n_inputs):
            self.code += [_codes.LOAD, 0, i, i, 0]

    def _fresh(self) -> int:
        if self._free:
            return self._free.pop()
        reg = self._next
        if reg >= _codes.MAX_REGISTERS:
            raise ValueError(f"ewise program: more than {_codes.MAX_REGISTERS} registers live")
        self._next += 1
        return reg

    def free(self, *regs: int) -> None:
        """The values in ``regs`` are dead: later ops may write those registers (never the
        one they read, so no kernel runs in place)."""
        self._free.extend(r for r in regs if r not in self._free)

    def binary(self, op: str, a: int, b: int) -> int:
        """``op(a, b)`` of two registers."""
        dst = self._fresh()
        self.code += [_codes.BINARY, _codes.BINARY_OPS[op], dst, a, b]
        return dst

    def scalar(self, op: str, a: int, index: int, reverse: bool = False) -> int:
        """``op(a, scalars[index])`` (``op(scalars[index], a)`` when ``reverse``)."""
        dst = self._fresh()
        kind = _codes.RSCALAR if reverse else _codes.SCALAR
        self.code += [kind, _codes.BINARY_OPS[op], dst, a, index]
        return dst

    def unary(self, op: str, a: int) -> int:
        """``op(a)`` of one register (``op`` one of ``UNARY_OPS``: neg, log, exp, sqrt, ...)."""
        dst = self._fresh()
        self.code += [_codes.UNARY, _codes.UNARY_OPS[op], dst, a, 0]
        return dst

    def store(self, reg: int) -> None:
        """Register ``reg`` becomes the next output."""
        self.code += [_codes.STORE, 0, self.n_outputs, reg, 0]
        self.n_outputs += 1


def available(arrays) -> bool:
    """True when :func:`run` can take these arrays: one device with ``ewise_program``, all
    compact, of one shape, float32 or float64."""
    first = arrays[0]
    if type(first) is not NDArray:
        return False  # the course's NumPy mode: plain numpy arrays
    device, shape, dtype = first._device, first._shape, first._handle.dtype
    if dtype not in ("float32", "float64") or getattr(device.mod, "ewise_program", None) is None:
        return False
    for a in arrays:
        if (type(a) is not NDArray or a._device is not device or a._shape != shape
                or a._handle.dtype != dtype or not (a._compact or a.is_compact())):
            return False
    return True


def run(program: Program, ins, scalars, outs=None) -> list[NDArray]:
    """Run ``program`` over the arrays ``ins`` (see :func:`available`) with ``scalars``;
    returns its outputs, new arrays of the inputs' shape unless ``outs`` gives them (made by
    the caller, e.g. under a memory category)."""
    first = ins[0]
    if outs is None:
        outs = [empty_like(first) for _ in range(program.n_outputs)]
    first._device.mod.ewise_program([a._handle for a in ins], [o._handle for o in outs],
                                    program.code, scalars, _prod(first._shape))
    return outs


class Batch:
    """Program runs collected and handed to the backend together: consecutive runs of one
    program on one device go in one ``ewise_program_many(launches, code, scalars)`` call
    where the backend has it (``cpu()``: checked together, one C++ loop), else one
    ``ewise_program`` call each. The order of the runs is kept, so the result is that of
    :func:`run` called for each in turn. An optimizer's step adds one run per parameter and
    runs them at the end: ~0.5 µs of call overhead per parameter less.

    Example:
        >>> import numpy as np
        >>> from needle.backend_ndarray import NDArray, cpu_numpy
        >>> p = Program(2)
        >>> p.store(p.binary("sub", 0, p.scalar("mul", 1, 0)))   # in0 - in1 * s0
        >>> x, g = (NDArray(np.full(3, v, "float32"), device=cpu_numpy()) for v in (1.0, 4.0))
        >>> batch = Batch([0.5]); batch.add(p, (x, g), [x]); batch.add(p, (x, g), [x])
        >>> batch.run(); x.numpy().tolist()     # two updates of x in place, in order
        [-3.0, -3.0, -3.0]
    """

    __slots__ = ("scalars", "added", "_program", "_mod", "_launches")

    def __init__(self, scalars, record: bool = False):
        self.scalars = scalars
        # with ``record``: (program, ins, outs) of every add, in order (the optimizers keep
        # it to run the same step again)
        self.added: list | None = [] if record else None
        self._program = self._mod = None
        self._launches: list = []

    def add(self, program: Program, ins, outs) -> None:
        """Queue ``run(program, ins, self.scalars, outs)`` (arrays as :func:`available`
        takes them; ``outs`` made by the caller)."""
        first = ins[0]
        mod = first._device.mod
        if self.added is not None:
            self.added.append((program, ins, outs))
        if program is not self._program or mod is not self._mod:
            self.run()
            self._program, self._mod = program, mod
        self._launches.append(([a._handle for a in ins], [o._handle for o in outs],
                               _prod(first._shape)))

    def run(self) -> None:
        """Run what was queued, in order (a batch can be added to and run again)."""
        launches, mod = self._launches, self._mod
        if not launches:
            return
        self._launches = []
        run_launches(mod, launches, self._program.code, self.scalars)


def run_launches(mod, launches, code, scalars) -> None:
    """``launches`` (``(in handles, out handles, n)`` each) of the program ``code`` on the
    backend module ``mod``, in order: one ``ewise_program_many`` call where ``mod`` has it,
    else one ``ewise_program`` call per launch."""
    many = getattr(mod, "ewise_program_many", None)
    if many is not None:
        many(launches, code, scalars)
        return
    for ins, outs, n in launches:
        mod.ewise_program(ins, outs, code, scalars, n)


def empty_like(a: NDArray) -> NDArray:
    """A new compact array of ``a``'s shape, dtype and device (uninitialised): an output to
    hand to :func:`run`, allocated where the caller chooses (e.g. under a memory category)."""
    return _alloc(a._shape, a._device, a._handle.dtype, "ewise_program")
