"""Multi-head attention split by heads over a tensor-parallel group.

Rank ``r`` of ``n`` holds heads ``r H/n .. (r + 1) H/n - 1``: the columns of ``q_proj``,
``k_proj`` and ``v_proj`` that produce them (column-parallel) and the matching rows of
``out_proj`` (row-parallel). Attention itself is per head, so the only communication is the
all-reduce after ``out_proj`` (and its conjugate on the input gradient in backward).
Same parameters, same output and same gradients as ``nn.MultiHeadAttention``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from needle import ops
from needle.autograd import Tensor
from needle.nn import Dropout, Identity, Module, MultiHeadAttention
from needle.nn.nn_attention import softmax_last_axis

from .._errors import ShapeError
from .._group import resolve
from .comm_ops import copy_to_parallel
from .layers import ColumnParallelLinear, RowParallelLinear

_MASKED = -1e9  # the value nn.MultiHeadAttention adds to masked scores


class ParallelMultiHeadAttention(Module):
    """``nn.MultiHeadAttention`` with its heads spread over ``group`` (``num_heads`` must be
    a multiple of the group size).

    Example (two thread ranks, 4 heads: 2 per rank):
        >>> import numpy as np, needle as ndl, needle.distributed as dist
        >>> from needle.distributed.tensor_parallel import ParallelMultiHeadAttention
        >>> def job(rank):
        ...     np.random.seed(0); ndl.random.seed(0)
        ...     attn = ParallelMultiHeadAttention(8, 4, causal=True)
        ...     return attn.local_heads, attn(ndl.Tensor(np.ones((2, 3, 8)))).shape
        >>> dist.spawn_threads(job, 2)
        [(2, (2, 3, 8)), (2, (2, 3, 8))]
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0,
                 causal: bool = False, bias: bool = True, group: Any = None,
                 device: Any = None, dtype: str = "float32"):
        super().__init__()
        full = MultiHeadAttention(embed_dim, num_heads, dropout, causal, bias, device, dtype)
        self._shard_from(full, group)

    @classmethod
    def from_full(cls, attn: MultiHeadAttention, group: Any = None
                  ) -> "ParallelMultiHeadAttention":
        """This rank's heads of ``attn`` (copied; ``attn`` is left as it is)."""
        layer = cls.__new__(cls)
        Module.__init__(layer)
        layer._shard_from(attn, group)
        return layer

    def _shard_from(self, attn: MultiHeadAttention, group: Any) -> None:
        pg = resolve(group, "ParallelMultiHeadAttention")
        if attn.num_heads % pg.size:
            raise ShapeError(f"ParallelMultiHeadAttention: num_heads must divide among "
                             f"{pg.size} ranks, expected a multiple of {pg.size}, got "
                             f"{attn.num_heads}")
        self.group = pg
        self.embed_dim, self.num_heads, self.head_dim = (attn.embed_dim, attn.num_heads,
                                                         attn.head_dim)
        self.local_heads = attn.num_heads // pg.size
        self.causal = attn.causal
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, ColumnParallelLinear.from_full(getattr(attn, name), pg,
                                                               copy_input=False))
        self.out_proj = RowParallelLinear.from_full(attn.out_proj, pg)
        self.dropout = attn.dropout if isinstance(attn.dropout, (Dropout, Identity)) \
            else Identity()

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return ops.transpose(ops.reshape(x, (b, t, self.local_heads, self.head_dim)), (1, 2))

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        if x.ndim != 3 or x.shape[2] != self.embed_dim:
            raise ShapeError(f"ParallelMultiHeadAttention: expected input (batch, time, "
                             f"{self.embed_dim}), got shape {x.shape}")
        x_all = copy_to_parallel(x, self.group)  # once for q, k and v: one all-reduce back
        ctx = x_all if context is None else copy_to_parallel(context, self.group)
        b, t, _ = x.shape
        s = ctx.shape[1]
        q = self._heads(self.q_proj(x_all))
        k = self._heads(self.k_proj(ctx))
        v = self._heads(self.v_proj(ctx))
        scores = (q @ ops.transpose(k, (2, 3))) / math.sqrt(self.head_dim)
        if self.causal:
            mask = np.triu(np.ones((t, s), np.float32), k=1 + (s - t)) * _MASKED
            mask_t = Tensor(mask.reshape(1, 1, t, s), device=scores.device, dtype=scores.dtype,
                            requires_grad=False)
            scores = scores + ops.broadcast_to(mask_t, scores.shape)
        attn = self.dropout(softmax_last_axis(scores))
        out = ops.reshape(ops.transpose(attn @ v, (1, 2)), (b, t, self.local_heads * self.head_dim))
        return self.out_proj(out)

    def full_parameters(self) -> list[np.ndarray]:
        """Parameters of the whole layer in ``nn.MultiHeadAttention`` order (collective)."""
        return [a for name in ("q_proj", "k_proj", "v_proj", "out_proj")
                for a in getattr(self, name).full_parameters()]
