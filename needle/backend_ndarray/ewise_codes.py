"""The instruction set of elementwise programs (a backend's optional ``ewise_program``).

An instruction is five ints ``(kind, op, dst, a, b)``:

========  =======================================================================
kind      meaning
========  =======================================================================
LOAD      register ``dst`` = input ``a``
STORE     output ``dst`` = register ``a``
BINARY    ``dst`` = ``op``\\ (register ``a``, register ``b``) (op: :data:`BINARY_OPS`)
SCALAR    ``dst`` = ``op``\\ (register ``a``, scalar ``b``)
RSCALAR   ``dst`` = ``op``\\ (scalar ``b``, register ``a``)
UNARY     ``dst`` = ``op``\\ (register ``a``) (op: :data:`UNARY_OPS`)
========  =======================================================================

The numbers match ``ProgramKind`` and the op tables of src/kernels.h; the C++ kernel, the
NumPy reference (ndarray_backend_numpy_fused.py), kernel programs (needle.compiler.fusion)
and eager programs (ewise_program.py) all read them from here.

Example:
    >>> [LOAD, 0, 0, 0, 0] + [SCALAR, BINARY_OPS["mul"], 1, 0, 0] + [STORE, 0, 0, 1, 0]
    [0, 0, 0, 0, 0, 3, 2, 1, 0, 0, 1, 0, 0, 1, 0]
"""
__all__ = ["LOAD", "STORE", "BINARY", "SCALAR", "RSCALAR", "UNARY", "MAX_REGISTERS",
           "BINARY_OPS", "UNARY_OPS", "check_program", "check_in_place"]

MAX_REGISTERS = 16  # kProgramRegisters in src/kernels.h
LOAD, STORE, BINARY, SCALAR, RSCALAR, UNARY = range(6)  # ProgramKind in src/kernels.h
BINARY_OPS = {name: i for i, name in enumerate(
    ("add", "sub", "mul", "div", "maximum", "minimum", "power", "eq", "ge", "tanh_grad",
     "relu_grad"))}
UNARY_OPS = {name: i for i, name in enumerate(
    ("neg", "log", "exp", "tanh", "sqrt", "abs", "sign", "sigmoid"))}


def check_program(code, n_in: int, n_out: int, n_scalars: int) -> None:
    """Raise ``ValueError`` unless ``code`` is a valid program over ``n_in`` inputs, ``n_out``
    outputs and ``n_scalars`` scalars: every register read after it is set, every index in
    range, known kinds and ops, each output stored at most once.

    Example:
        >>> check_program([LOAD, 0, 0, 0, 0, STORE, 0, 0, 0, 0], 1, 1, 0)  # out0 = in0
        >>> check_program([STORE, 0, 0, 3, 0], 1, 1, 0)
        Traceback (most recent call last):
        ...
        ValueError: ewise_program: register 3 read before set
    """
    def bad(what):
        raise ValueError(f"ewise_program: {what}")

    if len(code) % 5:
        bad(f"expected instructions of 5 ints, got {len(code)}")
    ready = [False] * MAX_REGISTERS
    stored = [False] * n_out

    def reg(r, read):
        if not 0 <= r < MAX_REGISTERS:
            bad(f"register {r} outside [0, {MAX_REGISTERS})")
        if read and not ready[r]:
            bad(f"register {r} read before set")

    for k in range(0, len(code), 5):
        kind, op, dst, a, b = code[k:k + 5]
        if kind == LOAD:
            if not 0 <= a < n_in:
                bad(f"input {a} out of range")
            reg(dst, False)
        elif kind == STORE:
            if not 0 <= dst < n_out:
                bad(f"output {dst} out of range")
            if stored[dst]:  # the C++ backend computes straight into a stored-to output
                bad(f"output {dst} stored twice")
            stored[dst] = True
            reg(a, True)
            continue
        elif kind in (BINARY, SCALAR, RSCALAR):
            if not 0 <= op < len(BINARY_OPS):
                bad(f"unknown binary op {op}")
            if kind == BINARY:
                reg(b, True)
            elif not 0 <= b < n_scalars:
                bad(f"scalar {b} out of range")
            reg(a, True)
            reg(dst, False)
        elif kind == UNARY:
            if not 0 <= op < len(UNARY_OPS):
                bad(f"unknown unary op {op}")
            reg(a, True)
            reg(dst, False)
        else:
            bad(f"unknown instruction kind {kind}")
        ready[dst] = True


def check_in_place(code, in_index: int, out_index: int) -> None:
    """Raise ``ValueError`` unless ``code`` may run with output ``out_index`` in the buffer of
    input ``in_index``: every read of that input (its loads and the registers holding them)
    must come before the output's store, or at the computation stored there, which reads and
    writes each element at one index. A program updating θ in place (``θ − lr·g`` stored
    into θ's buffer) qualifies; one reading θ again after storing it does not.

    Example:
        >>> update = [LOAD, 0, 0, 0, 0, LOAD, 0, 1, 1, 0,
        ...           BINARY, BINARY_OPS["sub"], 2, 0, 1, STORE, 0, 0, 2, 0]
        >>> check_in_place(update, 0, 0)              # out0 = in0 - in1, into in0's buffer
        >>> try:                                      # out1 = in0, read after the store
        ...     check_in_place(update + [STORE, 0, 1, 0, 0], 0, 0)
        ... except ValueError as exc:
        ...     print(str(exc)[:57])
        ewise_program: output 0 shares its buffer with input 0 an
    """
    def refuse():
        raise ValueError(
            f"ewise_program: output {out_index} shares its buffer with input {in_index} and "
            f"the program reads that input after storing the output (in place, every read of "
            f"the input must come first)")

    views = [False] * MAX_REGISTERS  # registers still holding the input as loaded
    stored = False

    def viewed(r):
        return 0 <= r < MAX_REGISTERS and views[r]

    for k in range(0, len(code) - 4, 5):
        kind, _op, dst, a, b = code[k:k + 5]
        if kind == LOAD:
            if stored and a == in_index:
                refuse()
            if 0 <= dst < MAX_REGISTERS:
                views[dst] = a == in_index
            continue
        reads = viewed(a) or (kind == BINARY and viewed(b))
        if kind == STORE:
            if reads and (stored or dst == out_index):  # a copy onto itself too
                refuse()
            stored = stored or dst == out_index
            continue
        if stored and reads:
            refuse()
        if 0 <= dst < MAX_REGISTERS:
            views[dst] = False
