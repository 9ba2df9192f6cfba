"""``linear(x, weight, bias)``: ``x @ weight + bias`` as one graph node (what ``nn.Linear`` runs).

Composed, a linear layer records three nodes (the product, the bias broadcast, the sum) and
four with an ``(out,)``-shaped bias (its reshape); a backward visits each. One node does the
same arithmetic: the forward runs the product, then adds the bias to it, here into the
product's own buffer and straight from the bias row where the backend has
``ewise_add_rows`` (two output-sized buffers fewer: the sum and the broadcast copy of the
bias), so its output is bitwise the composed one, and the plain backward
forms ``dx = g @ Wᵀ``, ``dW = xᵀ @ g`` and ``db`` (``g`` summed over every axis but the
last) with the kernels the composed backward uses. A small model's step is dispatch-bound:
an MLPResNet step records 47 nodes composed, 31 with this op (28 with Dropout's product
and quotient as one `masked_divide` node too).

``x`` is ``(..., in)`` with at least 2 dims (leading dims batched as ``matmul`` batches),
``weight`` ``(in, out)``, ``bias`` holds ``out`` values along its last axis (``(out,)``,
``(1, out)``) or is omitted. With ``create_graph`` the gradient is built from
differentiable ops (gradients of gradients work).

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import ops
    >>> x = ndl.Tensor(np.ones((2, 3))); w = ndl.Tensor(np.ones((3, 4)))
    >>> b = ndl.Tensor(np.arange(4.0).reshape(1, 4))
    >>> ops.linear(x, w, b).numpy().tolist()
    [[3.0, 4.0, 5.0, 6.0], [3.0, 4.0, 5.0, 6.0]]
"""
from __future__ import annotations

from .._core.errors import ShapeError
from ..autograd import TensorOp
from ..autograd.tensor import const as _leaf
from . import _array as A
from .ops_mathematic import _matmul_plain_gradients, matmul
from .ops_shape import reshape, summation, transpose

__all__ = ["FusedLinear", "linear"]


def _check(x_shape: tuple, w_shape: tuple, b_shape) -> None:
    if len(x_shape) < 2 or len(w_shape) != 2:
        raise ShapeError(f"linear: expected x with at least 2 dims and a 2-D weight, got "
                         f"x {tuple(x_shape)}, weight {tuple(w_shape)}")
    if x_shape[-1] != w_shape[0]:
        raise ShapeError(f"linear: input features differ, expected x.shape[-1] == "
                         f"weight.shape[0] == {w_shape[0]}, got x {tuple(x_shape)}")
    if b_shape is not None:
        A.check_row("linear", "output feature", b_shape, w_shape[1], len(x_shape))


def bias_gradient(out_grad, shape):
    """The gradient (a recorded graph) of a bias of ``shape`` added as a row to every row of
    an output with gradient ``out_grad``: summed over every axis but the last, reshaped."""
    return reshape(summation(out_grad, tuple(range(len(out_grad.shape) - 1))), tuple(shape))


class FusedLinear(TensorOp):
    """``x @ weight (+ bias)``; one node for the three (or four) of the composed layer."""

    save_inputs = (0, 1)  # the bias's value is not needed for any gradient

    def compute(self, x, w, b=None):
        _check(tuple(x.shape), tuple(w.shape), None if b is None else tuple(b.shape))
        y = x @ w if len(x.shape) == 2 else A.matmul(x, w)
        if b is None:
            return y
        # the sum written into the product's buffer, the bias read from its row (the
        # composed layer held the product, the broadcast bias and the sum apart)
        return A.add_row_to_fresh(y, b)

    def plain_gradient(self, out_grad, node):
        x, w = node.saved_tensors
        g, inputs = out_grad.cached_data, node.inputs
        dx, dw = _matmul_plain_gradients(g, x, w, inputs[0].requires_grad,
                                        inputs[1].requires_grad)
        if len(inputs) == 2:
            return dx, dw
        bias = inputs[2]
        return dx, dw, (_leaf(A.row_gradient(g, bias.shape)) if bias.requires_grad else None)

    def gradient(self, out_grad, node):
        x, w = node.inputs[0], node.inputs[1]
        dx = matmul(out_grad, transpose(w))
        dw = matmul(transpose(x), out_grad)
        if len(x.shape) > 2:
            dw = summation(dw, tuple(range(len(x.shape) - 2)))
        if len(node.inputs) == 2:
            return dx, dw
        return dx, dw, bias_gradient(out_grad, node.inputs[2].shape)


_LINEAR = FusedLinear()


def linear(x, weight, bias=None):
    """``x @ weight + bias`` (``bias`` optional) as one graph node; see the module docstring.

    Raises:
        ShapeError: x with fewer than 2 dims, a weight that is not 2-D, features that
            differ, or a bias that does not hold one value per output feature.
    """
    if bias is None:
        return _LINEAR(x, weight)
    return _LINEAR(x, weight, bias)
