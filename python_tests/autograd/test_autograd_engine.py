"""The graph engine in nd mode: topo order, backward modes, freeing, grad modes, checks."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import warnings
import weakref

import numpy as np
import pytest

import needle.autograd as autograd
import needle.ops as ops
from needle._core.errors import (
    AxisError,
    DeviceError,
    DTypeError,
    GraphError,
    NeedleError,
    ShapeError,
)
from needle.autograd import (
    Tensor,
    TensorOp,
    compute_gradient_of_variables,
    enable_grad,
    find_topo_sort,
    no_grad,
)
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode tests (np mode: subprocess)")
HERE = os.path.dirname(os.path.abspath(__file__))


def _t(shape, seed=0, **kw):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), **kw)


def test_topo_sort_order_of_course_expression():
    a, b = _t((2,), 0), _t((2,), 1)
    result = 3 * a * a + 4 * b * a - a
    order = find_topo_sort([result])
    kinds = [type(n.op).__name__ if n.op is not None else "leaf" for n in order]
    assert kinds == ["leaf", "MulScalar", "EWiseMul", "leaf", "MulScalar", "EWiseMul",
                     "EWiseAdd", "Negate", "EWiseAdd"]
    assert order[0] is a and order[3] is b and order[-1] is result
    # each node appears after all of its inputs
    position = {id(n): i for i, n in enumerate(order)}
    assert all(position[id(i)] < position[id(n)] for n in order for i in n.inputs)


def test_topo_sort_deep_chain_no_recursion_error():
    x = _t((1,))
    y = x
    for _ in range(3000):
        y = y + 1.0
    assert len(find_topo_sort([y])) == 3001


def test_backward_values_match_hand_derivation(device):
    x_np = np.random.default_rng(0).standard_normal((3, 4))
    w_np = np.random.default_rng(1).standard_normal((4, 2))
    x, w = Tensor(x_np, device=device), Tensor(w_np, device=device)
    (ops.tanh(x @ w)).sum().backward()
    d = 1 - np.tanh(x_np @ w_np) ** 2
    np.testing.assert_allclose(w.grad.numpy(), x_np.T @ d, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), d @ w_np.T, rtol=1e-5, atol=1e-5)
    assert x.grad.device == device and x.grad.dtype == "float32"


def test_leaf_grads_accumulate_and_carry_no_graph():
    x = _t((3,))
    (x * x).sum().backward()
    first = x.grad.numpy()
    assert not x.grad.requires_grad and x.grad.op is None
    (x * x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * first, rtol=1e-6)


def test_non_leaf_has_no_grad_unless_retained():
    x = _t((3,))
    h = x * 2
    k = x * 3
    k.retain_grad()
    (h * k).sum().backward()
    assert h.grad is None
    np.testing.assert_allclose(k.grad.numpy(), h.numpy(), rtol=1e-6)


def test_create_graph_gives_gradient_of_gradient():
    x2, x3 = Tensor([6.0], dtype="float64"), Tensor([4.0], dtype="float64")
    y = x2 * x2 + x2 * x3
    y.backward(create_graph=True)
    g = x2.grad
    assert g.requires_grad
    np.testing.assert_allclose(g.numpy(), [2 * 6.0 + 4.0])
    x2.grad, x3.grad = None, None
    g.backward()
    np.testing.assert_allclose(x2.grad.numpy(), [2.0])
    np.testing.assert_allclose(x3.grad.numpy(), [1.0])


def test_compute_gradient_of_variables_assigns_every_node():
    a = _t((2,), dtype="float64")
    b = a * a
    c = b.sum()
    compute_gradient_of_variables(c, Tensor(1.0, dtype="float64"))
    assert b.grad is not None and c.grad is not None
    np.testing.assert_allclose(a.grad.numpy(), 2 * a.numpy())
    assert a.grad.requires_grad  # built with graph, as the course's engine does
    compute_gradient_of_variables(c, Tensor(1.0, dtype="float64"))
    np.testing.assert_allclose(a.grad.numpy(), 2 * a.numpy())  # assigned, not accumulated


def test_second_backward_through_freed_graph_names_op():
    x = _t((3,))
    y = ops.exp(x).sum()
    y.backward()
    with pytest.raises(GraphError, match="Summation|Exp"):
        y.backward()


def test_retain_graph_allows_second_backward():
    x = _t((3,))
    y = ops.exp(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.exp(x.numpy()), rtol=1e-5)


def _mlp(depth=4, width=8, seed=0):
    rng = np.random.default_rng(seed)
    ws = [Tensor(rng.standard_normal((width, width)) * 0.3) for _ in range(depth)]
    x = Tensor(rng.standard_normal((5, width)), requires_grad=False)
    return ws, x


@pytest.mark.parametrize("retain", [False, True])
def test_activations_freed_during_backward(retain):
    ws, x = _mlp()
    refs, h = [], x
    for w in ws:
        h = ops.relu(h @ w)
        refs.append(weakref.ref(h))
    loss = h.sum()
    del h
    alive_when_first_layer_done = []
    ws[0].register_post_accumulate_grad_hook(
        lambda p: alive_when_first_layer_done.append([r() is not None for r in refs]))
    loss.backward(retain_graph=retain)
    seen = alive_when_first_layer_done[0]
    if retain:
        assert all(seen)
    else:
        # the first layer's weight is ready last: by then every later activation was released
        assert not any(seen[:-1])


def test_tensor_counter_does_not_leak():
    gc.collect()
    base = autograd.TENSOR_COUNTER
    ws, x = _mlp()
    for _ in range(5):
        h = x
        for w in ws:
            h = ops.relu(h @ w)
        h.sum().backward()
        for w in ws:
            w.grad = None
    del h, ws, x, w
    gc.collect()
    assert autograd.TENSOR_COUNTER == base


def test_tensor_counter_is_the_live_count_and_lazy_mode_reaches_the_dispatch():
    gc.collect()
    base = autograd.TENSOR_COUNTER
    made = [_t((2,)) for _ in range(3)]
    assert autograd.TENSOR_COUNTER == base + 3
    del made
    gc.collect()
    assert autograd.TENSOR_COUNTER == base
    x = _t((2,))
    autograd.LAZY_MODE = True
    try:
        y = x * 2
        assert y.cached_data is None  # recorded, not computed
    finally:
        autograd.LAZY_MODE = False
    np.testing.assert_allclose(y.numpy(), x.numpy() * 2)
    assert (x * 2).cached_data is not None


def test_tensor_counter_write_sets_the_count_and_every_kind_of_value_counts():
    import copy

    gc.collect()
    base = autograd.TENSOR_COUNTER
    autograd.TENSOR_COUNTER = 10
    try:
        x = _t((2,))
        made = [x * 2, copy.copy(x), ops.make_tuple(x, x)]  # an op, a copy, a TensorTuple
        assert autograd.TENSOR_COUNTER == 10 + 4
        del made
        gc.collect()
        assert autograd.TENSOR_COUNTER == 11
    finally:
        autograd.TENSOR_COUNTER = base + 1  # x is still alive
    del x
    gc.collect()
    assert autograd.TENSOR_COUNTER == base


def test_no_grad_nested_and_enable_grad():
    x = _t((2,))
    with no_grad():
        assert not (x * 2).requires_grad
        with enable_grad():
            assert (x * 2).requires_grad
        assert not (x * 2).requires_grad
    assert (x * 2).requires_grad


def test_no_grad_is_thread_local_and_a_decorator():
    x = _t((2,))
    seen = []
    with no_grad():
        t = threading.Thread(target=lambda: seen.append((x * 2).requires_grad))
        t.start()
        t.join()
    assert seen == [True]

    @no_grad()
    def f(v):
        return v * 2

    assert not f(x).requires_grad and (x * 2).requires_grad


class _BadShape(TensorOp):
    def compute(self, a):
        return a * 2

    def gradient(self, out_grad, node):
        return ops.summation(out_grad)


class _BadCount(TensorOp):
    def compute(self, a):
        return a * 2

    def gradient(self, out_grad, node):
        return out_grad, out_grad


class _BadDType(TensorOp):
    def compute(self, a):
        return a * 2

    def gradient(self, out_grad, node):
        return out_grad.astype("float64")


class _NoGrad(TensorOp):
    def compute(self, a):
        return a * 2

    def gradient(self, out_grad, node):
        return None


class _BadSecond(TensorOp):
    """Right for the first input, a wrong shape for the second."""

    def compute(self, a, b):
        return a * b

    def gradient(self, out_grad, node):
        return out_grad, ops.summation(out_grad, 0)


@pytest.mark.parametrize("op, error", [(_BadShape, ShapeError), (_BadCount, GraphError),
                                       (_BadDType, DTypeError), (_NoGrad, GraphError)])
def test_engine_checks_gradients_and_names_op(op, error):
    x = _t((3, 2))
    with pytest.raises(error, match=op.__name__):
        op()(x).sum().backward()


def test_engine_checks_each_input_edge():
    x, y = _t((3, 2)), _t((3, 2))
    with pytest.raises(ShapeError, match=r"_BadSecond.*input 1, expected \(3, 2\), got \(2,\)"):
        _BadSecond()(x, y).sum().backward()
    assert x.grad is None or x.grad.shape == (3, 2)


def test_bad_input_errors_name_op_and_values(device):
    a = Tensor(np.ones((2, 3)), device=device)
    with pytest.raises(ShapeError, match=r"add.*\(2, 3\).*\(4,\)"):
        a + Tensor(np.ones(4), device=device)
    with pytest.raises(ShapeError, match=r"matmul: inner dimensions differ.*\(2, 3\) @ \(2, 3\)"):
        a @ a
    with pytest.raises(DTypeError, match="float32.*float64"):
        a * Tensor(np.ones((2, 3)), device=device, dtype="float64")
    with pytest.raises(ShapeError, match="add_scalar: expected a scalar.*shape \\(3,\\)"):
        ops.add_scalar(a, np.ones(3))
    with pytest.raises(DTypeError, match="mul_scalar.*Tensor"):
        ops.mul_scalar(a, a)
    with pytest.raises(AxisError, match="summation: axis out of range.*got 5"):
        ops.summation(a, 5)


def test_device_mismatch_raises():
    from needle.backend_ndarray import cpu, cpu_numpy
    if not cpu().enabled():
        pytest.skip("compiled cpu backend absent")
    a, b = Tensor([1.0], device=cpu()), Tensor([1.0], device=cpu_numpy())
    with pytest.raises(DeviceError, match="cpu"):
        a + b


def test_backward_of_non_scalar_warns_and_uses_ones():
    x = _t((2, 3))
    y = x * 2
    with pytest.warns(autograd.ImplicitGradWarning, match=r"\(2, 3\) is not a scalar"):
        y.backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full((2, 3), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (x * 2).sum().backward()


def test_out_grad_shape_checked():
    x = _t((2, 3))
    with pytest.raises(ShapeError, match=r"out_grad.*\(2, 3\).*\(3,\)"):
        (x * 2).backward(Tensor(np.ones(3)))


def test_backward_without_grad_raises():
    with pytest.raises(GraphError, match="does not require grad"):
        _t((2,), requires_grad=False).sum().backward()


def test_errors_are_needle_errors():
    assert issubclass(GraphError, NeedleError)


def test_logsumexp_stable_for_huge_values():
    z = np.array([[1e10, 1e10 - 1.0, -1e10], [0.0, 1.0, 2.0]], dtype=np.float32)
    x = Tensor(z)
    out = ops.logsumexp(x, axes=1)
    m = z.astype(np.float64).max(axis=1)
    want = m + np.log(np.exp(z.astype(np.float64) - m[:, None]).sum(axis=1))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
    out.sum().backward()
    soft = np.exp(z.astype(np.float64) - want[:, None])
    assert np.all(np.isfinite(x.grad.numpy()))
    np.testing.assert_allclose(x.grad.numpy(), soft, rtol=1e-5, atol=1e-6)


def test_tensor_api_extras(device):
    x = Tensor(np.arange(12.0).reshape(3, 4), device=device)
    assert x.ndim == 2 and x.shape == (3, 4)
    y = x.astype("float64")
    assert y.dtype == "float64"
    (y[1:, 2] * 3).sum().backward()
    expected = np.zeros((3, 4))
    expected[1:, 2] = 3
    np.testing.assert_allclose(x.grad.numpy(), expected)
    assert x.grad.dtype == "float32"
    assert {x: 1}[x] == 1  # hashable by identity, no elementwise __eq__
    assert isinstance(np.ones((3, 4)) * x, Tensor)  # ndarray defers to Tensor
    assert repr(Tensor([1.0], device=device)).startswith("needle.Tensor(")


def test_to_device_is_differentiable():
    from needle.backend_ndarray import cpu, cpu_numpy
    if not cpu().enabled():
        pytest.skip("compiled cpu backend absent")
    x = Tensor([1.0, 2.0], device=cpu_numpy())
    y = x.to(cpu())
    assert y.device == cpu()
    (y * y).sum().backward()
    assert x.grad.device == cpu_numpy()
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 4.0])


def test_np_mode_engine_subprocess():
    env = dict(os.environ, NEEDLE_BACKEND="np")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         os.path.join(HERE, "np_mode_engine.py")],
        env=env, capture_output=True, text=True, timeout=240, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_gradient_as_tuple_is_callable_directly_as_the_course_does():
    """The course's tests call ``out.op.gradient_as_tuple(ndl.Tensor(c), out)`` themselves."""
    a = Tensor(np.arange(6.0).reshape(2, 3))
    b = Tensor(np.ones((2, 3)) * 2)
    out = a * b
    grads = out.op.gradient_as_tuple(Tensor(np.ones((2, 3))), out)
    assert isinstance(grads, tuple) and len(grads) == 2
    np.testing.assert_array_equal(grads[0].numpy(), b.numpy())
    np.testing.assert_array_equal(grads[1].numpy(), a.numpy())
    single = -a
    (g,) = single.op.gradient_as_tuple(Tensor(np.ones((2, 3))), single)
    np.testing.assert_array_equal(g.numpy(), -np.ones((2, 3)))


@pytest.mark.skipif(BACKEND != "nd", reason="sparse tuple gradients are the nd engine's")
def test_split_gradients_stay_sparse_until_the_split_reads_them(monkeypatch):
    """Each piece of an n-way split hands its split a sparse tuple gradient; checking and
    summing them must not build the dense tuple (n zero arrays each: O(n^2) for an unrolled
    LSTM). The split builds it once, and every piece arrived, so no zeros at all."""
    import needle.autograd.tensor as tensor_mod

    zeros = []
    real = tensor_mod._zeros_like
    monkeypatch.setattr(tensor_mod, "_zeros_like", lambda like: zeros.append(1) or real(like))
    n = 8
    x = _t((n, 3))
    pieces = ops.split(x, 0)
    total = pieces[0]
    for i in range(1, n):
        total = total + pieces[i] * float(i + 1)
    total.sum().backward()
    assert zeros == []
    np.testing.assert_array_equal(x.grad.numpy(), np.repeat(np.arange(1, n + 1.0)[:, None], 3, 1))


@pytest.mark.skipif(BACKEND != "nd", reason="the nd engine frees nodes as it goes")
def test_a_processed_nodes_op_is_gone_before_the_next_node_runs():
    """An op may hold arrays for its backward (SoftmaxCrossEntropy's lse): once its node's
    step is over, nothing of the engine may keep it alive into the next node's step."""
    h = _t((4, 5)) @ _t((5, 5), 1)
    rows = ops.softmax_cross_entropy(h, Tensor(np.array([0.0, 1.0, 4.0, 2.0]),
                                               requires_grad=False))
    op_ref = weakref.ref(rows.op)
    seen = []
    h.register_hook(lambda g: seen.append(op_ref() is None))
    loss = rows.sum()
    del rows
    loss.backward()
    assert seen == [True]


def test_a_backward_releases_the_arrays_an_op_holds_unless_the_graph_is_retained():
    """The loss a caller keeps is itself a node whose op holds arrays (the mean cross-entropy's
    lse, batch norm's statistics): a backward without retain_graph drops them with the saved
    tensors (Op.release_held); with retain_graph they stay and a second backward agrees."""
    labels = Tensor(np.array([0.0, 1.0, 4.0, 2.0]), requires_grad=False)
    grads = []
    for retain in (False, True):
        z = _t((4, 5))
        normed = ops.batch_norm(z, Tensor(np.ones(5)), Tensor(np.zeros(5)))[0]
        loss = ops.softmax_cross_entropy(normed, labels, reduction="mean")
        bn_op = normed.op
        del normed
        assert loss.op.held_arrays() and bn_op.held_arrays()
        loss.backward(retain_graph=retain)
        grads.append(z.grad.numpy())
        if retain:
            assert loss.op.held_arrays() and bn_op.held_arrays()
            z.grad = None
            loss.backward()
            np.testing.assert_array_equal(z.grad.numpy(), grads[0])
        else:
            assert loss.op.held_arrays() == () and bn_op.held_arrays() == ()
    np.testing.assert_array_equal(grads[0], grads[1])
