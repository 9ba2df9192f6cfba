"""The cache key of a compiled step's call: what decides that a new trace is needed.

Tensors count by shape, dtype, device and ``requires_grad``; NumPy arrays by shape and dtype;
``None``, bools, ints, floats and strings by value; anything else by type (its contents are
the step's business: a changed program is caught at replay, see ``needle.compiler``). The
grad mode is part of the key.

Example:
    >>> import needle as ndl
    >>> a = signature((ndl.Tensor([[1.0, 2.0]]), 3), {})
    >>> a == signature((ndl.Tensor([[5.0, 6.0]]), 3), {})
    True
    >>> a == signature((ndl.Tensor([[1.0, 2.0, 3.0]]), 3), {})
    False
"""
from __future__ import annotations

import numpy as np

from needle.autograd import Tensor
from needle.autograd.grad_mode import is_grad_enabled

__all__ = ["signature"]

_BY_VALUE = (type(None), bool, int, float, str)


def _key(value):
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), str(value.device),
                bool(value.requires_grad))
    if isinstance(value, np.ndarray):
        return ("array", value.shape, str(value.dtype))
    if isinstance(value, _BY_VALUE):
        return ("value", type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    return ("object", type(value).__qualname__)


def signature(args: tuple, kwargs: dict) -> tuple:
    """The hashable key of one call."""
    return (tuple(_key(a) for a in args),
            tuple(sorted((k, _key(v)) for k, v in kwargs.items())),
            is_grad_enabled())
