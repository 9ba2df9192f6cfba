"""Multi-head self-attention and a pre-norm Transformer block, built from needle ops only.

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import nn
    >>> np.random.seed(0); block = nn.TransformerBlock(8, num_heads=2, causal=True)
    >>> block(ndl.Tensor(np.ones((2, 5, 8)))).shape
    (2, 5, 8)
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops
from .._core.errors import NeedleError, ShapeError
from ..autograd import Tensor
from .nn_basic import Dropout, Identity, LayerNorm1d, Linear, ReLU, Sequential
from .nn_module import Module

__all__ = ["MultiHeadAttention", "TransformerBlock", "softmax_last_axis"]

_MASKED = -1e9  # finite, so masked rows never produce inf - inf in backward


def _dropout(p: float) -> Module:
    # p == 0 gets no Dropout at all: the course's Dropout draws from the RNG even at p = 0.
    return Dropout(p) if p > 0 else Identity()


def softmax_last_axis(x: Tensor) -> Tensor:
    """exp(x - logsumexp(x)) over the last axis (stable for large inputs)."""
    shape = x.shape
    lse = ops.logsumexp(x, axes=(len(shape) - 1,))
    return ops.exp(x - ops.broadcast_to(ops.reshape(lse, shape[:-1] + (1,)), shape))


def _causal_mask(t: int, s: int, device, dtype) -> Tensor:
    # Query i may attend to keys j <= i (+ offset when keys are longer than queries).
    mask = np.triu(np.ones((t, s), dtype=np.float32), k=1 + (s - t)) * _MASKED
    return Tensor(mask.reshape(1, 1, t, s), device=device, dtype=dtype, requires_grad=False)


class MultiHeadAttention(Module):
    """Scaled dot-product attention over ``num_heads`` heads of ``embed_dim // num_heads``.

    ``forward(x (B, T, D), context=None)``: queries from ``x``; keys/values from ``context``
    (default ``x``). ``causal=True`` masks keys after each query. Parameters: ``q_proj``,
    ``k_proj``, ``v_proj``, ``out_proj`` (Linear D→D, created in that order).
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, causal=False, bias=True,
                 device=None, dtype="float32"):
        super().__init__()
        if embed_dim % num_heads:
            raise NeedleError(f"MultiHeadAttention: embed_dim must divide into heads, expected "
                              f"a multiple of {num_heads}, got {embed_dim}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.q_proj = Linear(embed_dim, embed_dim, bias, device, dtype)
        self.k_proj = Linear(embed_dim, embed_dim, bias, device, dtype)
        self.v_proj = Linear(embed_dim, embed_dim, bias, device, dtype)
        self.out_proj = Linear(embed_dim, embed_dim, bias, device, dtype)
        self.dropout = _dropout(dropout)

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return ops.transpose(ops.reshape(x, (b, t, self.num_heads, self.head_dim)), (1, 2))

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        if x.ndim != 3 or x.shape[2] != self.embed_dim:
            raise ShapeError(f"MultiHeadAttention: expected input (batch, time, "
                             f"{self.embed_dim}), got shape {x.shape}")
        context = x if context is None else context
        b, t, d = x.shape
        s = context.shape[1]
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(context))
        v = self._heads(self.v_proj(context))
        scores = (q @ ops.transpose(k, (2, 3))) / math.sqrt(self.head_dim)  # (B, H, T, S)
        if self.causal:
            mask = _causal_mask(t, s, scores.device, scores.dtype)
            scores = scores + ops.broadcast_to(mask, scores.shape)
        attn = self.dropout(softmax_last_axis(scores))
        out = ops.reshape(ops.transpose(attn @ v, (1, 2)), (b, t, d))
        return self.out_proj(out)


class TransformerBlock(Module):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``+ ff(ln2(x))`` with a ReLU MLP.

    Parameters in creation order: ``ln1``, ``attn``, ``ln2``, ``ff`` (Linear D→hidden, ReLU,
    Dropout, Linear hidden→D).
    """

    def __init__(self, dim, num_heads, hidden_dim=None, dropout=0.0, causal=False,
                 device=None, dtype="float32"):
        super().__init__()
        hidden_dim = 4 * dim if hidden_dim is None else hidden_dim
        self.ln1 = LayerNorm1d(dim, device=device, dtype=dtype)
        self.attn = MultiHeadAttention(dim, num_heads, dropout, causal, device=device,
                                       dtype=dtype)
        self.ln2 = LayerNorm1d(dim, device=device, dtype=dtype)
        self.ff = Sequential(Linear(dim, hidden_dim, device=device, dtype=dtype), ReLU(),
                             _dropout(dropout), Linear(hidden_dim, dim, device=device,
                                                      dtype=dtype))
        self.dropout = _dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.ff(self.ln2(x)))
