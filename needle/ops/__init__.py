"""Primitive ops (layer L4): small classes with ``compute`` on arrays and ``gradient`` on
Tensors, plus lowercase function wrappers (``add``, ``matmul``, ``conv`` ...).

Example:
    >>> import needle as ndl
    >>> ndl.ops.relu(ndl.Tensor([-1.0, 2.0])).numpy().tolist()
    [0.0, 2.0]
"""
import sys

from ..autograd import Op, Tensor, TensorOp, TensorTuple, TensorTupleOp, Value  # noqa: F401
from ..autograd.tensor import register_operator_ops
from .ops_batch_norm import *  # noqa: F401,F403
from .ops_conv import *  # noqa: F401,F403
from .ops_embedding import *  # noqa: F401,F403
from .ops_fused import *  # noqa: F401,F403
from .ops_linear import *  # noqa: F401,F403
from .ops_logarithmic import *  # noqa: F401,F403
from .ops_mathematic import *  # noqa: F401,F403
from .ops_mathematic import _ADD, _MATMUL, _MUL, _NEG, as_scalar  # noqa: F401
from .ops_softmax_xent import *  # noqa: F401,F403
from .ops_tuple import *  # noqa: F401,F403


def _exported() -> list:
    # What `from needle.ops import *` gives: every op class and function defined in the op
    # modules, plus the graph classes the course's ops module leaks (ndl.TensorTuple, ...).
    names = ["Op", "Tensor", "TensorOp", "TensorTuple", "TensorTupleOp", "Value"]
    for name, value in globals().items():
        module = getattr(value, "__module__", None) or ""
        if not name.startswith("_") and module.startswith("needle.ops.ops_"):
            names.append(name)
    return names


__all__ = _exported()

# Tensor's operators (a + b, a @ b, a.sum(), ...) dispatch to the ops of this package; the
# autograd layer below cannot import it, so the ops layer registers itself here.
register_operator_ops(sys.modules[__name__])
