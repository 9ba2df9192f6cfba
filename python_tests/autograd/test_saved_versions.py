"""Saved-tensor versions: backward refuses data that changed after an op saved it.

Each case changes, between forward and backward, an array that an op saved for its gradient
(``.data`` assignment, an in-place write through any view of the buffer, an optimizer step)
and expects ``GraphError`` naming the op, the tensor and both versions. The controls check
that the same graph without the change gives the right gradient, and that what does not
reach a saved array (unsaved inputs, writes before the forward, copies) is accepted.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle.ops as ops
from needle import nn, optim
from needle._core import versions
from needle._core.errors import GraphError
from needle.autograd import Tensor, saved_tensors_hooks
from needle.backend_ndarray import NDArray
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode tests (np mode: subprocess)")


def _t(values, device, **kw):
    return Tensor(np.array(values, dtype="float32"), device=device, **kw)


def test_data_assignment_after_forward_raises(device):
    x = _t([[1.0, 1.0]], device)
    w = _t([[2.0], [3.0]], device)
    y = (x @ w).sum()
    w.data = _t([[100.0], [100.0]], device, requires_grad=False)
    with pytest.raises(GraphError) as info:
        y.backward()
    msg = str(info.value)
    assert "MatMul" in msg and "input 1" in msg and "shape=(2, 1)" in msg
    assert "replaced" in msg
    assert "expected data version 0" in msg and "got version 1" in msg


def test_same_graph_without_the_change_gives_the_right_gradient(device):
    x = _t([[1.0, 1.0]], device)
    w = _t([[2.0], [3.0]], device)
    (x @ w).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[2.0, 3.0]])


def test_inplace_write_into_saved_output_of_exp_raises(device):
    x = _t([1.0, 2.0], device)
    y = ops.exp(x)
    y.realize_cached_data()[0:2] = 0.0
    with pytest.raises(GraphError) as info:
        y.sum().backward()
    msg = str(info.value)
    assert "Exp" in msg and "its output" in msg and "written in place" in msg
    assert "expected version 0" in msg and "got version 1" in msg


def test_fill_and_flat_perturbation_of_saved_input_raise(device):
    for write in (lambda a: a.fill(0.5), lambda a: a.flat.__setitem__(1, 7.0)):
        x = _t([1.0, 2.0], device)
        c = _t([3.0, 4.0], device, requires_grad=False)
        y = (x * c).sum()
        write(c.realize_cached_data())
        with pytest.raises(GraphError, match="EWiseMul saved input 1"):
            y.backward()


def test_versions_count_every_write(device):
    x = _t([1.0, 2.0], device)
    y = ops.exp(x)
    data = y.realize_cached_data()
    for _ in range(3):
        data[0] = 1.0
    with pytest.raises(GraphError, match="expected version 0 .*got version 3"):
        y.sum().backward()


def test_write_through_another_view_of_the_buffer_raises(device):
    w = _t(np.arange(6).reshape(2, 3), device)
    other = w.realize_cached_data().reshape((6,))  # another NDArray on the same buffer
    assert other is not w.realize_cached_data()
    x = _t([[1.0, 1.0]], device)
    y = (x @ w).sum()
    other[0:1] = 9.0
    with pytest.raises(GraphError, match="MatMul saved input 1"):
        y.backward()


def test_views_share_one_version_distinct_buffers_do_not(device):
    a = NDArray(np.zeros(6, dtype="float32"), device=device)
    b = NDArray(np.zeros(6, dtype="float32"), device=device)
    views = [a.reshape((2, 3)), a[1:3], a.reshape((2, 3)).permute((1, 0)), a.flat]
    before_a = versions.buffer_version(a._handle)
    before_b = versions.buffer_version(b._handle)
    for i, view in enumerate(views):
        view.fill(1.0)
        assert versions.buffer_version(a._handle) == before_a + i + 1
    assert versions.buffer_version(b._handle) == before_b


def test_optimizer_step_between_forward_and_backward_raises(device):
    for make in (lambda ps: optim.SGD(ps, lr=0.1), lambda ps: optim.Adam(ps, lr=0.1)):
        layer = nn.Linear(3, 2, device=device)
        x = Tensor(np.ones((4, 3), dtype="float32"), device=device)
        opt = make(layer.parameters())
        layer(x).sum().backward()
        loss = layer(x).sum()
        opt.step()
        with pytest.raises(GraphError, match="FusedLinear saved input 1.*replaced"):
            loss.backward()


def test_training_loop_order_is_accepted(device):
    layer = nn.Linear(3, 2, device=device)
    x = Tensor(np.ones((4, 3), dtype="float32"), device=device)
    opt = optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(3):
        opt.reset_grad()
        layer(x).sum().backward()
        opt.step()


def test_write_before_forward_and_after_backward_is_accepted(device):
    x = _t([1.0, 2.0], device)
    x.realize_cached_data()[0] = 3.0
    y = ops.exp(x)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.exp([3.0, 2.0]), rtol=1e-6)
    y.realize_cached_data()[0] = 0.0  # after backward: nothing reads it any more


def test_second_backward_of_a_retained_graph_sees_the_write(device):
    x = _t([1.0, 2.0], device)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    x.data = _t([5.0, 5.0], device)
    with pytest.raises(GraphError, match="EWiseMul saved input 0.*replaced"):
        y.backward()


def test_unsaved_input_may_change(device):
    """EWiseAdd saves nothing: its gradient does not depend on the values."""
    x = _t([1.0, 2.0], device)
    c = _t([3.0, 4.0], device, requires_grad=False)
    y = (x + c).sum()
    c.realize_cached_data().fill(0.0)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), [1.0, 1.0])


def test_course_gradient_check_pattern_keeps_working(device):
    """Perturb ``cached_data`` in place, then run a fresh forward and backward (hw4 style)."""
    x = _t([[0.5, -1.0], [2.0, 0.25]], device)
    w = _t([[1.0, 2.0], [3.0, 4.0]], device)
    eps = 1e-2
    numeric = np.zeros((2, 2))
    for j in range(4):
        x.realize_cached_data().flat[j] += eps
        f1 = float((ops.tanh(x) @ w).sum().numpy())
        x.realize_cached_data().flat[j] -= 2 * eps
        f2 = float((ops.tanh(x) @ w).sum().numpy())
        x.realize_cached_data().flat[j] += eps
        numeric.flat[j] = (f1 - f2) / (2 * eps)
    (ops.tanh(x) @ w).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), numeric, rtol=1e-2, atol=1e-3)


def test_saved_tensors_hooks_that_copy_protect_the_graph(device):
    def pack(t):
        return Tensor(t.numpy(), device=t.device, requires_grad=False)

    x = _t([1.0, 2.0], device)
    c = _t([3.0, 4.0], device, requires_grad=False)
    with saved_tensors_hooks(pack, lambda p: p):
        y = (x * c).sum()
    c.realize_cached_data().fill(0.0)  # the graph kept a copy, not c
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 4.0])


def test_saved_tensors_hooks_that_keep_the_tensor_are_checked(device):
    x = _t([1.0, 2.0], device)
    c = _t([3.0, 4.0], device, requires_grad=False)
    with saved_tensors_hooks(lambda t: t, lambda p: p):
        y = (x * c).sum()
    c.realize_cached_data().fill(0.0)
    with pytest.raises(GraphError, match="EWiseMul saved tensor 1"):
        y.backward()


def test_replacement_of_an_unsaved_leaf_is_accepted(device):
    x = _t([1.0, 2.0], device)
    b = _t([1.0, 1.0], device)
    y = (x * 2 + b).sum()
    b.data = _t([7.0, 7.0], device)
    y.backward()
    np.testing.assert_allclose(b.grad.numpy(), [1.0, 1.0])


def test_replacing_a_leaf_no_node_read_skips_the_check_and_a_read_one_wakes_it(device,
                                                                                 monkeypatch):
    """Replacing a leaf that no recorded node took as an input (BatchNorm's running
    statistics in training) cannot concern any graph: backward checks no node for it. A leaf
    that a node read wakes the check when replaced, also when that node came after an
    earlier replacement."""
    from needle.autograd import engine

    checked = []
    real = engine.check_saved
    monkeypatch.setattr(engine, "check_saved", lambda node: checked.append(node) or real(node))
    x = _t([[1.0, 1.0]], device)
    w = _t([[2.0], [3.0]], device, requires_grad=True)
    unread = _t([4.0], device)
    y = (x @ w).sum()
    unread.data = _t([5.0], device)
    y.backward()
    assert checked == []
    np.testing.assert_allclose(w.grad.numpy(), [[1.0], [1.0]])
    # read after its (quiet) replacement: the next replacement is seen
    z = (x @ (w * unread)).sum()  # the product saves unread
    unread.data = _t([6.0], device)
    with pytest.raises(GraphError, match="replaced"):
        z.backward()
    assert checked


# ----- checkpoint regions recompute from what they kept: the same refusal -------------------
def _region(device):
    from needle.checkpoint import checkpoint

    w = _t([[1.0, 1.0], [1.0, 1.0]], device)
    x = _t([[1.0, 1.0]], device)
    y = checkpoint(lambda a: ops.relu(a @ w), x, name="block")
    return w, x, y


def test_checkpoint_region_without_change_is_right(device):
    w, x, y = _region(device)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[2.0, 2.0]])
    np.testing.assert_allclose(w.grad.numpy(), [[1.0, 1.0], [1.0, 1.0]])


def test_checkpoint_region_refuses_a_replaced_captured_tensor(device):
    w, x, y = _region(device)
    w.data = _t([[5.0, 5.0], [5.0, 5.0]], device)  # gave x.grad [[10, 10]]
    with pytest.raises(GraphError, match="checkpoint region 'block' saved captured tensor 0"):
        y.sum().backward()


def test_checkpoint_region_refuses_an_argument_written_in_place(device):
    w, x, y = _region(device)
    x.realize_cached_data()[0, 0] = 7.0  # gave w.grad [[7, 7], [1, 1]]
    with pytest.raises(GraphError, match="saved argument 0.*written in place"):
        y.sum().backward()


def test_checkpoint_region_refuses_an_optimizer_step_on_module_weights(device):
    from needle.checkpoint import checkpoint

    layer = nn.Linear(2, 2, device=device)
    x = _t([[1.0, 2.0]], device)
    opt = optim.SGD(layer.parameters(), lr=0.1)
    checkpoint(layer, x).sum().backward()
    loss = checkpoint(layer, x).sum()
    opt.step()
    with pytest.raises(GraphError, match="checkpoint region"):
        loss.backward()


def test_write_logs_go_away_with_their_buffer(device):
    import gc

    gc.collect()
    before = len(versions.BUFFER_LOGS)
    arrays = [NDArray(np.zeros(3, dtype="float32"), device=device) for _ in range(5)]
    for a in arrays:
        a[0:1] = 1.0
    assert len(versions.BUFFER_LOGS) == before + 5
    del arrays, a
    gc.collect()
    assert len(versions.BUFFER_LOGS) == before


def test_version_when_saved_is_an_upper_bound_beyond_the_kept_stamps(device):
    x = _t([1.0, 2.0], device)
    y = ops.exp(x)
    out = y.realize_cached_data()
    writes = versions.KEEP + 4
    for _ in range(writes):
        out[1] = 0.0
    # saved at version 0; only the last KEEP stamps are kept, so the message gives a bound
    with pytest.raises(GraphError, match=f"expected version {writes - versions.KEEP} or less "
                                         f".*got version {writes}"):
        y.sum().backward()


def test_cuda_buffers_are_versioned_and_logs_go_away(emulated_cuda):
    """cuda() handles are weakly referenceable, so their write logs follow the buffer."""
    import gc

    dev = emulated_cuda
    x = _t([1.0, 2.0], dev)
    y = ops.exp(x)
    y.realize_cached_data()[0:1] = 0.0
    with pytest.raises(GraphError, match="Exp saved its output"):
        y.sum().backward()
    log = versions.buffer_log(y.realize_cached_data()._handle)
    assert log is not None and log.count == 1
    del x, y
    gc.collect()
    assert all(entry is not log for entry in versions.BUFFER_LOGS.values())


def test_data_version_counts_replacements(device):
    from needle.autograd.versions import data_version

    layer = nn.Linear(2, 2, device=device)
    w = layer.weight
    assert data_version(w) == 0
    layer(_t([[1.0, 2.0]], device)).sum().backward()
    optim.SGD(layer.parameters(), lr=0.1).step()
    assert data_version(w) == 1
    w.data = _t(np.zeros((2, 2)), device)
    assert data_version(w) == 2
