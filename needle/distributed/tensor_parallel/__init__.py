"""Tensor parallelism: layers whose weights are split over the ranks of a process group.

``ColumnParallelLinear`` / ``RowParallelLinear`` (with ``from_full`` to shard an existing
``nn.Linear``), ``ParallelMLP``, ``ParallelMultiHeadAttention`` (heads split over ranks),
``ShardedBatchNorm1d``, the conjugate communication ops (``copy_to_parallel``,
``reduce_from_parallel``, ``gather_from_parallel``, ``scatter_to_parallel``), and
``parallelize_sequential`` / ``gather_full_parameters`` / ``replicated_parameters`` for whole
models. See
``docs/tensor_parallel.md``.

Example (the worked example on two thread ranks: x = [1, 2], W1a = I, W1b = 2I,
W2a = W2b = I gives [3, 6] on both ranks):
    >>> import numpy as np, needle as ndl, needle.distributed as dist
    >>> from needle import nn
    >>> from needle.distributed import tensor_parallel as tp
    >>> def job(rank):
    ...     fc1, fc2 = nn.Linear(2, 4, bias=False), nn.Linear(4, 2, bias=False)
    ...     fc1.weight.data = ndl.Tensor(np.hstack([np.eye(2), 2 * np.eye(2)]).astype("f4"))
    ...     fc2.weight.data = ndl.Tensor(np.vstack([np.eye(2), np.eye(2)]).astype("f4"))
    ...     mlp = tp.ParallelMLP.from_full(fc1, fc2, activation=nn.Identity())
    ...     return mlp(ndl.Tensor(np.array([[1.0, 2.0]], "f4"))).numpy().tolist()
    >>> dist.spawn_threads(job, 2)
    [[[3.0, 6.0]], [[3.0, 6.0]]]
"""
from __future__ import annotations

from .attention import ParallelMultiHeadAttention
from .comm_ops import (
    copy_to_parallel,
    gather_from_parallel,
    reduce_from_parallel,
    scatter_to_parallel,
)
from .convert import gather_full_parameters, parallelize_sequential, replicated_parameters
from .layers import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    ShardedBatchNorm1d,
    gather_shards,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP",
           "ParallelMultiHeadAttention", "ShardedBatchNorm1d", "copy_to_parallel",
           "reduce_from_parallel", "gather_from_parallel", "scatter_to_parallel",
           "parallelize_sequential", "gather_full_parameters", "gather_shards",
           "replicated_parameters"]
