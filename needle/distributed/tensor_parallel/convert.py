"""Shard whole ``Sequential`` models, and gather their full parameters back.

:func:`parallelize_sequential` rewrites, in every ``Sequential`` (nested ones and
``Residual`` bodies included), each run ``Linear, [ReLU | Tanh | Sigmoid | Dropout | Identity |
BatchNorm1d]..., Linear`` whose hidden width divides among the ranks into
``ColumnParallelLinear, ..., RowParallelLinear`` (BatchNorm1d sharded by feature), shards every
``nn.MultiHeadAttention`` by heads, and turns a remaining ``Linear`` whose output divides into
``ColumnParallelLinear(gather_output=True)``. Anything else is kept (replicated).

Dropout between the pair draws its mask for this rank's features only, so in training mode the
masks differ from the unsharded model's; without dropout the sharded model computes the same
function (up to float summation order).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from needle.nn import (
    BatchNorm1d,
    Dropout,
    Identity,
    Linear,
    Module,
    MultiHeadAttention,
    Parameter,
    ReLU,
    Residual,
    Sequential,
    Sigmoid,
    Tanh,
)

from .._group import resolve
from .attention import ParallelMultiHeadAttention
from .layers import ColumnParallelLinear, RowParallelLinear, ShardedBatchNorm1d

_BETWEEN = (ReLU, Tanh, Sigmoid, Dropout, Identity, BatchNorm1d)


def _pair_end(layers: list, i: int, size: int) -> int | None:
    """Index of the Linear that closes a column/row pair opened by ``layers[i]``, or None."""
    first = layers[i]
    if not isinstance(first, Linear) or first.out_features % size:
        return None
    j = i + 1
    while j < len(layers) and isinstance(layers[j], _BETWEEN):
        if isinstance(layers[j], BatchNorm1d) and layers[j].dim != first.out_features:
            return None
        j += 1
    if j < len(layers) and isinstance(layers[j], Linear) \
            and layers[j].in_features == first.out_features:
        return j
    return None


def _convert(module: Any, pg: Any) -> Any:
    if isinstance(module, Sequential):
        return Sequential(*_convert_list(list(module.modules), pg))
    if isinstance(module, Residual):
        return Residual(_convert(module.fn, pg))
    if isinstance(module, MultiHeadAttention) and module.num_heads % pg.size == 0:
        return ParallelMultiHeadAttention.from_full(module, pg)
    if isinstance(module, Linear) and module.out_features % pg.size == 0:
        return ColumnParallelLinear.from_full(module, pg, gather_output=True)
    return module


def _convert_list(layers: list, pg: Any) -> list:
    out, i = [], 0
    while i < len(layers):
        j = _pair_end(layers, i, pg.size)
        if j is None:
            out.append(_convert(layers[i], pg))
            i += 1
            continue
        out.append(ColumnParallelLinear.from_full(layers[i], pg))
        for mid in layers[i + 1:j]:
            out.append(ShardedBatchNorm1d.from_full(mid, pg) if isinstance(mid, BatchNorm1d)
                       else mid)
        out.append(RowParallelLinear.from_full(layers[j], pg))
        i = j + 1
    return out


def parallelize_sequential(model: Any, group: Any = None) -> Any:
    """A tensor-parallel copy of ``model`` for this rank of ``group`` (see the module doc).

    Example (two thread ranks):
        >>> import numpy as np, needle as ndl, needle.distributed as dist
        >>> from needle import nn
        >>> def job(rank):
        ...     np.random.seed(0)
        ...     m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ...     return [type(x).__name__ for x in parallelize_sequential(m).modules]
        >>> dist.spawn_threads(job, 2)[0]
        ['ColumnParallelLinear', 'ReLU', 'RowParallelLinear']
    """
    return _convert(model, resolve(group, "parallelize_sequential"))


def gather_full_parameters(module: Any) -> list[np.ndarray]:
    """Every parameter of the unsharded model, in its ``parameters()`` order, as NumPy arrays
    (collective over the tensor-parallel groups of the sharded layers)."""
    out: list[np.ndarray] = []
    seen: set[int] = set()
    _gather(module.__dict__ if isinstance(module, Module) else module, out, seen)
    return out


def _gather(value: Any, out: list, seen: set) -> None:
    if id(value) in seen:
        return
    if hasattr(value, "full_parameters") and isinstance(value, Module):
        seen.add(id(value))
        out.extend(value.full_parameters())
    elif isinstance(value, Parameter):
        seen.add(id(value))
        out.append(value.numpy())
    elif isinstance(value, Module):
        _gather(value.__dict__, out, seen)
    elif isinstance(value, dict):
        for item in value.values():
            _gather(item, out, seen)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _gather(item, out, seen)


def replicated_parameters(module: Any) -> list:
    """The parameters of ``module`` that every rank of its tensor-parallel group holds whole
    (a ``RowParallelLinear``'s bias, every layer left unsharded), in ``parameters()`` order.

    Their gradients are the same on every rank of the group, so a norm over the group counts
    them once (``needle.distributed.clip_grad_norm(..., replicated=...)``); the other
    parameters are shards whose squared sums add up to the whole layer's.

    Example (two thread ranks):
        >>> import numpy as np, needle.distributed as dist
        >>> from needle import nn
        >>> def job(rank):
        ...     np.random.seed(0)
        ...     m = parallelize_sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
        ...                                              nn.Linear(8, 3), nn.LayerNorm1d(3)))
        ...     return [tuple(p.shape) for p in replicated_parameters(m)]
        >>> dist.spawn_threads(job, 2)[0]
        [(1, 3), (3,), (3,)]
    """
    sharded: set[int] = set()
    for m in [module, *module._children()] if isinstance(module, Module) else []:
        if isinstance(m, (ColumnParallelLinear, ShardedBatchNorm1d)):
            sharded.update(id(p) for p in (m.weight, m.bias) if p is not None)
        elif isinstance(m, RowParallelLinear):
            sharded.add(id(m.weight))  # its bias is added after the all-reduce: replicated
    params = module.parameters() if isinstance(module, Module) else []
    return [p for p in params if id(p) not in sharded]
