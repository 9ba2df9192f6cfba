"""The generated Python function of a kernel program (the runner where the backend has no
C++ kernel list, and with ``compile(..., native=False)``).

One line per kernel call, buffers in local variables, ``del`` after a buffer's last use (so
the planned arena serves the same requests as the traced call); on ``cpu()`` the recorded
memory categories are set on the thread as they change (no op dispatch runs to set them).

Example:
    >>> from needle.compiler.recorder import Alloc, Recording
    >>> import needle as ndl
    >>> rec = Recording(ndl.cpu_numpy().mod.Array)
    >>> rec.ops = [Alloc(0, 4, "float32", "activation")]
    >>> fn, source, n = generate(rec, [], [0])
    >>> source.strip().splitlines()[-1].strip(), n, len(fn([]))
    ('return (s0, )', 0, 1)
"""
from __future__ import annotations

import functools
import math

import numpy as np

from needle import random as _random
from needle.backend_ndarray import device_by_name
from needle.backend_ndarray.kernel_draws import kernel_for

from .fusion import FusedCall, slots_of
from .recorder import Alloc, Call, Const, PyCall, RandomFill, Recording, Ref, ScalarRef

__all__ = ["generate", "draw", "random_fill"]


def generate(rec: Recording, external_slots: list, made: list, ops=None, device_mod=None):
    """The program as Python source and its compiled function ``fn(handles)``."""
    ops = rec.ops if ops is None else ops
    names: dict[str, object] = {"_asarray": np.asarray}
    keep = set(made)
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        for slot in slots_of(op):
            last[slot] = i
    lines = ["def _program(H):"]
    if external_slots:
        lines.append("    " + ", ".join(f"s{s}" for s in external_slots)
                     + ", = H")
        lines.append("    H.clear()")  # the locals alone hold the buffers: freed at last use
    # No op dispatch runs to set the per-op category: the program sets the recorded
    # categories on the thread itself, once per change, and puts the thread's setting back
    # however it ends.
    set_category = getattr(device_mod, "allocator_set_category", None)
    if set_category is not None:
        names["_category"] = set_category
        lines += ["    _before = _category(None)", "    _category(_before)", "    try:"]
    indent = "        " if set_category is not None else "    "
    body_start = len(lines)
    category = None
    n_kernels = 0
    for i, op in enumerate(ops):
        if isinstance(op, Alloc):
            names["A"] = rec.array_type
            if set_category is not None and op.category != category:
                category = op.category
                lines.append(f"    _category({category!r})")
            lines.append(f"    s{op.slot} = A({op.size}, {op.dtype!r})")
        elif isinstance(op, Call):
            names[f"k{i}"] = op.fn
            rendered = ", ".join(_render(a, names, f"c{i}_{j}") for j, a in enumerate(op.args))
            lines.append(f"    k{i}({rendered})")
            n_kernels += 1
        elif isinstance(op, FusedCall):
            names[f"k{i}"], names[f"c{i}"], names[f"v{i}"] = op.fn, list(op.code), \
                list(op.scalars)
            ins = ", ".join(f"s{x}" for x in op.ins)
            outs = ", ".join(f"s{x}" for x in op.outs)
            lines.append(f"    k{i}([{ins}], [{outs}], c{i}, v{i}, {op.n})")
            n_kernels += 1
        elif isinstance(op, PyCall):
            names[f"f{i}"] = op.fn
            lines.append(f"    q{op.index} = f{i}()")
        elif isinstance(op, RandomFill):
            names[f"k{i}"] = random_fill(op, device_mod)
            lines.append(f"    k{i}(s{op.slot})")
            n_kernels += 1
        dead = [s for s in slots_of(op) if last[s] == i and s not in keep]
        if dead:
            lines.append("    del " + ", ".join(f"s{s}" for s in sorted(set(dead))))
    lines.append("    return (" + "".join(f"s{s}, " for s in made) + ")")
    if set_category is not None:
        lines[body_start:] = [indent + line[4:] for line in lines[body_start:]]
        lines += ["    finally:", "        _category(_before)"]
    source = "\n".join(lines) + "\n"
    code = compile(source, "<needle kernel program>", "exec")
    exec(code, names)  # noqa: S102 - our own generated source, built from recorded calls
    # the function's globals are `names`: without this it would reach itself through them, a
    # reference cycle that keeps the model and optimizer its kernels name alive until a
    # garbage collection
    fn = names.pop("_program")
    return fn, source, n_kernels


def _render(arg, names: dict, name: str) -> str:
    if isinstance(arg, Ref):
        return f"s{arg.slot}"
    if isinstance(arg, ScalarRef):
        return f"q{arg.call}" if arg.index < 0 else f"q{arg.call}[{arg.index}]"
    if isinstance(arg, bool) or arg is None or (type(arg) is int):
        return repr(arg)
    if type(arg) is float and math.isfinite(arg):
        return repr(arg)
    if isinstance(arg, str):
        return repr(arg)
    if isinstance(arg, (tuple, list)) and any(isinstance(a, Ref) for a in _flatten(arg)):
        inner = ", ".join(_render(a, names, f"{name}_{j}") for j, a in enumerate(arg))
        return f"({inner},)" if isinstance(arg, tuple) else f"[{inner}]"
    names[name] = arg.array if isinstance(arg, Const) else arg
    return name


def _flatten(items):
    for a in items:
        if isinstance(a, (tuple, list)):
            yield from _flatten(a)
        else:
            yield a


def draw(op: RandomFill):
    device = None if op.stream == _random.HOST else device_by_name(op.stream)
    return functools.partial(getattr(_random, op.kind), *op.shape, device=device)


def random_fill(op: RandomFill, mod=None):
    """``fill(out)``: a fresh draw of ``op`` into the buffer ``out``, as recorded:
    ``from_numpy(asarray(draw(), dtype), out)``. A uniform float32/float64 draw is made by
    backend ``mod``'s ``mt19937_uniform`` kernel where ``needle.random.host_mt19937`` allows
    (the same numbers, NumPy's generator advanced the same way, without the float64 array)."""
    drawn = draw(op)
    from_numpy, dtype = op.fn, op.dtype
    kernel = kernel_for(mod, dtype) if op.kind == "rand" else None
    device = None if op.stream == _random.HOST else device_by_name(op.stream)
    count = math.prod(op.shape)

    def fill(out):
        generator = _random.host_mt19937(device, replaying=True) if kernel else None
        if generator is not None:
            kernel(generator, out, count)
        else:
            from_numpy(np.asarray(drawn(), dtype, order="C"), out)

    fill.__name__ = "random_fill"
    return fill
