"""Fusion of elementwise runs (needle/compiler/fusion.py) and the ewise_program kernel.

A fused run must give bitwise the numbers of its kernels run one by one (same loops, same
order per element), on every backend that has ewise_program; the C++ kernel is checked
against the NumPy reference backend's; bad programs are refused before anything runs.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import needle as ndl
from needle.compiler.fusion import FUSIBLE, FusedCall, fuse
from needle.compiler.recorder import Alloc, Call, Ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # log, pow, div domains

DEVICES = ["cpu_numpy", "cpu"]
BINARY = sorted(n for n in FUSIBLE if n.startswith("ewise_") and n not in (
    "ewise_neg", "ewise_log", "ewise_exp", "ewise_tanh", "ewise_sqrt", "ewise_abs",
    "ewise_sign", "ewise_sigmoid"))
UNARY = ["ewise_neg", "ewise_exp", "ewise_tanh", "ewise_abs", "ewise_sign", "ewise_sigmoid",
         "ewise_sqrt", "ewise_log"]
SCALAR = sorted(n for n in FUSIBLE if n.startswith("scalar_"))


def _backend(name):
    return getattr(ndl, name)().mod


@st.composite
def chains(draw):
    """(ops, n inputs, n, dtype): a random run of fusible kernels over slots 0..k-1 (inputs)
    and new slots, each written once."""
    n = draw(st.sampled_from([1, 7, 255, 256, 257, 1000, 4099]))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    n_in = draw(st.integers(1, 3))
    ops, live = [], list(range(n_in))
    for _ in range(draw(st.integers(1, 9))):
        out = len(live) + sum(isinstance(o, Alloc) for o in ops) * 0
        out = max(live) + 1
        kind = draw(st.sampled_from(["bin", "un", "scalar"]))
        a = draw(st.sampled_from(live))
        ops.append(Alloc(out, n, dtype))
        if kind == "bin":
            b = draw(st.sampled_from(live))
            ops.append(Call(draw(st.sampled_from(BINARY)), None, (Ref(a), Ref(b), Ref(out))))
        elif kind == "un":
            ops.append(Call(draw(st.sampled_from(UNARY)), None, (Ref(a), Ref(out))))
        else:
            value = draw(st.sampled_from([0.0, 0.5, -1.25, 2.0, 3.0, 1e-3]))
            ops.append(Call(draw(st.sampled_from(SCALAR)), None, (Ref(a), value, Ref(out))))
        live.append(out)
    return ops, n_in, n, dtype


def _run_separately(mod, ops, bufs, n, dtype):
    for op in ops:
        if isinstance(op, Alloc):
            bufs[op.slot] = mod.Array(n, dtype)
        else:
            args = [bufs[a.slot] if isinstance(a, Ref) else a for a in op.args]
            getattr(mod, op.name)(*args)


def _inputs(mod, n_in, n, dtype, seed):
    rng = np.random.default_rng(seed)
    bufs = {}
    for s in range(n_in):
        values = rng.uniform(-3, 3, n).astype(dtype)
        values[::5] = np.abs(values[::5])  # keep some log/sqrt/power inputs in their domain
        bufs[s] = mod.Array(n, dtype)
        mod.from_numpy(values, bufs[s])
    return bufs


def _values(mod, buf, n):
    return mod.to_numpy(buf, (n,), (1,), 0)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(chain=chains(), seed=st.integers(0, 2**16))
def test_a_fused_run_equals_its_kernels_one_by_one_bitwise(device, chain, seed):
    ops, n_in, n, dtype = chain
    mod = _backend(device)
    want = _inputs(mod, n_in, n, dtype, seed)
    _run_separately(mod, ops, want, n, dtype)
    last = max(want)
    fused = fuse(ops, {s: (n, dtype) for s in want}, keep={last}, kernel=mod.ewise_program)
    got = _inputs(mod, n_in, n, dtype, seed)
    for op in fused:
        if isinstance(op, Alloc):
            got[op.slot] = mod.Array(n, dtype)
        elif isinstance(op, FusedCall):
            op.fn([got[s] for s in op.ins], [got[s] for s in op.outs], list(op.code),
                  list(op.scalars), op.n)
        else:
            _run_separately(mod, [op], got, n, dtype)
    if len(ops) >= 4:  # two kernels or more: one fused call, the last buffer written by it
        assert sum(isinstance(op, FusedCall) for op in fused) == 1
        assert fused[-1].outs == (last,)
    np.testing.assert_array_equal(_values(mod, got[last], n), _values(mod, want[last], n))


@settings(max_examples=40, deadline=None)
@given(chain=chains(), seed=st.integers(0, 2**16))
def test_the_cpp_ewise_program_matches_the_numpy_reference(chain, seed):
    ops, n_in, n, dtype = chain
    last = max(op.slot for op in ops if isinstance(op, Alloc))
    results = []
    for device in DEVICES:
        mod = _backend(device)
        bufs = _inputs(mod, n_in, n, dtype, seed)
        (call,) = [op for op in fuse(ops, {s: (n, dtype) for s in range(last + 1)},
                                     keep={last}, kernel=mod.ewise_program)
                   if isinstance(op, FusedCall)] or [None]
        if call is None:
            return  # a single kernel: nothing fused
        bufs[last] = mod.Array(n, dtype)
        call.fn([bufs[s] for s in call.ins], [bufs[last]], list(call.code), list(call.scalars),
                n)
        results.append(_values(mod, bufs[last], n))
    tol = 1e-5 if dtype == "float32" else 1e-12
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(results[1], results[0], rtol=tol, atol=tol)


def test_runs_stop_at_other_kernels_sizes_in_place_writes_and_shared_bytes():
    f32 = "float32"
    sizes = {0: (8, f32), 1: (8, f32), 2: (8, f32), 3: (8, f32), 4: (4, f32), 5: (8, f32)}
    ops = [Call("scalar_mul", None, (Ref(0), 2.0, Ref(1))),
           Call("ewise_add", None, (Ref(1), Ref(0), Ref(2))),
           Call("reduce_sum", None, (Ref(2), Ref(4), 2)),  # another kernel: the run ends
           Call("ewise_neg", None, (Ref(2), Ref(3))),
           Call("ewise_add", None, (Ref(3), Ref(3), Ref(3))),  # in place: not fused
           Call("ewise_mul", None, (Ref(3), Ref(0), Ref(5)))]
    fused = fuse(ops, sizes, keep={5}, kernel=None)
    kinds = [type(op).__name__ if isinstance(op, FusedCall) else op.name for op in fused]
    assert kinds == ["FusedCall", "reduce_sum", "ewise_neg", "ewise_add", "ewise_mul"]
    assert fused[0].outs == (2,)  # slot 1 lives in registers only
    # slots 1 and 2 sharing arena bytes must not meet in one run
    apart = fuse(ops[:2], sizes, keep={2}, kernel=None,
                 overlaps=lambda a, b: {a, b} == {1, 2})
    assert [type(op).__name__ for op in apart] == ["Call", "Call"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("code, message", [
    ([2, 0, 0, 1, 2], "read before set"),
    ([0, 0, 16, 0, 0], "outside"),
    ([0, 0, 0, 3, 0], "input 3"),
    ([0, 0, 0, 0, 0, 9, 0, 1, 0, 0], "unknown instruction"),
    ([0, 0, 0, 0, 0, 2, 42, 1, 0, 0], "unknown binary op"),
    ([0, 0, 0, 0, 0, 3, 0, 1, 0, 5], "scalar 5"),
    ([0, 0, 0, 0], "5 ints"),
    ([0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0], "output 0 stored twice"),
])
def test_bad_programs_are_refused(device, code, message):
    mod = _backend(device)
    a, out = mod.Array(4, "float32"), mod.Array(4, "float32")
    with pytest.raises(ValueError, match=message):
        mod.ewise_program([a], [out], code, [], 4)


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_alias_inputs_only_in_place_and_dtypes_must_agree(device):
    mod = _backend(device)
    a, b = mod.Array(4, "float32"), mod.Array(4, "float64")
    store = [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="output 0 shares its buffer with input 0"):
        mod.ewise_program([a], [a], store, [], 4)  # a copy onto itself
    out = mod.Array(4, "float32")
    with pytest.raises(ValueError, match="two outputs share a buffer"):
        mod.ewise_program([a], [out, out], store + [1, 0, 1, 0, 0], [], 4)
    with pytest.raises(ValueError, match="float32"):
        mod.ewise_program([b], [a], store, [], 4)
