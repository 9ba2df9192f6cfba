"""Run by test_ops_cases.py in a subprocess with NEEDLE_BACKEND=np (not collected directly)."""
from __future__ import annotations

import numpy as np
import pytest
from op_cases import CASES, as_list, make_inputs

from needle.autograd import Tensor, gradcheck
from needle.backend_selection import BACKEND

IDS = [c.name for c in CASES]


def test_backend_is_numpy():
    assert BACKEND == "np"
    assert isinstance(Tensor([1.0]).realize_cached_data(), np.ndarray)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_gradcheck(case):
    arrays = make_inputs(case)
    xs = [Tensor(a) for a in arrays]
    assert all(x.dtype == np.float64 for x in xs)  # np mode keeps NumPy's float64
    got, want = as_list(case.fn(*xs)), as_list(case.ref(*arrays))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    assert gradcheck(case.fn, *xs, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32_kept(case):
    arrays = make_inputs(case)
    out = as_list(case.fn(*[Tensor(a, dtype="float32") for a in arrays]))
    for o, w in zip(out, as_list(case.ref(*arrays)), strict=True):
        assert o.dtype == np.float32
        np.testing.assert_allclose(o, w, rtol=2e-4, atol=2e-4)
