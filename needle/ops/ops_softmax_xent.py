"""Softmax cross-entropy from class labels as one graph node: ``softmax_cross_entropy``.

``nn.SoftmaxLoss`` composed from ops builds the one-hot targets on the host (n × k floats) and
records ``logsumexp``, a product with the one-hot, sums and a division; on a language model's
(320, 10000) logits that is ~8 passes over 12.8 MB forward and as many backward, each into a
new buffer. ``softmax_cross_entropy`` records one node: the C++ backend's
``softmax_xent_forward`` gives each row's ``logsumexp`` and loss in two passes, and the plain
backward is one ``softmax_xent_backward`` pass writing ``g (softmax(z) − onehot(y))``.
``reduction="mean"`` (what ``nn.SoftmaxLoss`` runs) makes the batch mean part of the same
node: its forward runs the kernels of ``summation(rows) / n`` after the rows' losses and its
backward hands every row ``g / n``, so the values are bitwise the composed mean's, and a
step visits one node instead of three (a small model's step is dispatch-bound).

Labels are class ids (any float dtype; integers in ``[0, k)``, checked by the kernel, which
raises :class:`~needle.IndexOutOfRange` naming the row). The C++ and CUDA backends (and the
NumPy reference) have the kernels; float16 and NumPy mode compute the same values with array
ops. With ``create_graph`` the
gradient is built from differentiable ops.

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import ops
    >>> z = ndl.Tensor(np.log(np.array([[1.0, 3.0], [2.0, 2.0]])))
    >>> y = ndl.Tensor([1.0, 0.0])
    >>> [round(float(v), 4) for v in ops.softmax_cross_entropy(z, y).numpy()]  # -log 3/4, -log 1/2
    [0.2877, 0.6931]
"""
from __future__ import annotations

import numpy as np

from .._core.errors import IndexOutOfRange, NeedleError, ShapeError
from ..autograd import TensorOp
from ..autograd.tensor import const as _leaf
from ..backend_ndarray.ndarray import NDArray
from ..backend_selection import BACKEND
from . import _array as A
from .ops_logarithmic import logsumexp
from .ops_mathematic import exp
from .ops_shape import broadcast_to, reshape

__all__ = ["SoftmaxCrossEntropy", "softmax_cross_entropy", "softmax_xent_has_kernel"]

_ND = BACKEND == "nd"


def _kernel_module(z):
    """The backend module when it has the softmax cross-entropy kernels for ``z``."""
    if not _ND:
        return None
    mod = getattr(z.device, "mod", None)
    if mod is None or not hasattr(mod, "softmax_xent_forward"):
        return None
    return mod if z.dtype in ("float32", "float64") else None


def softmax_xent_has_kernel(z) -> bool:
    """True when logits ``z`` (a Tensor) would run the fused kernels."""
    return _kernel_module(z.realize_cached_data()) is not None


def _check(z_shape, y_shape) -> tuple:
    if len(z_shape) != 2:
        raise ShapeError(f"softmax_cross_entropy: logits must be (batch, classes), expected 2 "
                         f"dimensions, got shape {tuple(z_shape)}")
    n, k = z_shape
    if tuple(y_shape) != (n,):
        raise ShapeError(f"softmax_cross_entropy: expected one label per row, shape ({n},), "
                         f"got {tuple(y_shape)}")
    if k == 0 and n:
        raise ShapeError("softmax_cross_entropy: expected at least one class, got shape "
                         f"{tuple(z_shape)}")
    return n, k


def _labels_like(y, z):
    return A.compact(y if y.dtype == z.dtype else A.astype(y, z.dtype))


def _run(kernel, *args):
    try:
        kernel(*args)
    except IndexError as exc:  # a label outside [0, k), found by the kernel's check
        raise IndexOutOfRange(str(exc)) from None


class SoftmaxCrossEntropy(TensorOp):
    """Per-row ``logsumexp(z) − z[y]`` of logits ``z`` (n, k) and labels ``y`` (n,).

    The rows' ``logsumexp`` is kept on the op (``lse``, n values) for the plain backward.
    ``y`` gets a zero gradient (when it requires one). ``mean``: the output is the rows'
    mean (a scalar) instead.
    """

    save_inputs = (0, 1)

    def __init__(self, mean: bool = False):
        self.lse = None
        self.mean = mean

    def held_arrays(self) -> tuple:
        return () if self.lse is None else (self.lse,)

    def release_held(self) -> None:
        self.lse = None

    def compute(self, z, y):
        rows = self._rows(z, y)
        if not self.mean:
            return rows
        # the composed mean's kernels: summation over the rows, then the scalar division
        return A.reduce_sum(rows, (0,)) / rows.shape[0]

    def _rows(self, z, y):
        n, k = _check(z.shape, y.shape)
        mod = _kernel_module(z)
        if mod is not None:
            z = z.compact()
            loss = NDArray.make((n,), device=z.device, dtype=z.dtype)
            self.lse = NDArray.make((n,), device=z.device, dtype=z.dtype)
            _run(mod.softmax_xent_forward, z._handle, _labels_like(y, z)._handle,
                 loss._handle, self.lse._handle, n, k)
            return loss
        picked = _one_hot_like(y, z)
        m = A.reduce_max(z, (1,), keepdims=True)
        lse = A.log(A.reduce_sum(A.exp(z - A.broadcast_to(m, z.shape)), (1,))) + \
            A.reshape(m, (n,))
        self.lse = lse
        return lse - A.reduce_sum(z * picked, (1,))

    def plain_gradient(self, out_grad, node):
        z, y = node.saved_tensors
        zd, yd, g = z.cached_data, y.cached_data, out_grad.cached_data
        n, k = zd.shape
        if self.mean:  # as the composed mean's backward: g / n, spread over the rows
            g = A.broadcast_to(A.reshape(A.compact(g / n), (1,)), (n,))
        mod = _kernel_module(zd)
        if mod is not None:
            zd = zd.compact()
            dz = NDArray.make((n, k), device=zd.device, dtype=zd.dtype)
            _run(mod.softmax_xent_backward, zd._handle, _labels_like(yd, zd)._handle,
                 self.lse._handle, A.compact(g)._handle, dz._handle, n, k)
            return _leaf(dz), _label_grad(node)
        soft = A.exp(zd - A.broadcast_to(A.reshape(self.lse, (n, 1)), (n, k)))
        weights = A.broadcast_to(A.reshape(A.compact(g), (n, 1)), (n, k))
        return _leaf((soft - _one_hot_like(yd, zd)) * weights), _label_grad(node)

    def gradient(self, out_grad, node):
        z, y = node.inputs
        n, k = z.shape
        if self.mean:
            out_grad = broadcast_to(reshape(out_grad / n, (1,)), (n,))
        soft = exp(z - broadcast_to(reshape(logsumexp(z, axes=(1,)), (n, 1)), (n, k)))
        picked = _leaf(_one_hot_like(y.realize_cached_data(), z.realize_cached_data()))
        weights = broadcast_to(reshape(out_grad, (n, 1)), (n, k))
        return (soft - picked) * weights, _label_grad(node)


def _label_grad(node):
    """Zeros for labels that require grad (the course's Tensors do by default): the loss is
    piecewise constant in them."""
    y = node.inputs[1]
    return _leaf(A.zeros(tuple(y.shape), y.realize_cached_data())) if y.requires_grad else None


def _one_hot_like(y, z):
    """One-hot rows of the labels ``y`` as an array like ``z`` (the composed path only)."""
    n, k = z.shape
    ids = np.asarray(A.to_numpy(y), dtype=np.float64).reshape(-1)
    bad = ~((ids >= 0) & (ids < k) & (ids == np.floor(ids)))
    if bad.any():
        i = int(np.argmax(bad))
        raise IndexOutOfRange(f"softmax_cross_entropy: class label out of range at row {i}, "
                              f"expected an integer in [0, {k}), got {float(ids[i])}")
    rows = np.zeros((n, k))
    rows[np.arange(n), ids.astype(np.int64)] = 1.0
    return A.from_numpy_like(rows, z)


def softmax_cross_entropy(logits, labels, reduction: str = "none"):
    """Per-row softmax cross-entropy ``logsumexp(z_i) − z_i[y_i]`` (shape (n,)), or with
    ``reduction="mean"`` their mean over the rows (a scalar, one graph node).

    Raises:
        ShapeError: logits not 2-D or labels not of shape (n,).
        IndexOutOfRange: a label that is not an integer in ``[0, k)``.
        NeedleError: a reduction other than "none" and "mean".
    """
    if reduction not in ("none", "mean"):
        raise NeedleError(f"softmax_cross_entropy: unknown reduction, expected 'none' or "
                          f"'mean', got {reduction!r}")
    return SoftmaxCrossEntropy(reduction == "mean")(logits, labels)
