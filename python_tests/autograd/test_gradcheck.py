"""gradcheck rejects what it must: planted wrong gradient rules, NaN and Inf.

Every op test leans on gradcheck, so each case here plants a bug in a small op (a
subclass of a real op, or a tiny op of its own, with a wrong gradient rule) and asserts that
gradcheck raises ``GraphError``. The controls run the same functions with the right rule.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle.ops as ops
from needle._core.errors import GraphError
from needle.autograd import Tensor, TensorOp, gradcheck
from needle.autograd.tensor import const
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode tests (np mode: subprocess)")


def _x(shape, seed=0, low=None):
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shape)
    return data if low is None else np.abs(data) + low


# ----- planted wrong gradient rules ---------------------------------------------------------
class ExpMissingFactor(ops.Exp):
    """d exp(x) = out_grad (forgets the exp(x) factor)."""

    def gradient(self, out_grad, node):
        return out_grad

    plain_gradient = gradient


class MulWrongSecondInput(ops.EWiseMul):
    """Right for a, but b's gradient uses b instead of a."""

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return out_grad * b, out_grad * b

    plain_gradient = gradient


class MatMulUntransposed(ops.MatMul):
    """grad_a = out_grad @ b instead of out_grad @ b.T (square shapes: no shape error)."""

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return out_grad @ b, ops.transpose(a) @ out_grad

    plain_gradient = gradient


class SumAsMean(ops.Summation):
    """The gradient of a sum scaled like a mean's."""

    def gradient(self, out_grad, node):
        shape = node.inputs[0].shape
        return ops.Summation.gradient(self, out_grad, node) / shape[1]

    plain_gradient = gradient


class ReluLeaky(ops.ReLU):
    """Passes the gradient through where the input is negative too (wrong on some elements)."""

    def gradient(self, out_grad, node):
        return out_grad

    plain_gradient = gradient


class TanhWrongAtOneElement(ops.Tanh):
    """Right everywhere except the element at flat index 3."""

    def gradient(self, out_grad, node):
        right = ops.Tanh.gradient(self, out_grad, node)
        mask = np.ones(node.shape)
        mask.flat[3] = 0.5
        return right * const(Tensor(mask, device=right.device, dtype=right.dtype,
                                    requires_grad=False).realize_cached_data())

    plain_gradient = gradient


class NanGradient(ops.Exp):
    def gradient(self, out_grad, node):
        return out_grad * float("nan")

    plain_gradient = gradient


class LogNoGuard(TensorOp):
    """log with a right rule; NaN for negative inputs, -inf at 0."""

    save_inputs = (0,)

    def compute(self, a):
        return a.log()

    def gradient(self, out_grad, node):
        return out_grad / node.inputs[0]


class Reciprocal(TensorOp):
    """1/x with a deliberately wrong gradient: Inf forward at 0 must fail by itself."""

    save_inputs = (0,)

    def compute(self, a):
        return a ** -1.0

    def gradient(self, out_grad, node):
        return out_grad * 0.0


WRONG = [
    ("exp", lambda x: ExpMissingFactor()(x), [_x((2, 3))]),
    ("mul_second_input", lambda a, b: MulWrongSecondInput()(a, b), [_x((3,)), _x((3,), 1)]),
    ("matmul_untransposed", lambda a, b: MatMulUntransposed()(a, b),
     [_x((3, 3)), _x((3, 3), 1)]),
    ("sum_as_mean", lambda x: SumAsMean((1,))(x), [_x((2, 4))]),
    ("relu_leaky", lambda x: ReluLeaky()(x), [_x((2, 3))]),
    ("tanh_one_element", lambda x: TanhWrongAtOneElement()(x), [_x((2, 3))]),
    ("nan_backward", lambda x: NanGradient()(x), [_x((3,))]),
    # inputs above the elementwise limit: checked along random directions
    ("exp_large", lambda x: ExpMissingFactor()(x), [_x((20, 30)) * 0.1]),
    ("mul_large", lambda a, b: MulWrongSecondInput()(a, b), [_x((500,)), _x((500,), 1)]),
]

RIGHT = [
    ("exp", lambda x: ops.exp(x), [_x((2, 3))]),
    ("mul", lambda a, b: a * b, [_x((3,)), _x((3,), 1)]),
    ("matmul", lambda a, b: a @ b, [_x((3, 3)), _x((3, 3), 1)]),
    ("sum", lambda x: ops.summation(x, axes=(1,)), [_x((2, 4))]),
    ("relu", lambda x: ops.relu(x), [_x((2, 3))]),
    ("tanh", lambda x: ops.tanh(x), [_x((2, 3))]),
    ("exp_large", lambda x: ops.exp(x), [_x((20, 30)) * 0.1]),
    ("mul_large", lambda a, b: a * b, [_x((500,)), _x((500,), 1)]),
]


@pytest.mark.parametrize("name,fn,arrays", WRONG, ids=[w[0] for w in WRONG])
def test_planted_wrong_gradient_is_rejected(name, fn, arrays, device):
    tensors = [Tensor(a, device=device, dtype="float64") for a in arrays]
    with pytest.raises(GraphError, match="gradcheck"):
        gradcheck(fn, *tensors)


@pytest.mark.parametrize("name,fn,arrays", RIGHT, ids=[r[0] for r in RIGHT])
def test_right_gradient_passes(name, fn, arrays, device):
    tensors = [Tensor(a, device=device, dtype="float64") for a in arrays]
    assert gradcheck(fn, *tensors) is True


def test_nan_forward_fails_even_with_a_right_rule(device):
    x = Tensor(np.array([-1.0, 2.0]), device=device, dtype="float64")
    with pytest.raises(GraphError, match="gradcheck.*(NaN|nan)"):
        gradcheck(lambda a: LogNoGuard()(a), x)


def test_nan_forward_with_wrong_rule_fails(device):
    """The issue's case: NaN everywhere made every comparison False, and gradcheck passed."""

    class LogWrong(LogNoGuard):
        def gradient(self, out_grad, node):
            return out_grad * 123.0

    x = Tensor(np.array([-1.0, -2.0]), device=device, dtype="float64")
    with pytest.raises(GraphError, match="gradcheck"):
        gradcheck(lambda a: LogWrong()(a), x)


def test_inf_forward_fails(device):
    x = Tensor(np.array([0.0, 2.0]), device=device, dtype="float64")
    with pytest.raises(GraphError, match="gradcheck.*(Inf|inf)"):
        gradcheck(lambda a: Reciprocal()(a), x)


def test_nan_only_near_the_point_fails(device):
    """Finite at x, NaN at x - eps: the central difference is NaN and must not pass."""
    x = Tensor(np.array([1e-7, 2.0]), device=device, dtype="float64")
    with pytest.raises(GraphError, match="gradcheck"):
        gradcheck(lambda a: LogNoGuard()(a), x, eps=1e-6)


def test_right_log_passes_where_defined(device):
    x = Tensor(np.array([0.5, 2.0]), device=device, dtype="float64")
    assert gradcheck(lambda a: LogNoGuard()(a), x)


def test_error_names_input_and_values(device):
    a = Tensor(_x((3,)), device=device, dtype="float64")
    b = Tensor(_x((3,), 1), device=device, dtype="float64")
    with pytest.raises(GraphError) as info:
        gradcheck(lambda p, q: MulWrongSecondInput()(p, q), a, b)
    msg = str(info.value)
    assert "input 1" in msg and "expected" in msg and "got" in msg
