"""Basic modules: values against NumPy re-derivations, RNG order, gradients by gradcheck."""
from __future__ import annotations

import math

import numpy as np
import pytest

from needle import init, nn, ops
from needle._core.errors import NeedleError, ShapeError
from needle.autograd import Tensor, gradcheck


def T(a, device, dtype="float32", requires_grad=False):
    return Tensor(np.asarray(a), device=device, dtype=dtype, requires_grad=requires_grad)


def _uniform(shape, bound):
    return np.random.rand(*shape) * 2 * bound - bound


def test_linear_init_order_and_forward(device):
    np.random.seed(1337)
    lin = nn.Linear(7, 4, device=device)
    np.random.seed(1337)
    w = _uniform((7, 4), math.sqrt(6 / 7))
    b = _uniform((4, 1), math.sqrt(6 / 4)).reshape(1, 4)
    np.testing.assert_allclose(lin.weight.numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lin.bias.numpy(), b, rtol=1e-5, atol=1e-6)
    assert lin.weight.device == device and isinstance(lin.weight, nn.Parameter)
    x = np.random.randn(3, 5, 7)
    np.testing.assert_allclose(lin(T(x, device)).numpy(), x @ w + b, rtol=1e-4, atol=1e-5)
    lin.bias = nn.Parameter(T(b.reshape(4), device))  # (out,)-shaped bias also broadcasts
    np.testing.assert_allclose(lin(T(x[0], device)).numpy(), x[0] @ w + b, rtol=1e-4,
                               atol=1e-5)
    with pytest.raises(ShapeError, match="Linear"):
        lin(T(np.ones((2, 6)), device))
    assert nn.Linear(3, 2, bias=False, device=device).bias is None


def test_linear_gradients(device):
    np.random.seed(0)
    lin = nn.Linear(4, 3, device=device, dtype="float64")

    def f(x, w, b):
        lin.weight, lin.bias = w, b
        return lin(x)

    assert gradcheck(f, T(np.random.randn(5, 4), device, "float64"),
                     lin.weight.detach(), lin.bias.detach())


@pytest.mark.parametrize("x_shape, bias_shape", [((6, 4), (1, 3)), ((6, 4), (3,)),
                                                  ((2, 6, 4), (1, 3))])
def test_linear_is_one_node_bitwise_the_composed_layer(device, x_shape, bias_shape):
    """nn.Linear records one FusedLinear node whose output and gradients are the composed
    x @ W + broadcast(b)'s bit for bit, and allocates two buffers fewer (the sum is written
    into the product, the bias added from its own row: no broadcast copy)."""
    from needle import memory

    rng = np.random.default_rng(0)
    lin = nn.Linear(4, 3, device=device)
    lin.bias = nn.Parameter(T(rng.standard_normal(bias_shape), device))
    y_shape = x_shape[:-1] + (3,)
    x_np, g_np = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    results = []
    for fused in (True, False):
        x = T(x_np, device, requires_grad=True)
        lin.weight.grad = lin.bias.grad = None
        with memory.record(device) as events:
            if fused:
                y = lin(x)
                assert type(y.op).__name__ == "FusedLinear" and y.inputs[0] is x
            else:
                bias = ops.reshape(lin.bias, (1,) * (len(x_shape) - 1) + (3,))
                y = x @ lin.weight + ops.broadcast_to(bias, y_shape)
        allocs = sum(e.kind == "alloc" for e in events)
        y.backward(T(g_np, device))
        results.append((allocs, y.numpy(), x.grad.numpy(), lin.weight.grad.numpy(),
                        lin.bias.grad.numpy()))
    (fused_allocs, *fused), (composed_allocs, *composed) = results
    assert lin.bias.grad.shape == bias_shape
    for a, b in zip(fused, composed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert fused_allocs == composed_allocs - 2


def test_linear_refuses_bad_shapes_naming_the_op(device):
    x, w = T(np.ones((2, 3)), device), T(np.ones((3, 4)), device)
    with pytest.raises(ShapeError, match=r"linear: bias .* got \(1, 5\)"):
        ops.linear(x, w, T(np.ones((1, 5)), device))
    with pytest.raises(ShapeError, match=r"linear: input features differ"):
        ops.linear(T(np.ones((2, 5)), device), w)
    with pytest.raises(ShapeError, match=r"linear: expected x with at least 2 dims"):
        ops.linear(T(np.ones(3), device), w)


def test_activations_flatten_identity(device):
    x = np.random.randn(2, 3, 4)
    t = T(x, device)
    np.testing.assert_allclose(nn.ReLU()(t).numpy(), np.maximum(x, 0), rtol=1e-6)
    np.testing.assert_allclose(nn.Tanh()(t).numpy(), np.tanh(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nn.Sigmoid()(t).numpy(), 1 / (1 + np.exp(-x)), rtol=1e-5,
                               atol=1e-6)
    assert nn.Flatten()(t).shape == (2, 12)
    np.testing.assert_allclose(nn.Flatten()(t).numpy(), x.reshape(2, 12), rtol=1e-6)
    assert nn.Identity()(t) is t
    assert gradcheck(lambda a: nn.Sigmoid()(a), T(x[0], device, "float64"))


def test_sequential_residual(device):
    np.random.seed(42)
    model = nn.Sequential(nn.Linear(5, 5, device=device), nn.ReLU(),
                          nn.Residual(nn.Linear(5, 5, device=device)))
    np.random.seed(42)
    w1, b1 = _uniform((5, 5), math.sqrt(6 / 5)), _uniform((5, 1), math.sqrt(6 / 5)).T
    w2, b2 = _uniform((5, 5), math.sqrt(6 / 5)), _uniform((5, 1), math.sqrt(6 / 5)).T
    x = np.random.randn(4, 5)
    h = np.maximum(x @ w1 + b1, 0)
    np.testing.assert_allclose(model(T(x, device)).numpy(), h @ w2 + b2 + h, rtol=1e-4,
                               atol=1e-5)


def test_softmax_loss(device):
    z = np.random.randn(6, 4) * 3
    y = np.array([0, 3, 1, 1, 2, 3])
    lse = np.log(np.exp(z).sum(axis=1))
    ref = np.mean(lse - z[np.arange(6), y])
    got = nn.SoftmaxLoss()(T(z, device), T(y, device)).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert gradcheck(lambda a: nn.SoftmaxLoss()(a, T(y, device, "float64")),
                     T(z, device, "float64"))
    with pytest.raises(ShapeError):
        nn.SoftmaxLoss()(T(z.reshape(-1), device), T(y, device))


def _bn_ref(x, w, b, eps):
    mu, var = x.mean(axis=0), x.var(axis=0)
    return w * (x - mu) / np.sqrt(var + eps) + b, mu, var


def test_batchnorm1d_train_eval_running_stats(device):
    np.random.seed(0)
    state = np.random.get_state()[1].copy()
    bn = nn.BatchNorm1d(3, momentum=0.2, device=device)
    assert np.array_equal(state, np.random.get_state()[1])  # no RNG consumed
    x1, x2 = np.random.randn(8, 3) * 2 + 1, np.random.randn(5, 3) - 1
    y1 = bn(T(x1, device)).numpy()
    ref, mu1, var1 = _bn_ref(x1, 1.0, 0.0, 1e-5)
    np.testing.assert_allclose(y1, ref, rtol=1e-4, atol=1e-5)
    bn(T(x2, device))
    _, mu2, var2 = _bn_ref(x2, 1.0, 0.0, 1e-5)
    rm = 0.8 * (0.8 * 0 + 0.2 * mu1) + 0.2 * mu2
    rv = 0.8 * (0.8 * 1 + 0.2 * var1) + 0.2 * var2
    np.testing.assert_allclose(bn.running_mean.numpy(), rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.running_var.numpy(), rv, rtol=1e-5, atol=1e-6)
    assert not bn.running_mean.requires_grad and bn.running_mean.dtype == "float32"
    bn.eval()
    np.testing.assert_allclose(bn(T(x1, device)).numpy(), (x1 - rm) / np.sqrt(rv + 1e-5),
                               rtol=1e-4, atol=1e-5)


def test_batchnorm1d_training_forward_dispatches_only_its_own_op(device, monkeypatch):
    # The running statistics are updated on the arrays: no Tensor arithmetic goes through
    # autograd besides the normalisation itself (it was 1 + 6 recorded-op calls per layer).
    from needle.autograd import tensor as tensor_module

    bn = nn.BatchNorm1d(3, device=device)
    x = T(np.random.randn(8, 3), device, requires_grad=True)
    calls, in_update, updating = [], [], []
    real_op, real_update = tensor_module.make_from_op, bn._update_running

    def counting(cls, op, inputs, *rest):
        calls.append(type(op).__name__)
        if updating:
            in_update.append(type(op).__name__)
        return real_op(cls, op, inputs, *rest)

    def update(*args):
        in_update.append("update")
        updating.append(True)
        try:
            real_update(*args)
        finally:
            updating.clear()

    monkeypatch.setattr(tensor_module, "make_from_op", counting)
    monkeypatch.setattr(bn, "_update_running", update)
    bn(x)
    assert in_update == ["update"]  # it ran, and dispatched nothing
    if ops.batch_norm_has_kernel(x):  # the fused kernel: one op in all
        assert calls == ["FusedBatchNorm"]
    monkeypatch.undo()
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.1 * x.numpy().mean(axis=0),
                               rtol=1e-5, atol=1e-6)


def test_batchnorm_gradients(device):
    np.random.seed(1)
    bn = nn.BatchNorm1d(3, device=device, dtype="float64")

    def f(x, w, b):
        bn.weight, bn.bias = w, b
        return bn(x)

    w = T(np.random.rand(3) + 0.5, device, "float64")
    b = T(np.random.randn(3), device, "float64")
    assert gradcheck(f, T(np.random.randn(6, 3), device, "float64"), w, b)


def test_batchnorm2d_matches_per_channel(device):
    x = np.random.randn(2, 3, 4, 5)
    bn = nn.BatchNorm2d(3, device=device)
    got = bn(T(x, device)).numpy()
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(got, (x - mu) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.1 * mu.reshape(3), rtol=1e-4,
                               atol=1e-6)


def test_layernorm(device):
    x = np.random.randn(2, 4, 6) * 3
    ln = nn.LayerNorm1d(6, device=device)
    mu, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
    np.testing.assert_allclose(ln(T(x, device)).numpy(), (x - mu) / np.sqrt(var + 1e-5),
                               rtol=1e-4, atol=1e-5)
    ln64 = nn.LayerNorm1d(6, device=device, dtype="float64")
    assert gradcheck(lambda a: ln64(a), T(x[0], device, "float64"))


def test_dropout_seeded_and_eval(device):
    x = np.random.randn(10, 7) + 3
    drop = nn.Dropout(0.3)
    np.random.seed(3)
    a = drop(T(x, device)).numpy()
    np.random.seed(3)
    mask = np.random.rand(10, 7) <= 0.7
    np.testing.assert_allclose(a, x * mask / 0.7, rtol=1e-5)
    np.random.seed(3)
    np.testing.assert_array_equal(drop(T(x, device)).numpy(), a)  # same seed, same values
    drop.eval()
    np.testing.assert_array_equal(drop(T(x, device)).numpy(), x.astype(np.float32))
    zero = nn.Dropout(0.0)
    np.random.seed(8)
    zero(T(x, device))
    marker = np.random.rand()
    np.random.seed(8)
    np.random.rand(10, 7)  # p = 0 still makes its one draw (course rule)
    assert marker == np.random.rand()


def test_dropout_is_one_node_bitwise_the_composed_product_and_quotient(device):
    """Train-mode Dropout records one ``masked_divide`` node whose output and input gradient
    are bitwise those of ``x * mask / (1 - p)`` composed from two ops; a mask of another
    shape is refused naming both shapes."""
    rng = np.random.default_rng(5)
    x_np = rng.standard_normal((16, 9)).astype("float32")
    g_np = rng.standard_normal((16, 9)).astype("float32")
    drop = nn.Dropout(0.3)
    x = Tensor(x_np, device=device, requires_grad=True)
    np.random.seed(11)
    y = drop(x)
    assert type(y.op).__name__ == "MaskedDivide" and y.inputs[0] is x
    y.backward(Tensor(g_np, device=device))
    x2 = Tensor(x_np, device=device, requires_grad=True)
    np.random.seed(11)
    mask = init.randb(16, 9, p=0.7, device=device, dtype="float32")
    y2 = x2 * mask / 0.7
    y2.backward(Tensor(g_np, device=device))
    np.testing.assert_array_equal(y.numpy(), y2.numpy())
    np.testing.assert_array_equal(x.grad.numpy(), x2.grad.numpy())
    with pytest.raises(ShapeError, match=r"masked_divide.*\(16, 9\).*\(9,\)"):
        ops.masked_divide(x, Tensor(np.ones(9, "float32"), device=device), 0.7)


def test_module_tree_state_dict_and_modes(device):
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(3, 4, device=device), nn.BatchNorm1d(4, device=device),
                          nn.Residual(nn.Sequential(nn.Linear(4, 4, device=device),
                                                    nn.Dropout(0.1))))
    names = [n for n, _ in model.named_parameters()]
    assert names == ["modules.0.weight", "modules.0.bias", "modules.1.weight",
                     "modules.1.bias", "modules.2.fn.modules.0.weight",
                     "modules.2.fn.modules.0.bias"]
    assert [id(p) for p in model.parameters()] == [id(p) for _, p in model.named_parameters()]
    assert len(model._children()) == 6
    model.eval()
    assert not any(m.training for m in [model] + model._children())
    model.train()
    assert all(m.training for m in model._children())

    state = model.state_dict()
    assert "modules.1.running_var" in state and len(state) == 8
    np.random.seed(1)
    other = nn.Sequential(nn.Linear(3, 4, device=device), nn.BatchNorm1d(4, device=device),
                          nn.Residual(nn.Sequential(nn.Linear(4, 4, device=device),
                                                    nn.Dropout(0.1))))
    weight = other.modules[0].weight
    other.load_state_dict(state)
    assert other.modules[0].weight is weight  # identity kept for optimisers
    for key, value in other.state_dict().items():
        np.testing.assert_array_equal(value, state[key])
    with pytest.raises(NeedleError, match="keys"):
        other.load_state_dict({"modules.0.weight": state["modules.0.weight"]})
    bad = dict(state, **{"modules.0.weight": np.zeros((4, 3))})
    with pytest.raises(ShapeError):
        other.load_state_dict(bad)


def test_parameters_inside_dicts_and_lists():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = {"a": nn.Linear(2, 2), "b": [nn.Linear(2, 1)]}
            self.scale = nn.Parameter(Tensor(np.ones(1)))

    h = Holder()
    assert len(h.parameters()) == 5
    h.eval()
    assert not h.layers["b"][0].training


def test_load_state_dict_reports_every_mismatch_at_once():
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    state = model.state_dict()
    before = model.state_dict()
    bad = dict(state)
    bad["modules.0.weight"] = np.zeros((4, 3), np.float32)        # shape
    bad["modules.1.running_var"] = np.ones(4, np.float64)          # dtype
    del bad["modules.0.bias"]                                      # missing
    bad["modules.9.weight"] = np.ones(1, np.float32)               # unexpected
    with pytest.raises(NeedleError) as err:
        model.load_state_dict(bad)
    message = str(err.value)
    assert "4 mismatch(es)" in message
    for fragment in ("missing keys ['modules.0.bias']", "unexpected keys ['modules.9.weight']",
                     "'modules.0.weight' shape expected (3, 4), got (4, 3)",
                     "'modules.1.running_var' dtype expected float32, got float64"):
        assert fragment in message
    for key, value in model.state_dict().items():  # nothing was copied
        np.testing.assert_array_equal(value, before[key])


def test_running_statistics_update_is_one_program_bitwise_the_composed_update(device,
                                                                              monkeypatch):
    """``running * (1 - m) + batch * m`` of the mean and of the variance run as one
    elementwise program where the backend has them, with the bits of the three separate
    float32 kernels each (NumPy's IEEE ops)."""
    from needle.backend_ndarray import ewise_program

    runs, real_run = [], ewise_program.run

    def counting(*args, **kwargs):
        runs.append(args[0])
        return real_run(*args, **kwargs)

    monkeypatch.setattr(ewise_program, "run", counting)
    rng = np.random.default_rng(5)
    old = [rng.standard_normal(7).astype(np.float32) for _ in range(2)]
    now = [rng.standard_normal(7).astype(np.float32) for _ in range(2)]
    bn = nn.BatchNorm1d(7, momentum=0.3, device=device)
    bn.running_mean = T(old[0], device, requires_grad=False)
    bn.running_var = T(old[1], device, requires_grad=False)
    bn._update_running(T(now[0], device).realize_cached_data(),
                       T(now[1], device).realize_cached_data())
    has_programs = getattr(device.mod, "ewise_program", None) is not None
    assert len(runs) == (1 if has_programs else 0)  # mean and var in one program
    m = 0.3
    for got, o, b in zip((bn.running_mean, bn.running_var), old, now, strict=True):
        want = o * np.float32(1 - m) + b * np.float32(m)
        np.testing.assert_array_equal(got.numpy(), want)
