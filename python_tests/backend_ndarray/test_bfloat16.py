"""bfloat16 on every backend: cpu_numpy (ml_dtypes), cpu (C++) and cuda (its .cu kernels, on
the CUDA emulator here and on the device where there is one).

The oracle is ml_dtypes: each op computed in float32 on the bfloat16 inputs and rounded once
(round to nearest even). Conversions are checked bit for bit at the edges of the format.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backend_ndarray import NDArray

BF16 = np.dtype(ml_dtypes.bfloat16)
ULP = 2.0 ** -7  # bfloat16's spacing just above 1: a relative error of one unit in the last place


@pytest.fixture(params=["cpu_numpy", "cpu", "cuda_emulated",
                        pytest.param("cuda", marks=pytest.mark.cuda)])
def bdev(request):
    if request.param == "cuda_emulated":
        return request.getfixturevalue("emulated_cuda")
    dev = nd.device_by_name(request.param)
    if not dev.enabled():
        pytest.skip(f"{request.param}() backend not available here")
    return dev


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16)


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit patterns; a NaN only needs to be a NaN (its payload is not specified)."""
    assert got.dtype == want.dtype == BF16
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(bits(got)[~nan], bits(want)[~nan])


# Edge values of the float -> bfloat16 rounding, as float64: ties to even both ways, just past
# a tie, the largest finite value, the overflow threshold, infinities, NaN, signed zero,
# bfloat16 subnormals (down to half the smallest, a tie with zero) and float32 subnormals.
EDGES = np.array([
    1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -8 + 2.0 ** -20, -(1.0 + 2.0 ** -8),
    float(ml_dtypes.finfo(BF16).max), 3.3961e38, 3.3962e38, 3.4e38, np.inf, -np.inf, np.nan,
    -np.nan, 0.0, -0.0, 2.0 ** -133, 2.0 ** -134, 3 * 2.0 ** -134, 1e-40, -1e-40, 2.0 ** -149,
    1e-45, 65504.0, 0.1, -2.5, 300.0,
])


def test_conversions_round_to_nearest_even_like_ml_dtypes(bdev):
    """float32 -> bfloat16 (cast kernel), float64 -> bfloat16 (one rounding, no double
    rounding), fill and scalar rounding, and the widening casts, at every edge."""
    with np.errstate(over="ignore"):
        f32 = EDGES.astype(np.float32)
    from_f32 = NDArray(f32, device=bdev, dtype="float32").astype("bfloat16").numpy()
    assert_same_bits(from_f32, f32.astype(BF16))
    # 1 + 2^-8 + 2^-30 is a tie in float32 but above it in float64: rounds up only directly
    f64 = np.append(EDGES, 1.0 + 2.0 ** -8 + 2.0 ** -30)
    from_f64 = NDArray(f64, device=bdev, dtype="float64").astype("bfloat16").numpy()
    assert_same_bits(from_f64, f64.astype(BF16))
    assert bits(from_f64)[-1] == 0x3F81
    for value in (1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.4e38, 2.0 ** -134):
        filled = NDArray.make((3,), device=bdev, dtype="bfloat16")
        filled.fill(value)
        assert_same_bits(filled.numpy(), np.full(3, value).astype(BF16))
    x = f32.astype(BF16)
    a = NDArray(x, device=bdev)
    assert a.dtype == "bfloat16"
    finite = np.isfinite(x.astype(np.float32))
    for dst in ("float32", "float64", "float16"):
        with np.errstate(over="ignore"):  # the largest bfloat16 values overflow float16
            got, want = a.astype(dst).numpy(), x.astype(dst)
        np.testing.assert_array_equal(got[finite], want[finite])
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    h = np.array([1.0, 2.0 ** -24, 65504.0, -np.inf, 0.333], np.float16)
    assert_same_bits(NDArray(h, device=bdev, dtype="float16").astype("bfloat16").numpy(),
                     h.astype(BF16))


def _ref(fn, *xs):
    """fn in float32 on the bfloat16 inputs, rounded once."""
    with np.errstate(all="ignore"):
        return np.asarray(fn(*(np.asarray(x, np.float32) for x in xs))).astype(BF16)


EXACT = {  # one float32 operation then one rounding: every backend gives these bits
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "sub": (lambda a, b: a - b, lambda a, b: a - b),
    "mul": (lambda a, b: a * b, lambda a, b: a * b),
    "div": (lambda a, b: a / b, lambda a, b: a / b),
    "maximum": (lambda a, b: a.maximum(b), np.maximum),
    "ge": (lambda a, b: a >= b, lambda a, b: (a >= b).astype(np.float32)),
    "scalar_mul": (lambda a, b: a * 0.3, lambda a, b: a * np.float32(BF16.type(0.3))),
    "scalar_rsub": (lambda a, b: 1.7 - a, lambda a, b: np.float32(BF16.type(1.7)) - a),
    "neg": (lambda a, b: -a, lambda a, b: -a),
    "abs": (lambda a, b: a.abs(), lambda a, b: np.abs(a)),
    "sqrt": (lambda a, b: b.sqrt(), lambda a, b: np.sqrt(b)),
}
APPROX = {  # transcendental functions: within one unit in the last place of bfloat16
    "exp": (lambda a, b: a.exp(), lambda a, b: np.exp(a)),
    "log": (lambda a, b: b.log(), lambda a, b: np.log(b)),
    "tanh": (lambda a, b: a.tanh(), lambda a, b: np.tanh(a)),
    "sigmoid": (lambda a, b: a.sigmoid(), lambda a, b: 1 / (1 + np.exp(-a))),
    "power": (lambda a, b: b ** 1.5, lambda a, b: b ** np.float32(1.5)),
}


def _operands(bdev, view: str):
    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, (6, 10)).astype(BF16)
    y = rng.uniform(0.25, 4, (6, 10)).astype(BF16)
    a, b = NDArray(x, device=bdev), NDArray(y, device=bdev)
    if view == "transposed":  # non-compact views: the kernels read through the strides
        return a.permute((1, 0)), b.permute((1, 0)), x.T, y.T
    if view == "sliced":
        return a[1:5, ::3], b[1:5, ::3], x[1:5, ::3], y[1:5, ::3]
    return a, b, x, y


@pytest.mark.parametrize("view", ["compact", "transposed", "sliced"])
def test_elementwise_ops_compute_in_float32_and_round_once(bdev, view):
    a, b, x, y = _operands(bdev, view)
    for name, (op, ref) in EXACT.items():
        got = op(a, b)
        assert got.dtype == "bfloat16", name
        assert_same_bits(got.numpy(), _ref(ref, x, y))
    for name, (op, ref) in APPROX.items():
        got, want = op(a, b).numpy().astype(np.float32), _ref(ref, x, y).astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=ULP, atol=1e-30, err_msg=name)


def test_reductions_and_matmul_accumulate_in_float32(bdev):
    """Sums add in float32 (a bfloat16 accumulator would stop growing at 256 here) and round
    once; max is exact; products widen both operands, multiply in float32, round once."""
    rng = np.random.default_rng(1)
    x = rng.uniform(0.5, 1.5, (300, 8)).astype(BF16)
    a = NDArray(x, device=bdev)
    wide = x.astype(np.float32)
    for axis in (0, 1):  # leading axis (column sums) and last axis
        got = a.sum(axis=axis).numpy().astype(np.float32)
        np.testing.assert_allclose(got, wide.sum(axis=axis), rtol=ULP)
        assert_same_bits(a.max(axis=axis).numpy(), wide.max(axis=axis).astype(BF16))
    assert float(a.sum().numpy().astype(np.float32)) == pytest.approx(wide.sum(), rel=ULP)
    m = rng.uniform(-1, 1, (7, 33)).astype(BF16)
    w = rng.uniform(-1, 1, (9, 33)).astype(BF16)
    got = (NDArray(m, device=bdev) @ NDArray(w, device=bdev).permute((1, 0))).numpy()
    assert got.dtype == BF16
    want = m.astype(np.float32) @ w.astype(np.float32).T
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=ULP, atol=ULP * 2 ** -8)


def test_numpy_arrays_keep_bfloat16():
    from needle import Tensor

    x = np.array([1.5, -2.0, 3.25], BF16)
    t = Tensor(x, device=nd.cpu_numpy())
    assert t.dtype == "bfloat16" and t.numpy().dtype == BF16
    assert_same_bits(t.numpy(), x)
    assert NDArray([1.0, 2.0], device=nd.cpu_numpy()).dtype == "float32"  # course default
