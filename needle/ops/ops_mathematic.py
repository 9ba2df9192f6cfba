"""Elementwise, scalar and matrix ops of the course API, with their gradients.

Binary elementwise ops follow NumPy broadcasting (incompatible shapes raise
:class:`ShapeError`); gradients are summed back to each input's shape. In nd mode both
operands must share dtype and device (:class:`DTypeError` / :class:`DeviceError`); in np mode
NumPy's promotion applies, as in the course. Scalars take the tensor's dtype.

Example:
    >>> import needle as ndl
    >>> a = ndl.Tensor([[1.0, 2.0]]); b = ndl.Tensor([[10.0], [20.0]])
    >>> ndl.add(a, b).numpy().tolist()
    [[11.0, 12.0], [21.0, 22.0]]
"""
from __future__ import annotations

import numpy

from .._core.errors import DTypeError, ShapeError
from ..autograd import TensorOp, Value
from ..autograd.tensor import const as _leaf
from . import _array as A
from .ops_shape import (  # noqa: F401 - the course finds these in ops_mathematic
    BroadcastTo,
    Cast,
    Dilate,
    Flip,
    GetItem,
    Max,
    Permute,
    Reshape,
    SliceScatter,
    Summation,
    ToDevice,
    Transpose,
    UnDilate,
    astype,
    broadcast_to,
    dilate,
    flip,
    get_item,
    max,
    mean,
    permute,
    reshape,
    sum_to_shape,
    summation,
    to_device,
    transpose,
    undilate,
)


def as_scalar(value, op: str):
    """A Python number from ``value`` (number, NumPy scalar or 1-element array), else raise."""
    if isinstance(value, numpy.generic):  # first: numpy.float64 is also a Python float
        return value.item()
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, Value):
        raise DTypeError(
            f"{op}: expected a scalar (Python or NumPy number), got a Tensor of shape "
            f"{value.shape}; use the elementwise op instead")
    arr = numpy.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise DTypeError(f"{op}: expected a numeric scalar, got {type(value).__name__}")
    if arr.size != 1:
        raise ShapeError(
            f"{op}: expected a scalar (size 1), got a non-scalar of shape {arr.shape}")
    return arr.reshape(()).item()


def _bcast(op: str, a, b):
    shape = A.broadcast_shape(op, a.shape, b.shape)
    if tuple(a.shape) != shape:
        a = A.broadcast_to(a, shape)
    if tuple(b.shape) != shape:
        b = A.broadcast_to(b, shape)
    return a, b


_const = _leaf  # constant Tensor around an array (no graph)


class EWiseAdd(TensorOp):
    save_inputs = ()

    def compute(self, a, b):
        if a.shape != b.shape:
            a, b = _bcast("add", a, b)
        return a + b

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return sum_to_shape(out_grad, a.shape), sum_to_shape(out_grad, b.shape)

    def plain_gradient(self, out_grad, node):
        # the common case (same shapes) passes the gradient on: no op dispatch at all
        a, b = node.inputs
        shape = out_grad.cached_data.shape
        if a.shape == shape and b.shape == shape:
            return out_grad, out_grad
        return self.gradient(out_grad, node)


def add(a, b):
    return _ADD(a, b)


class AddScalar(TensorOp):
    save_inputs = ()

    def __init__(self, scalar):
        self.scalar = as_scalar(scalar, "add_scalar")

    def compute(self, a):
        return a + self.scalar

    def gradient(self, out_grad, node):
        return out_grad


def add_scalar(a, scalar):
    return AddScalar(scalar)(a)


class EWiseMul(TensorOp):
    def compute(self, a, b):
        if a.shape != b.shape:
            a, b = _bcast("multiply", a, b)
        return a * b

    def gradient(self, out_grad, node):
        a, b = node.saved_tensors
        return sum_to_shape(out_grad * b, a.shape), sum_to_shape(out_grad * a, b.shape)

    def plain_gradient(self, out_grad, node):
        a, b = node.saved_tensors
        g, x, y = out_grad.cached_data, a.cached_data, b.cached_data
        if x.shape != y.shape:
            x, y = _bcast("multiply", x, y)
        first, second = node.inputs
        need_a, need_b = first.requires_grad, second.requires_grad
        return (_const(A.sum_to_shape(g * y, a.shape)) if need_a else None,
                _const(A.sum_to_shape(g * x, b.shape)) if need_b else None)


def multiply(a, b):
    return _MUL(a, b)


class MulScalar(TensorOp):
    save_inputs = ()

    def __init__(self, scalar):
        self.scalar = as_scalar(scalar, "mul_scalar")

    def compute(self, a):
        return a * self.scalar

    def gradient(self, out_grad, node):
        return out_grad * self.scalar

    def plain_gradient(self, out_grad, node):
        return _const(out_grad.cached_data * self.scalar)


def mul_scalar(a, scalar):
    return MulScalar(scalar)(a)


class EWisePow(TensorOp):
    """``a ** b`` elementwise; gradients ``b·a^(b−1)`` and ``a^b·ln a``."""

    save_output = True

    def compute(self, a, b):
        if a.shape != b.shape:
            a, b = _bcast("power", a, b)
        return a ** b

    def gradient(self, out_grad, node):
        a, b, out = node.saved_tensors
        grad_a = out_grad * b * power(a, b - 1)
        grad_b = out_grad * out * log(a)
        return sum_to_shape(grad_a, a.shape), sum_to_shape(grad_b, b.shape)


def power(a, b):
    return EWisePow()(a, b)


class PowerScalar(TensorOp):
    """``a ** scalar`` for any real scalar (integers stay integers: negative bases work)."""

    def __init__(self, scalar):
        self.scalar = as_scalar(scalar, "power_scalar")

    def compute(self, a):
        return a ** self.scalar

    def gradient(self, out_grad, node):
        (a,) = node.saved_tensors
        if self.scalar == 0:
            return out_grad * 0
        return out_grad * (self.scalar * power_scalar(a, self.scalar - 1))


def power_scalar(a, scalar):
    return PowerScalar(scalar)(a)


class EWiseDiv(TensorOp):
    def compute(self, a, b):
        if a.shape != b.shape:
            a, b = _bcast("divide", a, b)
        return a / b

    def gradient(self, out_grad, node):
        a, b = node.saved_tensors
        grad_a = out_grad / b
        grad_b = -(out_grad * a) / (b * b)
        return sum_to_shape(grad_a, a.shape), sum_to_shape(grad_b, b.shape)


def divide(a, b):
    return EWiseDiv()(a, b)


class DivScalar(TensorOp):
    save_inputs = ()

    def __init__(self, scalar):
        self.scalar = as_scalar(scalar, "divide_scalar")

    def compute(self, a):
        return a / self.scalar

    def gradient(self, out_grad, node):
        return out_grad / self.scalar

    def plain_gradient(self, out_grad, node):
        return _const(out_grad.cached_data / self.scalar)


def divide_scalar(a, scalar):
    return DivScalar(scalar)(a)


class MaskedDivide(TensorOp):
    """``(x * mask) / divisor`` as one node (``nn.Dropout``'s train-mode output): the
    kernels of ``multiply`` then ``divide_scalar``, so bitwise their result, with one node
    to record and to visit in backward instead of two."""

    def __init__(self, divisor):
        self.divisor = as_scalar(divisor, "masked_divide")

    def compute(self, x, mask):
        if tuple(x.shape) != tuple(mask.shape):
            raise ShapeError(f"masked_divide: the mask must have the input's shape, expected "
                             f"{tuple(x.shape)}, got {tuple(mask.shape)}")
        return (x * mask) / self.divisor

    def gradient(self, out_grad, node):
        x, mask = node.saved_tensors
        scaled = out_grad / self.divisor  # the divide's gradient, then the product's
        return scaled * mask, scaled * x

    def plain_gradient(self, out_grad, node):
        x, mask = node.saved_tensors
        first, second = node.inputs
        scaled = out_grad.cached_data / self.divisor
        return (_const(scaled * mask.cached_data) if first.requires_grad else None,
                _const(scaled * x.cached_data) if second.requires_grad else None)


def masked_divide(x, mask, divisor):
    """``(x * mask) / divisor`` in one graph node; ``mask`` has ``x``'s shape.

    Example:
        >>> import needle as ndl
        >>> x, mask = ndl.Tensor([2.0, 4.0]), ndl.Tensor([1.0, 0.0])
        >>> masked_divide(x, mask, 0.5).numpy().tolist()
        [4.0, 0.0]

    Raises:
        ShapeError: a mask whose shape is not ``x``'s.
    """
    return MaskedDivide(divisor)(x, mask)


class Negate(TensorOp):
    save_inputs = ()

    def compute(self, a):
        return -a

    def gradient(self, out_grad, node):
        return -out_grad

    def plain_gradient(self, out_grad, node):
        return _const(-out_grad.cached_data)


def negate(a):
    return _NEG(a)


class Log(TensorOp):
    def compute(self, a):
        return A.log(a)

    def gradient(self, out_grad, node):
        (a,) = node.saved_tensors
        return out_grad / a


def log(a):
    return _LOG(a)


class Exp(TensorOp):
    save_inputs = ()
    save_output = True

    def compute(self, a):
        return A.exp(a)

    def gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        return out_grad * out

    def plain_gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        return _const(out_grad.cached_data * out.cached_data)


def exp(a):
    return _EXP(a)


class ReLU(TensorOp):
    save_inputs = ()
    save_output = True

    def compute(self, a):
        return A.maximum(a, 0)

    def gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        # out >= 0, so sign(out) is exactly the mask a > 0 (one kernel)
        mask = A.sign(out.realize_cached_data())
        return out_grad * _const(mask)

    def plain_gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        # out >= 0, so g * sign(out) is g masked by a > 0: one fused kernel
        return _const(A.relu_grad(out_grad.cached_data, out.realize_cached_data()))


def relu(a):
    return _RELU(a)


class Tanh(TensorOp):
    save_inputs = ()
    save_output = True

    def compute(self, a):
        return A.tanh(a)

    def gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        return out_grad * (1 - out * out)

    def plain_gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        # g * (1 - o * o) in one kernel instead of three
        return _const(A.tanh_grad(out_grad.cached_data, out.cached_data))


def tanh(a):
    return _TANH(a)


class Sqrt(TensorOp):
    save_inputs = ()
    save_output = True

    def compute(self, a):
        return A.sqrt(a)

    def gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        return out_grad / (out * 2)


def sqrt(a):
    return _SQRT(a)


class Sigmoid(TensorOp):
    save_inputs = ()
    save_output = True

    def compute(self, a):
        return A.sigmoid(a)

    def gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        return out_grad * out * (1 - out)

    def plain_gradient(self, out_grad, node):
        (out,) = node.saved_tensors
        o = out.cached_data
        return _const(out_grad.cached_data * (o * (1 - o)))


def sigmoid(a):
    return _SIGMOID(a)


class Maximum(TensorOp):
    """Elementwise maximum; on ties each input gets half the gradient (like PyTorch)."""

    def compute(self, a, b):
        if a.shape != b.shape:
            a, b = _bcast("maximum", a, b)
        return A.maximum(a, b)

    def gradient(self, out_grad, node):
        a, b = node.saved_tensors
        x, y = a.realize_cached_data(), b.realize_cached_data()
        if x.shape != y.shape:
            x, y = _bcast("maximum", x, y)
        # weight 1 where a wins, 0.5 on ties, 0 where b wins
        wa = A.as_float(x > y, x) + A.as_float(x == y, x) * 0.5
        ga = out_grad * _const(wa)
        return sum_to_shape(ga, a.shape), sum_to_shape(out_grad - ga, b.shape)


def maximum(a, b):
    return Maximum()(a, b)


class MatMul(TensorOp):
    """NumPy ``matmul`` for arrays with ≥ 2 dims, batched and broadcast over leading dims."""

    def compute(self, a, b):
        if len(a.shape) < 2 or len(b.shape) < 2:
            raise ShapeError(
                f"matmul: expected operands with at least 2 dims, got {tuple(a.shape)} @ "
                f"{tuple(b.shape)}")
        if a.shape[-1] != b.shape[-2]:
            raise ShapeError(
                f"matmul: inner dimensions differ, expected a.shape[-1] == b.shape[-2], got "
                f"{tuple(a.shape)} @ {tuple(b.shape)}")
        return A.matmul(a, b)

    def gradient(self, out_grad, node):
        a, b = node.saved_tensors
        grad_a = _MATMUL(out_grad, transpose(b))
        grad_b = _MATMUL(transpose(a), out_grad)
        return sum_to_shape(grad_a, a.shape), sum_to_shape(grad_b, b.shape)

    def plain_gradient(self, out_grad, node):
        a, b = node.saved_tensors
        first, second = node.inputs
        return _matmul_plain_gradients(out_grad.cached_data, a, b, first.requires_grad,
                                      second.requires_grad)


def _matmul_plain_gradients(g, a, b, need_a: bool, need_b: bool) -> tuple:
    """``(dA, dB)`` of ``A @ B`` for the output gradient array ``g`` as constant Tensors
    (None where not needed): MatMul's plain gradient, and nn.Linear's (ops_linear)."""
    x, y = a.cached_data, b.cached_data
    if len(x.shape) == 2 and len(y.shape) == 2:
        # the common case: two plain products, already of the inputs' shapes
        return (_const(g @ A.swap_last(y)) if need_a else None,
                _const(A.swap_last(x) @ g) if need_b else None)
    return (_const(A.sum_to_shape(A.matmul(g, A.swap_last(y)), a.shape)) if need_a else None,
            _const(A.sum_to_shape(A.matmul(A.swap_last(x), g), b.shape)) if need_b else None)


def matmul(a, b):
    return _MATMUL(a, b)


# Stateless ops are shared: saves an allocation on the hottest paths (Tensor operators and
# the activations).
_ADD = EWiseAdd()
_MUL = EWiseMul()
_NEG = Negate()
_MATMUL = MatMul()
_LOG = Log()
_EXP = Exp()
_RELU = ReLU()
_TANH = Tanh()
_SQRT = Sqrt()
_SIGMOID = Sigmoid()
