"""Initialisers: values re-derived from NumPy's RNG and the course's initialiser formulas."""
from __future__ import annotations

import math

import numpy as np
import pytest

from needle import init
from needle._core.errors import NeedleError


def _after(seed, n):
    """The value NumPy's global RNG gives after ``n`` uniform draws from ``seed``."""
    np.random.seed(seed)
    np.random.rand(n)
    return np.random.rand()


def test_rand_randn_one_draw_each(device):
    np.random.seed(1)
    a = init.rand(3, 4, low=-2.0, high=5.0, device=device)
    marker = np.random.rand()
    np.random.seed(1)
    ref = np.random.rand(3, 4) * 7.0 - 2.0
    assert marker == np.random.rand()
    np.testing.assert_allclose(a.numpy(), ref, rtol=1e-6, atol=1e-6)
    assert a.device == device and a.dtype == "float32" and not a.requires_grad

    np.random.seed(2)
    b = init.randn(5, 2, mean=1.5, std=0.3, device=device, requires_grad=True)
    np.random.seed(2)
    np.testing.assert_allclose(b.numpy(), np.random.randn(5, 2) * 0.3 + 1.5, rtol=1e-6)
    assert b.requires_grad


def test_constant_ones_zeros_consume_no_rng(device):
    np.random.seed(3)
    c = init.constant(2, 3, c=-4.5, device=device)
    o, z = init.ones(4, device=device), init.zeros(1, 2, device=device)
    assert np.random.rand() == _after(3, 0)
    np.testing.assert_array_equal(c.numpy(), np.full((2, 3), -4.5))
    np.testing.assert_array_equal(o.numpy(), np.ones(4))
    np.testing.assert_array_equal(z.numpy(), np.zeros((1, 2)))
    np.testing.assert_array_equal(init.ones_like(c).numpy(), np.ones((2, 3)))
    np.testing.assert_array_equal(init.zeros_like(c, device=device).numpy(), np.zeros((2, 3)))


def test_randb_and_one_hot(device):
    np.random.seed(4)
    mask = init.randb(50, 3, p=0.3, device=device)
    np.random.seed(4)
    np.testing.assert_array_equal(mask.numpy(), (np.random.rand(50, 3) <= 0.3).astype(np.float32))
    idx = init.one_hot(4, np.array([2, 0, 3]), device=device)
    np.testing.assert_array_equal(idx.numpy(), np.eye(4)[[2, 0, 3]])
    from needle.autograd import Tensor
    t = Tensor(np.array([[1.0, 3.0]]), device=device)
    assert init.one_hot(5, t, device=device).shape == (1, 2, 5)


@pytest.mark.parametrize("fan_in,fan_out,gain", [(6, 4, 1.0), (30, 7, 2.5)])
def test_xavier(fan_in, fan_out, gain):
    np.random.seed(5)
    u = init.xavier_uniform(fan_in, fan_out, gain=gain).numpy()
    n = init.xavier_normal(fan_in, fan_out, gain=gain).numpy()
    np.random.seed(5)
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    np.testing.assert_allclose(u, np.random.rand(fan_in, fan_out) * 2 * a - a, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(n, np.random.randn(fan_in, fan_out) * std, rtol=1e-5, atol=1e-6)


def test_kaiming_uniform_normal_and_shape():
    np.random.seed(6)
    u = init.kaiming_uniform(8, 3).numpy()
    k = init.kaiming_uniform(144, 72, shape=(3, 3, 16, 8)).numpy()
    n = init.kaiming_normal(8, 3).numpy()
    np.random.seed(6)
    b = math.sqrt(6.0 / 8)  # gain sqrt(2) * sqrt(3 / fan_in)
    np.testing.assert_allclose(u, np.random.rand(8, 3) * 2 * b - b, rtol=1e-5, atol=1e-6)
    b2 = math.sqrt(6.0 / 144)
    assert k.shape == (3, 3, 16, 8)
    np.testing.assert_allclose(k, np.random.rand(3, 3, 16, 8) * 2 * b2 - b2, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(n, np.random.randn(8, 3) * math.sqrt(2.0 / 8), rtol=1e-5)
    with pytest.raises(NeedleError, match="nonlinearity"):
        init.kaiming_uniform(3, 3, nonlinearity="swish")


def test_same_seed_same_values_float64(device):
    np.random.seed(9)
    a = init.kaiming_uniform(5, 5, device=device, dtype="float64")
    np.random.seed(9)
    b = init.kaiming_uniform(5, 5, device=device, dtype="float64")
    assert a.dtype == "float64"
    np.testing.assert_array_equal(a.numpy(), b.numpy())
