"""Tensor-parallel layers: W1 split by columns, W2 by rows, one all-reduce per pair.

For ``y = act(x W1) W2`` on ``n`` ranks, rank ``r`` holds columns ``r`` of ``W1`` and the
matching rows ``r`` of ``W2``: ``z_r = act(x W1_r)`` needs no communication (the activation
acts column by column), and ``y = sum_r z_r W2_r`` is one all-reduce. In backward the input
gradient is the sum of the ranks' contributions (an all-reduce behind the first layer) and
each shard gets its own weight gradient.

The worked example (2 ranks): x = [1, 2], W1a = I, W1b = 2I, W2a = W2b = I gives
z_a = [1, 2], z_b = [2, 4] and y = [3, 6] on both ranks; with d loss / d y = [1, 1] the input
gradient is [1, 1] + [2, 2] = [3, 3]; dW1a = dW1b = x^T [1, 1]; dW2a = z_a^T [1, 1],
dW2b = z_b^T [1, 1] — exactly the unsharded layer's gradients, split the same way.

Parameters are shards of a full layer initialised as ``nn.Linear`` would (so the same seed
gives the same model for every number of ranks); ``from_full`` shards an existing layer.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from needle import ops
from needle.autograd import Tensor
from needle.nn import BatchNorm1d, Linear, Module, Parameter, ReLU

from .._errors import ShapeError
from .._group import resolve
from ..collectives import all_gather
from .comm_ops import (
    copy_to_parallel,
    gather_from_parallel,
    reduce_from_parallel,
    scatter_to_parallel,
)


def shard(arr: np.ndarray, axis: int, rank: int, size: int, what: str) -> np.ndarray:
    """Slice ``rank`` of ``size`` equal slices of ``arr`` along ``axis``."""
    n = arr.shape[axis]
    if n % size:
        raise ShapeError(f"{what} must divide among {size} ranks, expected a multiple of "
                         f"{size}, got {n}")
    width = n // size
    index = [slice(None)] * arr.ndim
    index[axis] = slice(rank * width, (rank + 1) * width)
    return np.ascontiguousarray(arr[tuple(index)])


def _param(arr: np.ndarray, like: Tensor) -> Parameter:
    return Parameter(Tensor(arr, device=like.device, dtype=str(like.dtype)), requires_grad=True)


def gather_shards(t: Tensor, axis: int, group: Any) -> np.ndarray:
    """The whole array of which every rank of ``group`` holds an equal slice along ``axis``."""
    pg = resolve(group, "gather_shards")
    mine = np.ascontiguousarray(t.numpy())
    parts = [np.empty_like(mine) for _ in range(pg.size)]
    all_gather(parts, mine, group=pg)
    return np.concatenate(parts, axis=axis)


def _add_bias(y: Tensor, bias: Tensor) -> Tensor:
    shape = y.shape
    b = ops.reshape(bias, (1,) * (len(shape) - 1) + (shape[-1],))
    return y + ops.broadcast_to(b, shape)


class ColumnParallelLinear(Module):
    """``y = x W + b`` with ``W`` (in, out) and ``b`` split by output columns over ``group``.

    Args:
        gather_output: concatenate the ranks' outputs (every rank gets all ``out`` columns);
            otherwise each rank keeps its ``out / n`` columns (to feed a RowParallelLinear).
        copy_input: apply :func:`copy_to_parallel` to the input (off when the caller already
            did, as attention does once for its three projections).

    Raises:
        ShapeError: ``out_features`` not divisible by the group size.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, group: Any = None, device: Any = None,
                 dtype: str = "float32", copy_input: bool = True):
        super().__init__()
        self._shard_from(Linear(in_features, out_features, bias, device, dtype), group,
                         gather_output, copy_input)

    @classmethod
    def from_full(cls, linear: Linear, group: Any = None, gather_output: bool = False,
                  copy_input: bool = True) -> "ColumnParallelLinear":
        """This rank's column shard of ``linear`` (copied; ``linear`` is left as it is)."""
        layer = cls.__new__(cls)
        Module.__init__(layer)
        layer._shard_from(linear, group, gather_output, copy_input)
        return layer

    def _shard_from(self, linear: Linear, group: Any, gather_output: bool,
                    copy_input: bool) -> None:
        pg = resolve(group, "ColumnParallelLinear")
        self.group, self.gather_output, self.copy_input = pg, gather_output, copy_input
        self.in_features, self.out_features = linear.in_features, linear.out_features
        what = f"ColumnParallelLinear: out_features {linear.out_features}"
        self.weight = _param(shard(linear.weight.numpy(), 1, pg.rank, pg.size, what),
                             linear.weight)
        self.bias = None
        if linear.bias is not None:
            self.bias = _param(shard(linear.bias.numpy().reshape(1, -1), 1, pg.rank, pg.size,
                                     what), linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ShapeError(f"ColumnParallelLinear: input features differ, expected last "
                             f"dimension {self.in_features}, got shape {x.shape}")
        if self.copy_input:
            x = copy_to_parallel(x, self.group)
        y = x @ self.weight
        if self.bias is not None:
            y = _add_bias(y, self.bias)
        return gather_from_parallel(y, self.group) if self.gather_output else y

    def full_parameters(self) -> list[np.ndarray]:
        """[weight, bias] of the whole layer (collective over the group)."""
        out = [gather_shards(self.weight, 1, self.group)]
        if self.bias is not None:
            out.append(gather_shards(self.bias, 1, self.group))
        return out


class RowParallelLinear(Module):
    """``y = x W + b`` with ``W`` split by input rows over ``group``; the partial products are
    all-reduced, then the (replicated) bias is added.

    Args:
        input_is_parallel: the input already holds this rank's ``in / n`` features (the
            output of a ColumnParallelLinear); otherwise it is sliced here.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, group: Any = None, device: Any = None,
                 dtype: str = "float32"):
        super().__init__()
        self._shard_from(Linear(in_features, out_features, bias, device, dtype), group,
                         input_is_parallel)

    @classmethod
    def from_full(cls, linear: Linear, group: Any = None,
                  input_is_parallel: bool = True) -> "RowParallelLinear":
        """This rank's row shard of ``linear`` (copied; ``linear`` is left as it is)."""
        layer = cls.__new__(cls)
        Module.__init__(layer)
        layer._shard_from(linear, group, input_is_parallel)
        return layer

    def _shard_from(self, linear: Linear, group: Any, input_is_parallel: bool) -> None:
        pg = resolve(group, "RowParallelLinear")
        self.group, self.input_is_parallel = pg, input_is_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        what = f"RowParallelLinear: in_features {linear.in_features}"
        self.weight = _param(shard(linear.weight.numpy(), 0, pg.rank, pg.size, what),
                             linear.weight)
        self.bias = None
        if linear.bias is not None:
            self.bias = _param(linear.bias.numpy().reshape(1, -1), linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        local = self.in_features // self.group.size
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.group)
        if x.shape[-1] != local:
            raise ShapeError(f"RowParallelLinear: input features differ, expected last "
                             f"dimension {local} (this rank's shard), got shape {x.shape}")
        y = reduce_from_parallel(x @ self.weight, self.group)
        return _add_bias(y, self.bias) if self.bias is not None else y

    def full_parameters(self) -> list[np.ndarray]:
        out = [gather_shards(self.weight, 0, self.group)]
        if self.bias is not None:
            out.append(self.bias.numpy())
        return out


class ParallelMLP(Module):
    """``fc2(act(fc1(x)))`` with ``fc1`` column-parallel and ``fc2`` row-parallel: one
    all-reduce forward, one backward.

    Example (two thread ranks; the same seed gives the unsharded MLP's output):
        >>> import numpy as np, needle as ndl, needle.distributed as dist
        >>> from needle.distributed.tensor_parallel import ParallelMLP
        >>> def job(rank):
        ...     np.random.seed(0); ndl.random.seed(0)
        ...     mlp = ParallelMLP(4, 8)
        ...     return mlp(ndl.Tensor(np.ones((1, 4), np.float32))).shape
        >>> dist.spawn_threads(job, 2)
        [(1, 4), (1, 4)]
    """

    def __init__(self, in_features: int, hidden: int, out_features: int | None = None,
                 activation: Module | None = None, bias: bool = True, group: Any = None,
                 device: Any = None, dtype: str = "float32"):
        super().__init__()
        out_features = in_features if out_features is None else out_features
        self.fc1 = ColumnParallelLinear(in_features, hidden, bias, group=group, device=device,
                                        dtype=dtype)
        self.activation = activation if activation is not None else ReLU()
        self.fc2 = RowParallelLinear(hidden, out_features, bias, group=group, device=device,
                                     dtype=dtype)

    @classmethod
    def from_full(cls, fc1: Linear, fc2: Linear, activation: Module | None = None,
                  group: Any = None) -> "ParallelMLP":
        """Shard an existing ``fc2(act(fc1(x)))``."""
        mlp = cls.__new__(cls)
        Module.__init__(mlp)
        mlp.fc1 = ColumnParallelLinear.from_full(fc1, group)
        mlp.activation = activation if activation is not None else ReLU()
        mlp.fc2 = RowParallelLinear.from_full(fc2, group)
        return mlp

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class ShardedBatchNorm1d(BatchNorm1d):
    """BatchNorm1d over this rank's slice of the features (between a column- and a
    row-parallel layer): statistics are per feature, so each rank normalises its own."""

    @classmethod
    def from_full(cls, bn: BatchNorm1d, group: Any = None) -> "ShardedBatchNorm1d":
        pg = resolve(group, "ShardedBatchNorm1d")
        what = f"ShardedBatchNorm1d: dim {bn.dim}"
        weight = shard(bn.weight.numpy(), 0, pg.rank, pg.size, what)
        layer = cls(weight.shape[0], eps=bn.eps, momentum=bn.momentum,
                    device=bn.weight.device, dtype=str(bn.weight.dtype))
        layer.group = pg
        layer.weight = _param(weight, bn.weight)
        layer.bias = _param(shard(bn.bias.numpy(), 0, pg.rank, pg.size, what), bn.bias)
        for name in ("running_mean", "running_var"):
            full = getattr(bn, name)
            setattr(layer, name, Tensor(shard(full.numpy(), 0, pg.rank, pg.size, what),
                                        device=full.device, dtype=str(full.dtype),
                                        requires_grad=False))
        layer.training = bn.training
        return layer

    def full_parameters(self) -> list[np.ndarray]:
        return [gather_shards(self.weight, 0, self.group), gather_shards(self.bias, 0, self.group)]
