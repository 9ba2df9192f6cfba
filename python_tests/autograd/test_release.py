"""Autograd releases recorded outputs that backward will not read (needle/autograd/release.py)."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle._core.errors import GraphError
from needle.autograd import release
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd",
                                reason="nd mode only (np mode keeps the course's graph)")

BIG = release.RELEASE_MIN_ELEMENTS  # elements: at the threshold, so tracked


def _data(node):
    return node.cached_data


def test_unsaved_output_is_released_once_only_the_graph_holds_it(device):
    x = ndl.Tensor(np.ones((1, BIG), np.float32), device=device, requires_grad=True)
    a = x * 2.0          # MulScalar saves nothing, and neither does the AddScalar below
    b = a + 1.0
    c = ndl.ops.relu(b)  # ReLU saves its output, not b
    first = a            # the user names a: it must stay
    del a, b
    d = c * 3.0          # a later op sweeps: b is reachable only through c's inputs
    assert isinstance(_data(c.inputs[0]), release.Released)
    assert not isinstance(_data(first), release.Released)  # still named
    assert not isinstance(_data(c), release.Released)      # saved by ReLU
    with pytest.raises(GraphError, match="AddScalar was released"):
        c.inputs[0].numpy()
    d.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full((1, BIG), 6.0, np.float32))


def test_saved_inputs_are_kept_and_gradients_are_unchanged(device):
    rng = np.random.default_rng(0)
    w_np = rng.standard_normal((BIG // 64, 64)).astype(np.float32)
    x = ndl.Tensor(rng.standard_normal((64, BIG // 64)).astype(np.float32), device=device)
    w = ndl.Tensor(w_np, device=device, requires_grad=True)
    h = ndl.ops.relu(x @ w)      # x @ w: only ReLU consumes it and ReLU saves its output
    out = (h @ w.transpose()).sum()  # the second matmul saves h
    out.backward()
    want = _reference_grad(x.numpy(), w_np)
    np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-4, atol=1e-3)


def _reference_grad(x, w):
    pre = x @ w
    h = np.maximum(pre, 0)
    g_out = np.ones((x.shape[0], w.shape[0]), np.float32)
    g_h = g_out @ w                       # d/dh of sum(h @ w.T)
    g_pre = g_h * (pre > 0)
    return x.T @ g_pre + (g_out.T @ h)    # both uses of w


def test_small_outputs_are_not_tracked(device):
    x = ndl.Tensor(np.ones((4, 4), np.float32), device=device, requires_grad=True)
    a = x * 2.0
    b = a + 1.0
    del a
    c = b * 3.0
    assert not isinstance(_data(c.inputs[0].inputs[0]), release.Released)
    assert not c.inputs[0].inputs[0]._tracked


def _square_chain(x):
    a = x * 2.0  # MulScalar: nothing saved of x; AddScalar below saves nothing of a
    b = a + 1.0
    m = b * b    # EWiseMul saves b (both inputs) through pack
    del a
    return m, b


def test_inside_saved_tensor_hooks_what_pack_keeps_stays(device):
    x = ndl.Tensor(np.ones((1, BIG), np.float32), device=device, requires_grad=True)
    with ndl.autograd.saved_tensors_hooks(lambda t: t, lambda t: t):
        m, b = _square_chain(x)
        del b
        d = m + 1.0  # a later op sweeps
    b = m.inputs[0]
    assert isinstance(_data(b.inputs[0]), release.Released)  # a: nobody saved it
    assert not isinstance(_data(b), release.Released)         # b: pack kept it
    d.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full((1, BIG), 12.0, np.float32))


def test_inside_saved_tensor_hooks_a_tensor_pack_replaced_is_released(device):
    x = ndl.Tensor(np.ones((1, BIG), np.float32), device=device, requires_grad=True)
    with ndl.autograd.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
        m, b = _square_chain(x)
        del b
        d = m + 1.0
    assert isinstance(_data(m.inputs[0]), release.Released)  # backward reads the copy
    d.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full((1, BIG), 12.0, np.float32))
