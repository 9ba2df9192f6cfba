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
           "BINARY_OPS", "UNARY_OPS"]

MAX_REGISTERS = 16  # kProgramRegisters in src/kernels.h
LOAD, STORE, BINARY, SCALAR, RSCALAR, UNARY = range(6)  # ProgramKind in src/kernels.h
BINARY_OPS = {name: i for i, name in enumerate(
    ("add", "sub", "mul", "div", "maximum", "minimum", "power", "eq", "ge", "tanh_grad",
     "relu_grad"))}
UNARY_OPS = {name: i for i, name in enumerate(
    ("neg", "log", "exp", "tanh", "sqrt", "abs", "sign", "sigmoid"))}
