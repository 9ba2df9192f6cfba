"""Every op: forward vs NumPy (float64), gradcheck (float64), float32 vs float64, per device."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from op_cases import CASES, as_list, make_inputs

from needle.autograd import Tensor, gradcheck
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode tests (np mode: subprocess)")
IDS = [c.name for c in CASES]


def _tensors(arrays, device, dtype):
    return [Tensor(a, device=device, dtype=dtype) for a in arrays]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_numpy_float64(case, device):
    arrays = make_inputs(case)
    got = as_list(case.fn(*_tensors(arrays, device, "float64")))
    want = as_list(case.ref(*arrays))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradcheck_float64(case, device):
    arrays = make_inputs(case)
    assert gradcheck(case.fn, *_tensors(arrays, device, "float64"), atol=1e-6, rtol=1e-4)


def _forward_backward(case, arrays, device, dtype):
    xs = _tensors(arrays, device, dtype)
    outs = as_list_tensors(case.fn(*xs))
    rng = np.random.default_rng(1)
    loss = None
    for o in outs:
        w = Tensor(rng.standard_normal(o.shape), device=device, dtype=dtype,
                   requires_grad=False)
        term = (o * w).sum()
        loss = term if loss is None else loss + term
    loss.backward()
    grads = [x.grad.numpy() for x in xs]
    return [o.numpy() for o in outs], grads


def as_list_tensors(value):
    if getattr(value, "_is_tuple", False):
        return [value[i] for i in range(len(value))]
    return [value]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32_matches_float64(case, device):
    arrays = make_inputs(case)
    out32, grad32 = _forward_backward(case, arrays, device, "float32")
    out64, grad64 = _forward_backward(case, arrays, device, "float64")
    for a, b in zip(out32 + grad32, out64 + grad64, strict=True):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


def test_np_mode_subprocess():
    """The same cases under NEEDLE_BACKEND=np (the backend is fixed at import)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NEEDLE_BACKEND="np")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         os.path.join(here, "np_mode_ops.py")],
        env=env, capture_output=True, text=True, timeout=240, cwd=here)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_create_graph_gradients_equal_plain(case, device):
    """Gradients built as Tensor ops (create_graph) and straight from arrays agree."""
    arrays = make_inputs(case)
    results = []
    for create_graph in (False, True):
        xs = _tensors(arrays, device, "float64")
        outs = as_list_tensors(case.fn(*xs))
        loss = None
        for i, o in enumerate(outs):
            w = Tensor(np.random.default_rng(i).standard_normal(o.shape), device=device,
                       dtype="float64", requires_grad=False)
            loss = (o * w).sum() if loss is None else loss + (o * w).sum()
        loss.backward(create_graph=create_graph)
        if not create_graph:
            assert not any(x.grad.requires_grad for x in xs)
        results.append([x.grad.numpy() for x in xs])
    for plain, graph in zip(*results, strict=True):
        np.testing.assert_allclose(plain, graph, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float16_forward_and_grad_dtype(case, device):
    """float16 keeps its dtype through forward and backward (loose tolerance: 11-bit mantissa)."""
    arrays = make_inputs(case)
    xs = _tensors(arrays, device, "float16")
    out = case.fn(*xs)
    outs = as_list_tensors(out)
    for o, w in zip(outs, as_list(case.ref(*arrays)), strict=True):
        assert o.dtype == "float16"
        np.testing.assert_allclose(o.numpy().astype(np.float64), w, rtol=2e-2, atol=5e-2)
    loss = outs[0].sum()
    for o in outs[1:]:
        loss = loss + o.sum()
    loss.backward()
    assert all(x.grad.dtype == "float16" for x in xs)
