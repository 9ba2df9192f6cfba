"""Row lookup (``embedding``): ``weight[ids]`` without building a one-hot matrix.

The course defines Embedding as ``one_hot(ids) @ weight``; the values are identical (each output
row is one weight row), but a 10k-word vocabulary makes that one-hot matrix 320 × 10,000 floats
per step of a small LSTM LM, plus its transposed copy in backward. Here the forward gathers rows
and the plain backward scatter-adds the gradient rows (repeated ids add up); with
``create_graph`` the gradient is written as ``one_hotᵀ @ grad`` so it stays differentiable.

Example:
    >>> import needle as ndl, numpy as np
    >>> w = ndl.Tensor(np.arange(6.0).reshape(3, 2), dtype="float32")
    >>> ndl.ops.embedding(w, ndl.Tensor([2, 0], dtype="float32")).numpy().tolist()
    [[4.0, 5.0], [0.0, 1.0]]
"""
from __future__ import annotations

import numpy

from .._core.errors import IndexOutOfRange, ShapeError
from ..autograd import Tensor, TensorOp
from ..autograd.tensor import const as _leaf
from . import _array as A
from .ops_mathematic import matmul
from .ops_shape import reshape, transpose


def _ids(ids_array, num_rows: int) -> numpy.ndarray:
    ids = numpy.asarray(A.to_numpy(ids_array)).astype(numpy.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_rows):
        bad = ids[(ids < 0) | (ids >= num_rows)][0]
        raise IndexOutOfRange(
            f"embedding: id out of range, expected ids in [0, {num_rows}), got {bad}")
    return ids


class EmbeddingLookup(TensorOp):
    """``weight[ids]``: ids of any shape → ``ids.shape + (dim,)``; no gradient for ``ids``."""

    save_inputs = (1,)

    def compute(self, weight, ids):
        if len(weight.shape) != 2:
            raise ShapeError(f"embedding: expected a 2-D weight (num, dim), got "
                             f"{tuple(weight.shape)}")
        rows = _ids(ids, weight.shape[0])
        return A.take_rows(weight, rows)

    def gradient(self, out_grad, node):
        weight, ids_input = node.inputs
        (ids,) = node.saved_tensors
        num, dim = weight.shape
        rows = _ids(ids.cached_data, num)
        # ids are integers: their gradient is zero wherever it exists (given only when asked)
        grad_ids = (_leaf(A.zeros(ids.shape, ids.cached_data)) if ids_input.requires_grad
                    else None)
        one_hot = numpy.zeros((rows.size, num), dtype=numpy.float32)
        one_hot[numpy.arange(rows.size), rows.reshape(-1)] = 1.0
        hot = Tensor(one_hot, device=out_grad.device, dtype=out_grad.dtype,
                     requires_grad=False)
        flat = reshape(out_grad, (rows.size, dim))
        return matmul(transpose(hot), flat), grad_ids

    def plain_gradient(self, out_grad, node):
        weight, ids_input = node.inputs
        (ids,) = node.saved_tensors
        num, dim = weight.shape
        rows = _ids(ids.cached_data, num)
        # ids are integers: their gradient is zero wherever it exists (given only when asked)
        grad_ids = (_leaf(A.zeros(ids.shape, ids.cached_data)) if ids_input.requires_grad
                    else None)
        g = A.to_numpy(out_grad.cached_data).reshape(-1, dim)
        total = numpy.zeros((num, dim), dtype=g.dtype)
        numpy.add.at(total, rows.reshape(-1), g)
        return _leaf(A.from_numpy_like(total, out_grad.cached_data)), grad_ids


def embedding(weight, ids):
    """Rows of ``weight`` picked by the integer values of ``ids``."""
    return EmbeddingLookup()(weight, ids)
