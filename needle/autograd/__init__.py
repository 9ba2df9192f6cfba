"""The autograd graph (layer L3): ``Value``/``Tensor``/``TensorTuple``, ops and ``backward``.

Ops run eagerly: each call computes its array at once and, when grad mode is on and an input
requires grad, records the op and its inputs so that :meth:`Tensor.backward` can walk back.
``docs/autograd.md`` states the rules per mode. The package, lowest module first:

* ``grad_mode`` — thread-local ``no_grad`` / ``enable_grad`` and the saved-tensor hooks slot;
* ``hooks`` — ``saved_tensors_hooks`` and the hook handle;
* ``release`` — frees recorded outputs that backward will not read;
* ``value`` — :class:`Value` (a graph node), :class:`Op`, and the op dispatch hot path;
* ``engine`` — the backward walk (dependency counting, hooks, freeing as it goes);
* ``tensor`` — :class:`Tensor`, :class:`TensorTuple`, :class:`TensorOp`; its operators reach
  :mod:`needle.ops` (the layer above) through a registration made by ``needle.ops``;
* ``gradcheck`` — numerical gradient check;
* ``anomaly`` — ``detect_anomaly``: the first op that makes a NaN/Inf, and its source line.

Example:
    >>> import needle as ndl
    >>> x = ndl.Tensor([1.0, 2.0, 3.0])
    >>> (x * x).sum().backward()
    >>> x.grad.numpy().tolist()
    [2.0, 4.0, 6.0]
"""
from __future__ import annotations

import sys
import types

from ..backend_selection import (  # noqa: F401 - re-exported as the course's autograd does
    BACKEND,
    Device,
    NDArray,
    all_devices,
    array_api,
    cpu,
    default_device,
)
from ..memory import offload as _mem_offload
from . import value as _value
from .anomaly import NonFiniteError, detect_anomaly
from .engine import compute_gradient_of_variables, find_topo_sort, sum_node_list, topo_sort_dfs
from .grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from .gradcheck import gradcheck
from .hooks import RemovableHandle, saved_tensors_hooks
from .release import release_unsaved as _release_unsaved
from .tensor import (
    ImplicitGradWarning,
    SparseTupleGrad,
    Tensor,
    TensorOp,
    TensorTuple,
    TensorTupleOp,
)
from .value import Op, Value

# ndl.memory.offload_saved_tensors (L2) is built from these two L3 mechanisms.
_mem_offload.provide(saved_tensors_hooks, _release_unsaved)

__all__ = ["Op", "TensorOp", "TensorTupleOp", "Value", "Tensor", "TensorTuple",
           "find_topo_sort", "topo_sort_dfs", "sum_node_list", "compute_gradient_of_variables",
           "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled",
           "saved_tensors_hooks", "RemovableHandle", "gradcheck", "ImplicitGradWarning",
           "SparseTupleGrad", "LAZY_MODE", "TENSOR_COUNTER", "detect_anomaly", "NonFiniteError"]

# The course reads (and may set) ``needle.autograd.TENSOR_COUNTER`` / ``LAZY_MODE``. LAZY_MODE
# lives in ``value.py``, where the op dispatch reads it; TENSOR_COUNTER is the live Value count
# (``value.live_count``). This module forwards both, so that a read gives the live value and a
# write reaches ``value.py``.


class _AutogradModule(types.ModuleType):
    def __getattr__(self, name):
        if name == "TENSOR_COUNTER":
            return _value.live_count()
        if name == "LAZY_MODE":
            return _value.LAZY_MODE
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name == "TENSOR_COUNTER":
            _value.set_live_count(value)
        elif name == "LAZY_MODE":
            _value.LAZY_MODE = value
        else:
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _AutogradModule
