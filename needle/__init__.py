"""needle: a tensor/autograd framework, drop-in for the CMU DLSys course framework.

Import order follows the course (NEEDLE_API §1): ops, autograd names, init, data, nn, optim,
then the selected backend's names last so that ``ndl.cpu`` is that backend's.

Example:
    >>> import needle as ndl
    >>> x = ndl.Tensor([[1.0, 2.0]], requires_grad=True)
    >>> (x * x).sum().backward(); x.grad.numpy().tolist()
    [[2.0, 4.0]]
"""
from . import backend_ndarray  # noqa: F401  (imported in both modes: ptb_dataset needs it)
from . import memory  # noqa: F401  (installs the caching allocators before anything allocates)
from . import ops
from .ops import *  # noqa: F401,F403
from .autograd import Tensor, TensorTuple, no_grad, enable_grad  # noqa: F401
from . import autograd  # noqa: F401
from . import init
from .init import ones, zeros, zeros_like, ones_like  # noqa: F401
from . import data  # noqa: F401
from . import nn  # noqa: F401
from . import optim  # noqa: F401
from .backend_selection import *  # noqa: F401,F403


def __getattr__(name):
    # needle.distributed pulls in mpi4py/pyzmq: load it only when someone asks for it.
    if name == "distributed":
        import importlib
        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module 'needle' has no attribute {name!r}")
