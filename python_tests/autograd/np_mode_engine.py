"""Run by test_autograd_engine.py in a subprocess with NEEDLE_BACKEND=np (course semantics)."""
from __future__ import annotations

import numpy as np

import needle.ops as ops
from needle.autograd import Tensor, find_topo_sort
from needle.backend_selection import BACKEND


def test_mode():
    assert BACKEND == "np"


def test_gradient_of_gradient_course_case():
    x2, x3 = Tensor([6.0]), Tensor([4.0])
    y = x2 * x2 + x2 * x3
    y.backward()
    grad_x2, grad_x3 = x2.grad, x3.grad
    np.testing.assert_allclose(grad_x2.numpy(), [16.0])
    np.testing.assert_allclose(grad_x3.numpy(), [6.0])
    x2.grad.backward()
    np.testing.assert_allclose(x2.grad.numpy(), [2.0])
    np.testing.assert_allclose(x3.grad.numpy(), [1.0])


def test_grad_assigned_on_every_node_not_accumulated():
    a = Tensor(np.random.randn(3))
    b = ops.exp(a)
    c = b.sum()
    c.backward()
    first = a.grad.numpy()
    assert b.grad is not None and c.grad is not None
    c.backward()  # graph retained by default in np mode
    np.testing.assert_allclose(a.grad.numpy(), first)


def test_topo_sort_course_expression():
    a, b = Tensor(np.random.randn(2)), Tensor(np.random.randn(2))
    result = 3 * a * a + 4 * b * a - a
    kinds = [type(n.op).__name__ if n.op is not None else "leaf"
             for n in find_topo_sort([result])]
    assert kinds == ["leaf", "MulScalar", "EWiseMul", "leaf", "MulScalar", "EWiseMul",
                     "EWiseAdd", "Negate", "EWiseAdd"]


def test_numpy_one_element_scalar_and_dtypes():
    a = Tensor(np.random.randn(2, 3))
    assert a.dtype == np.float64
    s = np.random.randn(1)
    np.testing.assert_allclose(ops.add_scalar(a, s).numpy(), a.numpy() + s[0])
    f = Tensor(np.ones(3), dtype="float32")
    assert (f * np.float64(2.5)).dtype == np.float32  # scalars adopt the tensor's dtype
    assert f.device == Tensor([1.0]).device
    assert "cpu" in repr(f.device)


def test_hooks_work_in_np_mode():
    x = Tensor(np.ones(2))
    calls = []
    x.register_hook(lambda g: calls.append(g.numpy()))
    (x * 3).sum().backward()
    np.testing.assert_allclose(calls[0], [3.0, 3.0])


def test_data_assignment_after_forward_raises_in_np_mode():
    import pytest

    from needle._core.errors import GraphError

    x, w = Tensor(np.array([[1.0, 1.0]])), Tensor(np.array([[2.0], [3.0]]))
    y = (x @ w).sum()
    w.data = Tensor(np.array([[100.0], [100.0]]))
    with pytest.raises(GraphError, match="MatMul saved input 1.*expected data version 0"):
        y.backward()


def test_optimizer_step_between_forward_and_backward_raises_in_np_mode():
    import pytest

    from needle import nn, optim
    from needle._core.errors import GraphError

    layer = nn.Linear(3, 2)
    x = Tensor(np.ones((4, 3), dtype="float32"))
    opt = optim.SGD(layer.parameters(), lr=0.1)
    layer(x).sum().backward()
    loss = layer(x).sum()
    opt.step()
    with pytest.raises(GraphError, match="replaced"):
        loss.backward()


def test_course_hw1_gradient_check_pattern_in_np_mode():
    """hw1 perturbs ``cached_data`` (a NumPy array) in place, then runs fresh forwards."""
    x = Tensor(np.array([[0.5, -1.0], [2.0, 0.25]]))
    eps = 1e-5
    numeric = np.zeros((2, 2))
    for j in range(4):
        x.realize_cached_data().flat[j] += eps
        f1 = float(ops.exp(x).sum().numpy())
        x.realize_cached_data().flat[j] -= 2 * eps
        f2 = float(ops.exp(x).sum().numpy())
        x.realize_cached_data().flat[j] += eps
        numeric.flat[j] = (f1 - f2) / (2 * eps)
    ops.exp(x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), numeric, rtol=1e-6)
