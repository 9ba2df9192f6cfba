"""The conjugate communication ops of tensor parallelism, as autograd ops.

* :func:`copy_to_parallel` (Megatron's *f*): identity forward, all-reduce (sum) backward. Put
  before a column-parallel layer: every rank uses the whole input, so the input's gradient is
  the sum of every rank's contribution.
* :func:`reduce_from_parallel` (*g*): all-reduce forward, identity backward. Put after a
  row-parallel layer: the partial products are summed; each rank's copy of the sum sends its
  gradient straight to its own partial product.
* :func:`gather_from_parallel`: concatenate the ranks' shards of the last axis; backward keeps
  this rank's slice. :func:`scatter_to_parallel`: the reverse.

Each op's gradient is the other op of its pair, so gradients of gradients work too. Data
travels through host memory (``cuda()`` arrays are copied to the host and back).

Example (two thread ranks):
    >>> import numpy as np, needle as ndl, needle.distributed as dist
    >>> def job(rank):
    ...     x = ndl.Tensor(np.array([1.0, 2.0], np.float32) * (rank + 1))
    ...     y = reduce_from_parallel(x)
    ...     return y.numpy().tolist()
    >>> dist.spawn_threads(job, 2)
    [[3.0, 6.0], [3.0, 6.0]]
"""
from __future__ import annotations

from typing import Any

import numpy as np

from needle.autograd import Tensor, TensorOp

from .. import _nccl
from .._buffers import to_device, to_host
from .._errors import ShapeError
from .._group import ProcessGroup, resolve
from ..collectives import all_gather, all_reduce


class CopyToParallel(TensorOp):
    """Identity forward; all-reduce of the gradient over ``group`` in backward."""

    save_inputs = ()

    def __init__(self, group: ProcessGroup):
        self.group = group

    def compute(self, a):
        return a

    def gradient(self, out_grad, node):
        return ReduceFromParallel(self.group)(out_grad)


class ReduceFromParallel(TensorOp):
    """All-reduce (sum) over ``group`` forward; identity backward."""

    save_inputs = ()

    def __init__(self, group: ProcessGroup):
        self.group = group

    def compute(self, a):
        if _nccl.route(self.group, a) is not None:  # on the device, through NCCL
            out = a.compact()
            out = _device_copy(out) if out is a else out
            all_reduce(out, op="sum", group=self.group)
            return out
        host = to_host(a)
        all_reduce(host, op="sum", group=self.group)
        return to_device(host, like=a)

    def gradient(self, out_grad, node):
        return CopyToParallel(self.group)(out_grad)


class GatherFromParallel(TensorOp):
    """Concatenate every rank's array along the last axis; backward keeps this rank's slice."""

    save_inputs = ()

    def __init__(self, group: ProcessGroup):
        self.group = group

    def compute(self, a):
        if _nccl.route(self.group, a) is not None:
            return _device_gather(a, self.group)
        host = to_host(a)
        parts = [np.empty_like(host) for _ in range(self.group.size)]
        all_gather(parts, host, group=self.group)
        return to_device(np.concatenate(parts, axis=-1), like=a)

    def gradient(self, out_grad, node):
        return ScatterToParallel(self.group)(out_grad)


class ScatterToParallel(TensorOp):
    """Keep this rank's equal slice of the last axis; backward gathers the slices."""

    save_inputs = ()

    def __init__(self, group: ProcessGroup):
        self.group = group

    def compute(self, a):
        size, rank = self.group.size, self.group.rank
        if a.shape[-1] % size:
            raise ShapeError(f"scatter_to_parallel: last dimension must divide among {size} "
                             f"ranks, expected a multiple of {size}, got shape {a.shape}")
        width = a.shape[-1] // size
        if _nccl.route(self.group, a) is not None:  # a device copy of this rank's slice
            return _device_copy(a[(slice(None),) * (a.ndim - 1) +
                                  (slice(rank * width, (rank + 1) * width),)])
        host = to_host(a)
        return to_device(host[..., rank * width:(rank + 1) * width], like=a)

    def gradient(self, out_grad, node):
        return GatherFromParallel(self.group)(out_grad)


def _device_copy(a: Any) -> Any:
    """A new compact NDArray on ``a``'s device holding ``a`` (a device copy)."""
    from needle.backend_ndarray.ndarray import NDArray

    out = NDArray.make(a.shape, device=a.device, dtype=a.dtype)
    out[tuple(slice(None) for _ in a.shape)] = a
    return out


def _device_gather(a: Any, group: ProcessGroup) -> Any:
    """Every rank's ``a`` side by side along the last axis, gathered by NCCL on the device."""
    from needle.backend_ndarray.ndarray import NDArray

    parts = [NDArray.make(a.shape, device=a.device, dtype=a.dtype) for _ in range(group.size)]
    all_gather(parts, a, group=group)
    width = a.shape[-1]
    out = NDArray.make(a.shape[:-1] + (width * group.size,), device=a.device, dtype=a.dtype)
    for r, part in enumerate(parts):
        out[(slice(None),) * (a.ndim - 1) + (slice(r * width, (r + 1) * width),)] = part
    return out


def _op(cls: type, x: Tensor, group: Any, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise ShapeError(f"{name}: expected a Tensor, got {type(x).__name__}")
    return cls(resolve(group, name))(x)


def copy_to_parallel(x: Tensor, group: Any = None) -> Tensor:
    """Identity; the gradient is all-reduced over ``group`` (before column-parallel layers)."""
    return _op(CopyToParallel, x, group, "copy_to_parallel")


def reduce_from_parallel(x: Tensor, group: Any = None) -> Tensor:
    """Sum over ``group``; the gradient passes unchanged (after row-parallel layers)."""
    return _op(ReduceFromParallel, x, group, "reduce_from_parallel")


def gather_from_parallel(x: Tensor, group: Any = None) -> Tensor:
    """Concatenate the ranks' shards along the last axis (every rank gets the whole)."""
    return _op(GatherFromParallel, x, group, "gather_from_parallel")


def scatter_to_parallel(x: Tensor, group: Any = None) -> Tensor:
    """This rank's slice of the last axis (the ranks' slices are equal)."""
    return _op(ScatterToParallel, x, group, "scatter_to_parallel")
