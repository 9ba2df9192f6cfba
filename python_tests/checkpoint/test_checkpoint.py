"""checkpoint / checkpoint_sequential: bitwise gradients, RNG replay, hooks, nesting, verify."""
from __future__ import annotations

import numpy as np
import pytest

from needle import nn, ops
from needle import random as nr
from needle._core.errors import CheckpointError, ReleasedDataError
from needle.autograd import Tensor, TensorOp
from needle.checkpoint import checkpoint, checkpoint_sequential, is_recomputing


def _net(device, width=6, depth=4, p=0.4, seed=0):
    np.random.seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width, device=device), nn.ReLU(), nn.Dropout(p)]
    return nn.Sequential(*layers)


def _step(model, x_np, device, run, seed=7):
    """Forward + backward with ``run(model, X)``; returns output, every grad, next draw."""
    for p in model.parameters():
        p.grad = None
    np.random.seed(seed)
    X = Tensor(x_np, device=device, requires_grad=True)
    y = run(model, X)
    out = y.numpy()
    (y * y).sum().backward()
    after = np.random.rand(3)  # what code after the region and the backward draws
    return [out, X.grad.numpy(), after] + [p.grad.numpy() for p in model.parameters()]


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=False):
        np.testing.assert_array_equal(u, v)
        assert u.dtype == v.dtype


@pytest.mark.parametrize("segments", [1, 2, 3, 12])
def test_sequential_with_dropout_is_bitwise_plain(device, segments):
    model = _net(device)
    x = np.random.RandomState(1).randn(5, 6).astype("float32")
    plain = _step(model, x, device, lambda m, X: m(X))
    ckpt = _step(model, x, device, lambda m, X: checkpoint_sequential(m, segments, X))
    _assert_bitwise(plain, ckpt)


def test_without_preserved_rng_the_masks_differ(device):
    model = _net(device, width=32, p=0.5)
    x = np.random.RandomState(1).randn(8, 32).astype("float32")
    plain = _step(model, x, device, lambda m, X: m(X))
    loose = _step(model, x, device, lambda m, X: checkpoint_sequential(
        m, 2, X, preserve_rng_state=False))
    assert not np.array_equal(plain[3], loose[3])  # recomputed masks were fresh draws


def test_shared_parameters_accumulate_bitwise_and_hooks_fire_once(device):
    np.random.seed(3)
    shared, other = nn.Linear(6, 6, device=device), nn.Linear(6, 6, device=device)

    def block(x):
        return ops.relu(shared(ops.relu(shared(x))))  # two uses inside one region

    def run(m, X, ck):
        h = checkpoint(block, X) if ck else block(X)
        h = other(h)
        h = checkpoint(block, h) if ck else block(h)
        return shared(h)  # and one use after both regions

    x = np.random.RandomState(2).randn(4, 6).astype("float32")
    results, calls = [], []
    for ck in (False, True):
        params = [shared.weight, shared.bias, other.weight, other.bias]
        for p in params:
            p.grad = None
        handles = [p.register_post_accumulate_grad_hook(
            lambda t, k=k, ck=ck: calls.append((ck, k, t.grad.numpy().copy())))
            for k, p in enumerate(params)]
        grads = []
        for _ in range(2):  # second step accumulates onto an existing .grad
            X = Tensor(x, device=device, requires_grad=True)
            run(None, X, ck).sum().backward()
            grads.append(X.grad.numpy())
        results.append(grads + [p.grad.numpy() for p in params])
        for h in handles:
            h.remove()
    _assert_bitwise(results[0], results[1])
    plain_calls = [c for c in calls if not c[0]]
    ckpt_calls = [c for c in calls if c[0]]
    assert [c[1] for c in plain_calls] == [c[1] for c in ckpt_calls]
    assert len(ckpt_calls) == 8  # 4 parameters, once per backward, 2 backwards
    for a, b in zip(plain_calls, ckpt_calls, strict=False):
        np.testing.assert_array_equal(a[2], b[2])  # the hook saw the final gradient


def test_eval_batchnorm_is_bitwise(device):
    np.random.seed(4)
    model = nn.Sequential(nn.Linear(6, 6, device=device), nn.BatchNorm1d(6, device=device),
                          nn.ReLU(), nn.Linear(6, 6, device=device))
    x = np.random.RandomState(3).randn(5, 6).astype("float32")
    model.train()
    model(Tensor(x, device=device))  # move the running statistics off their init
    model.eval()
    plain = _step(model, x, device, lambda m, X: m(X))
    ckpt = _step(model, x, device, lambda m, X: checkpoint(m, X))
    _assert_bitwise(plain, ckpt)


def test_training_batchnorm_updates_running_stats_once(device):
    def fresh():
        np.random.seed(5)
        return nn.Sequential(nn.Linear(6, 6, device=device), nn.BatchNorm1d(6, device=device))

    x = np.random.RandomState(4).randn(5, 6).astype("float32")
    a, b = fresh(), fresh()
    plain = _step(a, x, device, lambda m, X: m(X))
    ckpt = _step(b, x, device, lambda m, X: checkpoint_sequential(m, 2, X))
    _assert_bitwise(plain, ckpt)
    for name in ("running_mean", "running_var"):
        np.testing.assert_array_equal(getattr(a.modules[1], name).numpy(),
                                      getattr(b.modules[1], name).numpy())


class _Counter(nn.Module):
    """Stateful: scales by a counter it bumps on every call."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * float(self.calls)


def test_module_counter_is_replayed_and_bumped_once(device):
    counter = _Counter()
    X = Tensor(np.ones((2, 3), dtype="float32"), device=device)
    checkpoint(counter, X).sum().backward()
    assert counter.calls == 1
    np.testing.assert_array_equal(X.grad.numpy(), np.ones((2, 3), dtype="float32"))


def test_nested_regions_are_bitwise(device):
    model = _net(device, depth=4)
    layers = list(model.modules)

    def inner(x):
        for layer in layers[3:9]:
            x = layer(x)
        return x

    def outer(x):
        for layer in layers[:3]:
            x = layer(x)
        x = checkpoint(inner, x)
        for layer in layers[9:]:
            x = layer(x)
        return x

    x = np.random.RandomState(5).randn(4, 6).astype("float32")
    plain = _step(model, x, device, lambda m, X: m(X))
    nested = _step(model, x, device, lambda m, X: checkpoint(outer, X, verify=True))
    _assert_bitwise(plain, nested)


def test_output_without_grad_is_fine(device):
    X = Tensor(np.ones((2, 2), dtype="float32"), device=device, requires_grad=False)
    y = checkpoint(lambda x: ops.relu(x) * 2, X)
    assert not y.requires_grad
    np.testing.assert_array_equal(y.numpy(), np.full((2, 2), 2, dtype="float32"))
    from needle.autograd import no_grad
    w = Tensor(np.ones((2, 2), dtype="float32"), device=device)
    with no_grad():
        assert not checkpoint(lambda x: x @ w, X).requires_grad


def test_several_outputs_and_passthrough(device):
    np.random.seed(6)
    lin = nn.Linear(4, 4, device=device)
    x = np.random.RandomState(6).randn(3, 4).astype("float32")

    def fn(x, scale):
        h = lin(x)
        return ops.relu(h) * scale, ops.exp(h), x, "tag"

    grads = []
    for ck in (False, True):
        lin.weight.grad = None
        X = Tensor(x, device=device, requires_grad=True)
        a, b, same, tag = checkpoint(fn, X, 2.0) if ck else fn(X, 2.0)
        assert tag == "tag" and (same is X)
        (a.sum() + (b * b).sum() + same.sum()).backward()
        grads.append([X.grad.numpy(), lin.weight.grad.numpy(), a.numpy(), b.numpy()])
    _assert_bitwise(grads[0], grads[1])


def test_retain_graph_allows_a_second_backward(device):
    model = _net(device, depth=2)
    X = Tensor(np.ones((3, 6), dtype="float32"), device=device)
    np.random.seed(1)
    y = checkpoint_sequential(model, 2, X)
    y.sum().backward(retain_graph=True)
    first = model.modules[0].weight.grad.numpy()
    y.sum().backward()
    np.testing.assert_array_equal(model.modules[0].weight.grad.numpy(), first + first)


def test_verify_passes_on_replayable_region_and_sees_draws(device):
    model = _net(device)
    x = np.random.RandomState(1).randn(5, 6).astype("float32")
    plain = _step(model, x, device, lambda m, X: m(X))

    def with_extra_draw(m, X):
        def fn(h):
            noise = nr.randn(*h.shape)  # a draw through needle.random, hashed by verify
            return m(h + Tensor(noise.astype("float32"), device=device, requires_grad=False))
        return fn

    verified = _step(model, x, device, lambda m, X: checkpoint_sequential(m, 3, X, verify=True))
    _assert_bitwise(plain, verified)
    X = Tensor(x, device=device)
    checkpoint(with_extra_draw(model, X), X, verify=True).sum().backward()


def test_verify_catches_a_non_deterministic_region(device):
    state = {"calls": 0}

    def planted(x):
        state["calls"] += 1  # global state the region cannot roll back
        return x * float(state["calls"])

    X = Tensor(np.ones((2, 2), dtype="float32"), device=device)
    y = checkpoint(planted, X, verify=True, name="planted")
    with pytest.raises(CheckpointError, match=r"region 'planted' output 0 differs in values"):
        y.sum().backward()


def test_verify_names_shape_and_draw_differences(device):
    state = {"calls": 0}

    def grows(x):
        state["calls"] += 1
        return ops.reshape(x, (4,)) if state["calls"] > 1 else ops.reshape(x, (2, 2))

    X = Tensor(np.ones((2, 2), dtype="float32"), device=device)
    with pytest.raises(CheckpointError, match="differs in shape"):
        checkpoint(grows, X, verify=True).sum().backward()

    draws = {"calls": 0}

    def draws_more(x):
        draws["calls"] += 1
        for _ in range(draws["calls"]):
            nr.rand(2)
        return x * 2

    with pytest.raises(CheckpointError, match="number of random draws"):
        checkpoint(draws_more, Tensor(np.ones(2, dtype="float32"), device=device),
                   verify=True).sum().backward()


def test_recompute_reading_other_tensors_raises_even_without_verify(device):
    w1 = Tensor(np.ones((2, 2), dtype="float32"), device=device)
    w2 = Tensor(np.ones((2, 2), dtype="float32"), device=device)
    use = {"w": w1}

    def fn(x):
        out = x @ use["w"]
        use["w"] = w2
        return out

    y = checkpoint(fn, Tensor(np.ones((1, 2), dtype="float32"), device=device))
    with pytest.raises(CheckpointError, match="read different tensors"):
        y.sum().backward()


def test_outer_rng_stream_is_unchanged_by_backward(device):
    model = _net(device)
    X = Tensor(np.ones((3, 6), dtype="float32"), device=device)
    np.random.seed(9)
    y = checkpoint_sequential(model, 4, X)
    state = np.random.get_state()
    y.sum().backward()
    after = np.random.get_state()
    np.testing.assert_array_equal(state[1], after[1])
    assert state[2] == after[2]


def test_is_recomputing_only_during_recompute(device):
    seen = []

    def fn(x):
        seen.append(is_recomputing())
        return x * 3

    checkpoint(fn, Tensor(np.ones(2, dtype="float32"), device=device)).sum().backward()
    assert seen == [False, True] and not is_recomputing()


class _ReadsUnsavedInput(TensorOp):
    """A broken op: declares it saves nothing, yet its gradient reads its input."""

    save_inputs = ()

    def compute(self, a):
        return a * 2

    def gradient(self, out_grad, node):
        return out_grad * Tensor.make_const(node.inputs[0].realize_cached_data() * 0 + 2)


def test_reading_a_released_array_names_the_op(device):
    X = Tensor(np.ones((2, 2), dtype="float32"), device=device)

    def fn(x):
        return _ReadsUnsavedInput()(ops.exp(x) * 1)

    y = checkpoint(fn, X)
    # the recomputation releases what no op declares saved, as any recorded graph does
    with pytest.raises(ReleasedDataError, match="output of MulScalar was released"):
        y.sum().backward()
