"""A kernel program as a ``_KernelList`` of the C++ backend: replayed without Python per kernel.

:func:`build_kernel_list` translates the ops of a kernel program (after fusion) into the steps
of ``ndarray_backend_cpu._KernelList`` (src/kernel_list_py.h): buffer allocations and frees,
the common kernels as native steps that call the backend's entry points directly (elementwise,
scalar and unary ops, strided matmul, reductions, compaction, fill), and every other call
(fused runs, batch norm, softmax cross-entropy, LSTM and convolution kernels, random fills,
``replayed()`` bookkeeping) as a step that calls its function from C++. A buffer is freed
after its last use, as in the generated Python program, so the planned arena serves the same
requests. Backends without ``_KernelList`` keep the generated Python function.

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle.compiler.recorder import record_kernels
    >>> from needle.compiler.program import Before, build_program
    >>> x = ndl.Tensor(np.ones(3), device=ndl.cpu())
    >>> with record_kernels(ndl.cpu()) as rec:
    ...     y = x * 2 + 1
    >>> prog = build_program(rec, Before({}, [x]), {}, (x,), {}, y)
    >>> out = prog.run((x,), {})  # prepares the runner first: a _KernelList on cpu()
    >>> prog.native is not None, out.numpy().tolist()
    (True, [3.0, 3.0, 3.0])
"""
from __future__ import annotations

from .fusion import BINARY, FUSIBLE, RSCALAR, SCALAR, UNARY, FusedCall, slots_of
from .recorder import Alloc, Call, Const, PyCall, RandomFill, Ref, ScalarRef

__all__ = ["build_kernel_list"]

_REDUCE = {"reduce_sum": 0, "reduce_max": 1, "reduce_min": 2}


def build_kernel_list(ops: list, external_slots: list, keep: set, mod, fill):
    """The ``_KernelList`` of ``ops`` on backend ``mod`` (None when it has none).

    Args:
        ops: the program's ops (Alloc, Call, FusedCall, RandomFill, PyCall) in order.
        external_slots: the slots bound per run, in the order ``run`` receives them.
        keep: slots the run returns (never freed).
        fill: ``fill(random_fill_op)`` -> ``fn(out)`` making that op's fresh draw into ``out``
            (``codegen.random_fill``).
    """
    kernel_list = getattr(mod, "_KernelList", None)
    if kernel_list is None:
        return None
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        for slot in slots_of(op):
            last[slot] = i
    registers: dict[int, int] = {}
    n_regs = 0
    for op in ops:
        if isinstance(op, PyCall):
            registers[op.index] = n_regs
            n_regs += op.n_values
    n_slots = 1 + max([*last, *external_slots, -1])
    kl = kernel_list(n_slots, max(n_regs, 1))
    for i, op in enumerate(ops):
        try:
            _add(kl, op, registers, fill)
        except ValueError:
            return None  # an argument the list cannot pass: keep the Python program
        dead = sorted({s for s in slots_of(op) if last[s] == i and s not in keep})
        for slot in dead:
            kl.free(slot)
    return kl


def _reg(ref: ScalarRef, registers: dict) -> int:
    return registers[ref.call] + max(ref.index, 0)


def _add(kl, op, registers: dict, fill) -> None:
    if isinstance(op, Alloc):
        kl.alloc(op.slot, op.size, op.dtype, op.category or "other")
    elif isinstance(op, PyCall):
        kl.python(op.fn, [], [], [], [], registers[op.index])
    elif isinstance(op, RandomFill):
        kl.python(fill(op), [None], [op.slot], [-1], [[]], -1)
    elif isinstance(op, FusedCall):
        kl.program(list(op.ins), list(op.outs), list(op.code), list(op.scalars), op.n)
    elif not _native(kl, op, registers):
        _python_call(kl, op, registers)


def _native(kl, op: Call, registers: dict) -> bool:
    """Add ``op`` as a native step when it is one of the common kernels in its usual form."""
    a = op.args
    refs = [x.slot if isinstance(x, Ref) else None for x in a]
    kind = FUSIBLE.get(op.name)
    if kind is not None:
        k, code = kind
        if k == BINARY and len(a) == 3 and None not in refs:
            kl.binary(code, *refs)
            return True
        if k == UNARY and len(a) == 2 and None not in refs:
            kl.unary(code, *refs)
            return True
        if k in (SCALAR, RSCALAR) and len(a) == 3 and refs[0] is not None \
                and refs[2] is not None:
            if type(a[1]) in (int, float):
                kl.scalar(code, k == RSCALAR, refs[0], float(a[1]), -1, refs[2])
                return True
            if isinstance(a[1], ScalarRef):
                kl.scalar(code, k == RSCALAR, refs[0], 0.0, _reg(a[1], registers), refs[2])
                return True
        return False
    if op.name == "ewise_add_rows" and len(a) == 5 and None not in refs[:3] \
            and all(type(x) is int for x in a[3:]):
        kl.add_rows(*refs[:3], a[3], a[4])
        return True
    if op.name == "reduce_sum_leading" and len(a) == 4 and None not in refs[:2] \
            and all(type(x) is int for x in a[2:]):
        kl.sum_leading(*refs[:2], a[2], a[3])
        return True
    if op.name == "matmul_strided" and len(a) == 12 and None not in refs[:3] \
            and all(type(x) is int for x in a[3:]):
        kl.matmul_strided(*refs[:3], list(a[3:]))
        return True
    if op.name in _REDUCE and len(a) == 3 and None not in refs[:2] and type(a[2]) is int:
        kl.reduce(_REDUCE[op.name], refs[0], refs[1], a[2])
        return True
    if op.name in ("compact", "ewise_setitem") and len(a) == 5 and None not in refs[:2] \
            and isinstance(a[2], (tuple, list)) and isinstance(a[3], (tuple, list)) \
            and type(a[4]) is int:
        kl.compact(refs[0], refs[1], list(a[2]), list(a[3]), a[4], op.name == "ewise_setitem")
        return True
    if op.name == "fill" and len(a) == 2 and refs[0] is not None and type(a[1]) in (int, float):
        kl.fill(refs[0], float(a[1]))
        return True
    return False


def _python_call(kl, op: Call, registers: dict) -> None:
    args, slot_at, reg_at, lists = [], [], [], []
    for x in op.args:
        slot, reg, items, value = -1, -1, [], x
        if isinstance(x, Ref):
            slot, value = x.slot, None
        elif isinstance(x, ScalarRef):
            reg, value = _reg(x, registers), None
        elif isinstance(x, Const):
            value = x.array
        elif isinstance(x, (tuple, list)) and any(isinstance(y, Ref) for y in x):
            if not all(isinstance(y, Ref) for y in x):
                raise ValueError(f"{op.name}: a list mixing buffers and values")
            items, value = [y.slot for y in x], None
        args.append(value)
        slot_at.append(slot)
        reg_at.append(reg)
        lists.append(items)
    kl.python(op.fn, args, slot_at, reg_at, lists, -1)
