"""needle: a tensor/autograd framework, drop-in for the CMU DLSys course framework.

Import order follows the course: ops, autograd names, init, data, nn, optim, then the selected
backend's names last so that ``ndl.cpu`` is that backend's. The error classes
(``ndl.NeedleError`` and its subclasses) are exported too.

Example:
    >>> import needle as ndl
    >>> x = ndl.Tensor([[1.0, 2.0]], requires_grad=True)
    >>> (x * x).sum().backward(); x.grad.numpy().tolist()
    [[2.0, 4.0]]
"""
# ruff: noqa: I001, F401, F403, E402  (the order below is the course's contract)
from ._core.errors import *
from . import backend_ndarray  # imported in both modes: ptb_dataset needs it
from . import memory  # installs the caching allocators before anything allocates
from . import ops
from .ops import *
from .autograd import Tensor, TensorTuple, no_grad, enable_grad
from . import autograd
from . import init
from .init import ones, zeros, zeros_like, ones_like
from . import data
from . import nn
from . import optim
from . import amp
from . import random
from .random import manual_seed
from .checkpoint import checkpoint, checkpoint_sequential, plan_checkpoints
from .serialization import save, load
from .compiler import compile
from .backend_selection import *


def __getattr__(name):
    # needle.distributed pulls in mpi4py/pyzmq: load it only when someone asks for it.
    if name == "distributed":
        import importlib
        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module 'needle' has no attribute {name!r}")
