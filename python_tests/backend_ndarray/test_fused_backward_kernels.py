"""tanh_grad / relu_grad (the backward of tanh and relu from their outputs, one kernel each)
against a float64 NumPy oracle, on every device and every C++ kernel build."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import needle.backend_ndarray as nd

TOL = {"float32": 4e-7, "float64": 1e-15, "float16": 2e-3}

sizes = st.integers(0, 5000)
dtypes = st.sampled_from(["float32", "float64", "float16"])


def draw(seed, n, dtype):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n).astype(dtype)
    t = np.tanh(rng.standard_normal(n)).astype(dtype)
    r = np.maximum(rng.standard_normal(n), 0).astype(dtype)
    return g, t, r


def isas():
    try:
        from needle.backend_ndarray import ndarray_backend_cpu as cpu
    except ImportError:
        return [None]
    return list(cpu._available_isas())


# the device fixture only names a device: reusing it across examples is safe
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), n=sizes, dtype=dtypes,
       isa=st.sampled_from(isas()))
def test_fused_backward_matches_the_oracle(device, seed, n, dtype, isa):
    if device.name == "cuda" and dtype == "float16":
        return
    if isa is not None and device.name == "cpu":
        device.mod._set_isa(isa)
    try:
        g, t, r = draw(seed, n, dtype)
        G, T, R = (nd.array(a, device=device, dtype=dtype) for a in (g, t, r))
        g64, t64, r64 = (a.astype(np.float64) for a in (g, t, r))
        want = g64 * (1 - t64 * t64)
        got = G.tanh_grad(T).numpy().astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])
        # relu's backward is a mask: exact
        np.testing.assert_array_equal(G.relu_grad(R).numpy(), np.where(r > 0, g, 0 * g))
        assert G.tanh_grad(T).dtype == dtype
    finally:
        if device.name == "cpu":
            device.mod._set_isa("auto")


def test_fused_backward_refuses_mismatched_shapes(device):
    a = nd.array(np.ones(4), device=device)
    b = nd.array(np.ones(5), device=device)
    with pytest.raises(ValueError, match="tanh_grad"):
        a.tanh_grad(b)
