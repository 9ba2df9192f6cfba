"""ZeRO data parallelism: optimizer state (stage 1), gradients (2) and weights (3) sharded
over the data-parallel ranks (docs/zero.md).

Example:
    >>> import needle.distributed as dist
    >>> dist.zero.shard_bounds(10, 4)
    [0, 2, 5, 7, 10]
"""
from __future__ import annotations

from ..collectives import shard_bounds
from ..flat_layout import FlatLayout, piece_bounds
from .data_parallel import ZeroDataParallel
from .optimizer import ZeroOptimizer

__all__ = ["ZeroDataParallel", "ZeroOptimizer", "FlatLayout", "piece_bounds",
           "shard_bounds"]
