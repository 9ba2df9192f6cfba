"""Row lookup (``embedding``): ``weight[ids]`` without building a one-hot matrix.

The course defines Embedding as ``one_hot(ids) @ weight``; the values are identical (each output
row is one weight row), but a 10k-word vocabulary makes that one-hot matrix 320 × 10,000 floats
per step of a small LSTM LM, plus its transposed copy in backward. Here the forward gathers rows
and the plain backward scatter-adds the gradient rows (repeated ids add up); with
``create_graph`` the gradient is written as ``one_hotᵀ @ grad`` so it stays differentiable.

Backends with the ``embedding_forward``/``embedding_backward`` kernels (C++, the NumPy
reference) read the ids on the device: no host round trip, so a compiled step stays a kernel
program. Others (CUDA, NumPy mode) read them on the host. Either way an id that is not an
integer in ``[0, num)`` raises :class:`~needle.IndexOutOfRange`.

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
from ..backend_ndarray.ndarray_checks import check_class_ids
from ..backend_selection import NDArray
from . import _array as A
from .ops_mathematic import matmul
from .ops_shape import reshape, transpose


def _ids(ids_array, num_rows: int) -> numpy.ndarray:
    """The ids as int64 (same shape), checked as the embedding kernels check them."""
    raw = numpy.asarray(A.to_numpy(ids_array))
    try:
        flat = check_class_ids(raw.reshape(-1), num_rows, "embedding: id out of range at position")
    except IndexError as exc:
        raise IndexOutOfRange(str(exc)) from None
    return flat.reshape(raw.shape)


def _kernels(weight, ids):
    """The backend module when it has the embedding kernels for these arrays, else None."""
    if not isinstance(weight, NDArray) or not isinstance(ids, NDArray):
        return None
    mod = getattr(weight.device, "mod", None)
    if mod is None or not hasattr(mod, "embedding_forward") \
            or weight.dtype not in ("float32", "float64"):
        return None
    return mod


def _device_ids(ids, weight):
    """``ids`` as a compact array of the weight's dtype (the kernels' id format)."""
    ids = ids if ids.dtype == weight.dtype else ids.astype(weight.dtype)
    return ids.compact()


def _run(kernel, *args) -> None:
    try:
        kernel(*args)
    except IndexError as exc:  # an id outside [0, num), found by the kernel's check
        raise IndexOutOfRange(str(exc)) from None


class EmbeddingLookup(TensorOp):
    """``weight[ids]``: ids of any shape → ``ids.shape + (dim,)``; no gradient for ``ids``."""

    save_inputs = (1,)

    def compute(self, weight, ids):
        if len(weight.shape) != 2:
            raise ShapeError(f"embedding: expected a 2-D weight (num, dim), got "
                             f"{tuple(weight.shape)}")
        mod = _kernels(weight, ids)
        if mod is not None:
            num, dim = weight.shape
            flat = _device_ids(ids, weight)
            out = NDArray.make(tuple(ids.shape) + (dim,), device=weight.device,
                               dtype=weight.dtype)
            _run(mod.embedding_forward, weight.compact()._handle, flat._handle, out._handle,
                 num, dim, flat.size)
            return out
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
        # ids are integers: their gradient is zero wherever it exists (given only when asked)
        grad_ids = (_leaf(A.zeros(ids.shape, ids.cached_data)) if ids_input.requires_grad
                    else None)
        g_array = out_grad.cached_data
        mod = _kernels(g_array, ids.cached_data)
        if mod is not None:
            flat = _device_ids(ids.cached_data, g_array)
            dweight = NDArray.make((num, dim), device=g_array.device, dtype=g_array.dtype)
            _run(mod.embedding_backward, g_array.compact()._handle, flat._handle,
                 dweight._handle, num, dim, flat.size)
            return _leaf(dweight), grad_ids
        rows = _ids(ids.cached_data, num)
        g = A.to_numpy(out_grad.cached_data).reshape(-1, dim)
        total = numpy.zeros((num, dim), dtype=g.dtype)
        numpy.add.at(total, rows.reshape(-1), g)
        return _leaf(A.from_numpy_like(total, out_grad.cached_data)), grad_ids


def embedding(weight, ids):
    """Rows of ``weight`` picked by the integer values of ``ids``."""
    return EmbeddingLookup()(weight, ids)
