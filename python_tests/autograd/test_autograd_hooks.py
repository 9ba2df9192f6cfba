"""Gradient hooks, post-accumulate hooks, their order, and saved-tensor hooks (nd mode)."""
from __future__ import annotations

import numpy as np
import pytest

import needle.ops as ops
from needle._core.errors import GraphError
from needle.autograd import Tensor, saved_tensors_hooks
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode tests (np mode: subprocess)")


def _t(shape, seed=0, **kw):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), **kw)


def test_hook_replaces_gradient_of_leaf():
    x = _t((3,))
    x.register_hook(lambda g: g * 10)
    (x * 2).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 20.0))


def test_hook_fires_once_with_complete_gradient():
    x = _t((3,))
    h = x * 1
    calls = []
    h.register_hook(lambda g: calls.append(g.numpy()))
    (h * 2 + h * 3).sum().backward()  # two consumers of h
    assert len(calls) == 1
    np.testing.assert_allclose(calls[0], np.full(3, 5.0))


def test_non_leaf_hook_replacement_flows_to_inputs():
    x = _t((3,))
    h = x * 2
    h.register_hook(lambda g: g * 0)
    (h * h).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.zeros(3))


def test_several_hooks_in_registration_order_and_remove():
    x = _t((2,))
    order = []
    h1 = x.register_hook(lambda g: order.append("first"))
    x.register_hook(lambda g: order.append("second") or g * 2)
    x.register_hook(lambda g: order.append(("third", float(g.numpy()[0]))))
    (x * 1).sum().backward()
    assert order == ["first", "second", ("third", 2.0)]
    order.clear()
    h1.remove()
    h1.remove()  # harmless
    x.grad = None
    (x * 1).sum().backward()
    assert order == ["second", ("third", 2.0)]


def _mlp(depth, seed=0):
    rng = np.random.default_rng(seed)
    ws = [Tensor(rng.standard_normal((6, 6)) * 0.3) for _ in range(depth)]
    bs = [Tensor(rng.standard_normal((1, 6)) * 0.1) for _ in range(depth)]
    return ws, bs, Tensor(rng.standard_normal((4, 6)), requires_grad=False)


def test_post_accumulate_hooks_fire_in_reverse_layer_order_as_soon_as_ready():
    ws, bs, x = _mlp(3)
    events = []
    for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
        w.register_post_accumulate_grad_hook(lambda p, i=i: events.append(("W", i)))
        b.register_post_accumulate_grad_hook(lambda p, i=i: events.append(("b", i)))
    h = x
    acts = []
    for w, b in zip(ws, bs, strict=True):
        h = ops.relu(h @ w + ops.broadcast_to(b, (4, 6)))
        acts.append(h)
    # a hook on the first layer's activation marks when that layer's backward begins
    acts[0].register_hook(lambda g: events.append(("act", 0)))
    h.sum().backward()
    assert events.index(("W", 2)) < events.index(("act", 0))  # last layer done before layer 0
    w_order = [e for e in events if e[0] == "W"]
    assert w_order == [("W", 2), ("W", 1), ("W", 0)]
    assert events.index(("b", 2)) < events.index(("W", 1))


def test_post_accumulate_hook_sees_final_grad_and_only_on_leaves():
    w = _t((2,))
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.numpy().copy()))
    (w * 2 + w * 3).sum().backward()
    np.testing.assert_allclose(seen[0], np.full(2, 5.0))
    with pytest.raises(GraphError, match="leaf"):
        (w * 2).register_post_accumulate_grad_hook(lambda p: None)


def test_hook_exception_propagates_naming_tensor():
    x = _t((2, 3))

    def bad(g):
        raise ValueError("boom")

    x.register_hook(bad)
    with pytest.raises(ValueError, match="boom") as info:
        (x * 2).sum().backward()
    assert any("Tensor(shape=(2, 3)" in note for note in info.value.__notes__)


def test_hook_note_is_kept_where_exceptions_have_no_add_note():
    """Python 3.10 exceptions lack add_note; the note must still land in __notes__."""
    from needle._core.errors import add_note

    class OldStyleError:  # stands in for a 3.10 exception: no add_note attribute
        pass

    exc = OldStyleError()
    add_note(exc, "first")  # type: ignore[arg-type]
    add_note(exc, "second")  # type: ignore[arg-type]
    assert exc.__notes__ == ["first", "second"]


def test_register_hook_on_constant_raises():
    with pytest.raises(GraphError, match="does not require grad"):
        _t((2,), requires_grad=False).register_hook(lambda g: g)


def test_saved_tensor_hooks_see_every_saved_tensor_and_can_offload():
    x_np = np.random.default_rng(0).standard_normal((3, 4))
    w_np = np.random.default_rng(1).standard_normal((4, 2))
    x, w = Tensor(x_np), Tensor(w_np)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t.numpy()  # "offload": keep only a host copy

    def unpack(p):
        unpacked.append(p.shape)
        return Tensor(p, requires_grad=False)

    with saved_tensors_hooks(pack, unpack):
        y = x @ w  # saves x and w
        z = ops.exp(y)  # saves its output
        loss = (z * z).sum()  # multiply saves both (the same) inputs; sum saves nothing
    assert sorted(packed) == sorted([(3, 4), (4, 2), (3, 2), (3, 2), (3, 2)])
    loss.backward()
    assert sorted(unpacked) == sorted(packed)
    e = np.exp(x_np @ w_np)
    np.testing.assert_allclose(w.grad.numpy(), x_np.T @ (2 * e * e), rtol=1e-4)


def test_saved_tensor_hooks_inactive_outside_block():
    calls = []
    with saved_tensors_hooks(lambda t: calls.append(1) or t, lambda p: p):
        pass
    x = _t((2,))
    (x * x).sum().backward()
    assert calls == []
