"""ndl.amp.autocast: the per-op dtype rules, gradients through the casts, scoping."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from needle import amp, nn, ops
from needle._core.errors import NeedleError
from needle.autograd import Tensor

F16 = np.float16


def _t(a, device, dtype="float32", grad=True):
    return Tensor(np.asarray(a), device=device, dtype=dtype, requires_grad=grad)


def test_rule_table_names_the_documented_ops():
    assert amp.rule_of(ops.MatMul) == "lower" and amp.rule_of(ops.Conv) == "lower"
    for op in (ops.Summation, ops.LogSumExp, ops.LogSoftmax, ops.Exp, ops.Log,
               ops.PowerScalar, ops.EWisePow, ops.Sqrt):
        assert amp.rule_of(op) == "float32", op
    for op in (ops.EWiseAdd, ops.EWiseMul, ops.ReLU, ops.Reshape, ops.BroadcastTo):
        assert amp.rule_of(op) == "promote", op


def test_matmul_runs_in_float16_and_matches_numpy(device):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    with amp.autocast():
        out = _t(a, device) @ _t(b, device)
    assert out.dtype == "float16"
    # the reference: both operands rounded to float16, product rounded to float16
    want = (a.astype(F16).astype(np.float64) @ b.astype(F16).astype(np.float64)).astype(F16)
    np.testing.assert_allclose(out.numpy().astype(np.float64), want.astype(np.float64),
                               rtol=2e-3, atol=2e-3)
    plain = _t(a, device) @ _t(b, device)
    assert plain.dtype == "float32"  # outside the region nothing is cast


def test_reductions_and_sensitive_functions_run_in_float32(device):
    x16 = _t(np.linspace(-3, 3, 12).reshape(3, 4), device, "float16")
    with amp.autocast():
        assert ops.summation(x16).dtype == "float32"
        assert ops.logsumexp(x16, axes=(1,)).dtype == "float32"
        assert ops.exp(x16).dtype == "float32"
        assert (x16 ** 2).dtype == "float32"
        assert ops.relu(x16).dtype == "float16"        # promote: stays float16
        assert (x16 * x16 + 1).dtype == "float16"
        mixed = x16 + _t(np.ones((3, 4)), device)      # float16 + float32 -> float32
        assert mixed.dtype == "float32"
    # a float16 sum of 4096 ones would stop at 2048 + ... rounding; float32 is exact
    ones = _t(np.ones(4096), device, "float16")
    with amp.autocast():
        assert float(ops.summation(ones).numpy()) == 4096.0


def test_loss_and_normalisation_statistics_are_float32(device):
    np.random.seed(0)
    x = _t(np.random.randn(16, 6) * 3 + 5, device, "float16", grad=False)
    bn = amp.cast_parameters(nn.BatchNorm1d(6, device=device))
    with amp.autocast():
        out = bn(x)
        loss = nn.SoftmaxLoss()(_t(np.random.randn(4, 3), device, "float16"),
                                Tensor(np.array([0, 1, 2, 0]), device=device))
    assert out.dtype == "float32" and bn.running_mean.dtype == "float32"
    assert loss.dtype == "float32"
    xs = x.numpy().astype(np.float64)
    want = (xs - xs.mean(0)) / np.sqrt(xs.var(0) + 1e-5)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


def test_gradients_come_back_in_each_tensors_dtype(device):
    """fp32 parameters under autocast: the matmul runs in float16, the gradients are float32
    and equal the float32 gradients to float16 accuracy."""
    rng = np.random.default_rng(1)
    xa, wa = rng.standard_normal((8, 5)), rng.standard_normal((5, 4))
    grads = {}
    for mixed in (False, True):
        x, w = _t(xa, device, grad=False), _t(wa, device)
        with amp.autocast(enabled=mixed):
            loss = ops.summation(ops.relu(x @ w) ** 2)
        loss.backward()
        grads[mixed] = w.grad
    assert grads[True].dtype == "float32"
    np.testing.assert_allclose(grads[True].numpy(), grads[False].numpy(), rtol=2e-2, atol=2e-2)


def test_backward_inside_the_region_and_float16_parameters(device):
    np.random.seed(2)
    model = amp.cast_parameters(nn.Sequential(nn.Linear(4, 8, device=device), nn.ReLU(),
                                              nn.Linear(8, 3, device=device)))
    x = Tensor(np.random.rand(6, 4), device=device, requires_grad=False)
    y = Tensor(np.array([0, 1, 2, 0, 1, 2]), device=device)
    with amp.autocast():
        nn.SoftmaxLoss()(model(x), y).backward()
    for p in model.parameters():
        assert p.dtype == "float16" and p.grad.dtype == "float16"


def test_regions_nest_and_are_thread_local():
    a = Tensor(np.ones((2, 2)))
    seen = {}

    def other():
        seen["thread"] = (a @ a).dtype

    with amp.autocast():
        assert amp.is_autocast_enabled()
        with amp.autocast(enabled=False):
            assert (a @ a).dtype == "float32"
        assert (a @ a).dtype == "float16"
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert seen["thread"] == "float32" and not amp.is_autocast_enabled()

    @amp.autocast()
    def decorated():
        return (a @ a).dtype

    assert decorated() == "float16"


def test_bad_dtype_is_refused():
    with pytest.raises(NeedleError, match=r"expected one of \('float16', 'bfloat16'\), got 'int8'"):
        amp.autocast(dtype="int8")
