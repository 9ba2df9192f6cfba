"""Kernel-level tests of the C++ CPU backend against the NumPy reference backend.

Both backends are called directly (no NDArray in between) with the same inputs; every entry
point of docs/backend_protocol.md is exercised for float32, float64 and float16, on both
kernel builds (AVX2 and baseline) where the CPU has AVX2.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from needle.backend_ndarray import ndarray_backend_numpy as ref

try:
    from needle.backend_ndarray import ndarray_backend_cpu as cpu
except ImportError:  # pragma: no cover - depends on the build
    pytest.skip("compiled module ndarray_backend_cpu is missing: build it with `pip install -e .`",
                allow_module_level=True)

# float16 overflow (70000 -> inf) and NaN results of negative bases are tested on purpose;
# NumPy warns about them inside the reference backend.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

DTYPES = ["float32", "float64", "float16"]
# (rtol, atol) per dtype: float32 allows a few ulp (fast exp/tanh), float16 one ulp.
TOL = {"float32": (2e-6, 1e-6), "float64": (1e-12, 1e-12), "float16": (2e-3, 2e-3)}


def _isas():
    """Every kernel build this CPU runs (avx512, avx2, baseline), widest first."""
    return list(cpu._available_isas())


ISAS = _isas()


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs a test once per kernel build the CPU can execute."""
    cpu._set_isa(request.param)
    yield request.param
    cpu._set_isa("auto")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = cpu.get_num_threads()
    cpu.set_num_threads(request.param)
    yield request.param
    cpu.set_num_threads(before)


def put(backend, values: np.ndarray, dtype: str):
    """A backend Array holding ``values`` (flattened) cast to ``dtype``."""
    arr = backend.Array(values.size, dtype)
    backend.from_numpy(np.ascontiguousarray(values), arr)
    return arr


def flat(backend, arr) -> np.ndarray:
    return backend.to_numpy(arr, (arr.size,), (1,), 0)


def both(values: np.ndarray, dtype: str):
    return put(ref, values, dtype), put(cpu, values, dtype)


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    assert actual.dtype == np.dtype(dtype)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                               rtol=rtol, atol=atol, equal_nan=True)


# ---- Array, from_numpy, to_numpy, fill ------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_array_attributes(dtype):
    arr = cpu.Array(37, dtype)
    assert (arr.size, arr.dtype, arr.itemsize) == (37, dtype, np.dtype(dtype).itemsize)
    assert arr.ptr() % 256 == 0
    assert cpu.Array(5).dtype == "float32"
    assert cpu.Array(0, dtype).size == 0
    assert cpu.Array(3, np.float64).dtype == "float64"


def test_module_constants():
    assert cpu.__device_name__ == "cpu"
    assert cpu.__tile_size__ == 8


@pytest.mark.parametrize("source", ["int64", "int8", "bool", "float64", "float16", "uint16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_from_numpy_casts_any_numeric_dtype(source, dtype):
    values = (np.arange(-6, 6) * 3).astype(source)
    r, c = both(values, dtype)
    np.testing.assert_array_equal(flat(cpu, c), flat(ref, r))


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_numpy_reads_strided_source(dtype):
    values = np.arange(24.0).reshape(4, 6)[:, ::2].T  # non-contiguous
    arr = cpu.Array(values.size, dtype)
    cpu.from_numpy(values, arr)
    np.testing.assert_array_equal(flat(cpu, arr), values.reshape(-1).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [0.0, -2.5, 1e-3, 70000.0])
def test_fill(dtype, value):
    r, c = ref.Array(300001, dtype), cpu.Array(300001, dtype)
    ref.fill(r, value)
    cpu.fill(c, value)
    np.testing.assert_array_equal(flat(cpu, c), flat(ref, r))


# ---- strided views: compact / ewise_setitem / scalar_setitem / to_numpy ----------------------

@st.composite
def strided_views(draw, max_dims=4):
    """(shape, strides, offset, buffer size): a view that stays inside its buffer."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=max_dims)))
    strides = tuple(draw(st.lists(st.integers(-7, 7), min_size=len(shape),
                                  max_size=len(shape))))
    low = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
    high = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
    offset = -low + draw(st.integers(0, 3))
    size = offset + high + 1 + draw(st.integers(0, 3))
    return shape, strides, offset, size


def _random(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size) * 10


@settings(max_examples=60, deadline=None)
@given(view=strided_views(), dtype=st.sampled_from(DTYPES))
def test_compact_and_to_numpy_match_reference(view, dtype):
    shape, strides, offset, size = view
    r, c = both(_random(size), dtype)
    n = int(np.prod(shape))
    rout, cout = ref.Array(n, dtype), cpu.Array(n, dtype)
    ref.compact(r, rout, shape, strides, offset)
    cpu.compact(c, cout, shape, strides, offset)
    np.testing.assert_array_equal(flat(cpu, cout), flat(ref, rout))
    np.testing.assert_array_equal(cpu.to_numpy(c, shape, strides, offset),
                                  ref.to_numpy(r, shape, strides, offset))


@settings(max_examples=60, deadline=None)
@given(view=strided_views(), dtype=st.sampled_from(DTYPES))
def test_ewise_setitem_matches_reference(view, dtype):
    shape, strides, offset, size = view
    n = int(np.prod(shape))
    positions = offset + sum(np.indices(shape)[d] * s for d, s in enumerate(strides))
    # A view that hits one element twice has no defined result (NumPy may reorder writes).
    assume(np.unique(positions).size == n)
    r, c = both(_random(size), dtype)
    rsrc, csrc = both(_random(n, seed=1), dtype)
    ref.ewise_setitem(rsrc, r, shape, strides, offset)
    cpu.ewise_setitem(csrc, c, shape, strides, offset)
    np.testing.assert_array_equal(flat(cpu, c), flat(ref, r))


@settings(max_examples=60, deadline=None)
@given(view=strided_views(), dtype=st.sampled_from(DTYPES), value=st.floats(-1e4, 1e4))
def test_scalar_setitem_matches_reference(view, dtype, value):
    shape, strides, offset, size = view
    n = int(np.prod(shape))
    r, c = both(_random(size), dtype)
    ref.scalar_setitem(n, value, r, shape, strides, offset)
    cpu.scalar_setitem(n, value, c, shape, strides, offset)
    np.testing.assert_array_equal(flat(cpu, c), flat(ref, r))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_views_use_threads_correctly(dtype, threads):
    # Big enough for the parallel path: a transposed, flipped, broadcast view of 400x600.
    base = _random(400 * 600, seed=3)
    r, c = both(base, dtype)
    cases = [((600, 400), (1, 600), 0), ((400, 600), (-600, -1), 400 * 600 - 1),
             ((3, 400, 600), (0, 600, 1), 0), ((400, 300), (600, 2), 1)]
    for shape, strides, offset in cases:
        np.testing.assert_array_equal(cpu.to_numpy(c, shape, strides, offset),
                                      ref.to_numpy(r, shape, strides, offset))
    dst_r, dst_c = both(np.zeros(400 * 600), dtype)
    src_r, src_c = both(_random(400 * 300, seed=4), dtype)
    ref.ewise_setitem(src_r, dst_r, (400, 300), (600, 2), 1)
    cpu.ewise_setitem(src_c, dst_c, (400, 300), (600, 2), 1)
    np.testing.assert_array_equal(flat(cpu, dst_c), flat(ref, dst_r))


# ---- elementwise ----------------------------------------------------------------------------

BINARY = ["add", "sub", "mul", "div", "maximum", "minimum", "power", "eq", "ge"]
SCALAR = ["add", "sub", "rsub", "mul", "div", "rdiv", "power", "rpower", "maximum", "minimum",
          "eq", "ge", "le"]
UNARY = ["neg", "log", "exp", "tanh", "sqrt", "abs", "sign", "sigmoid"]


def _operands(op: str, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.uniform(-4, 4, n)
    b = rng.uniform(-4, 4, n)
    if op in ("power", "rpower", "log", "sqrt"):
        a = np.abs(a) + 0.1  # positive bases; negative ones are tested separately
    if op in ("div", "rdiv"):
        b[np.abs(b) < 0.1] = 0.5
        a[np.abs(a) < 0.1] = 0.5
    if op in ("eq", "ge", "le"):
        b[::3] = a[::3]  # make equality happen
        a = np.round(a)
        b = np.round(b)
    return a, b


@pytest.mark.parametrize("n", [1, 13, 1000, 200003])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", BINARY)
def test_ewise_binary(op, dtype, n, isa):
    a, b = _operands(op, n)
    (ra, ca), (rb, cb) = both(a, dtype), both(b, dtype)
    rout, cout = ref.Array(n, dtype), cpu.Array(n, dtype)
    getattr(ref, f"ewise_{op}")(ra, rb, rout)
    getattr(cpu, f"ewise_{op}")(ca, cb, cout)
    assert_close(flat(cpu, cout), flat(ref, rout), dtype)


@pytest.mark.parametrize("n", [7, 200003])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", SCALAR)
@pytest.mark.parametrize("val", [1.5, -0.7, 2.0])
def test_scalar_ops(op, dtype, n, val, isa):
    a, _ = _operands(op, n)
    if op == "rdiv":
        a[np.abs(a) < 0.1] = 0.5
    if op in ("eq", "ge", "le"):
        a[::4] = val
    ra, ca = both(a, dtype)
    rout, cout = ref.Array(n, dtype), cpu.Array(n, dtype)
    getattr(ref, f"scalar_{op}")(ra, val, rout)
    getattr(cpu, f"scalar_{op}")(ca, val, cout)
    assert_close(flat(cpu, cout), flat(ref, rout), dtype)


@pytest.mark.parametrize("n", [1, 9, 1000, 200003])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", UNARY)
def test_ewise_unary(op, dtype, n, isa):
    a, _ = _operands(op, n)
    if op in ("exp", "tanh", "sigmoid"):
        a = a * 20  # cover the range reduction and saturation
    if dtype == "float16" and op == "exp":
        a = np.clip(a, -15, 11)  # keep float16 results finite
    ra, ca = both(a, dtype)
    rout, cout = ref.Array(n, dtype), cpu.Array(n, dtype)
    getattr(ref, f"ewise_{op}")(ra, rout)
    getattr(cpu, f"ewise_{op}")(ca, cout)
    assert_close(flat(cpu, cout), flat(ref, rout), dtype)


SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 88.5, 88.8, -87.5,
                    -103.0, -120.0, 1e30, -1e30, 0.6249, 0.6251, 9.0, -9.0, 20.0, 1e-5])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["exp", "tanh", "sigmoid", "abs", "sign", "neg", "sqrt", "log"])
def test_unary_special_values(op, dtype, isa):
    values = np.tile(SPECIAL, 3)  # long enough for the vector loop and a tail
    ra, ca = both(values, dtype)
    rout, cout = ref.Array(values.size, dtype), cpu.Array(values.size, dtype)
    with np.errstate(all="ignore"):
        getattr(ref, f"ewise_{op}")(ra, rout)
    getattr(cpu, f"ewise_{op}")(ca, cout)
    expected, actual = flat(ref, rout), flat(cpu, cout)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected))
    finite = np.isfinite(expected)
    rtol = TOL[dtype][0]
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=rtol, atol=1e-37)


@pytest.mark.parametrize("op", ["maximum", "minimum"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_maximum_minimum_propagate_nan(op, dtype, isa):
    a = np.array([np.nan, 1.0, np.nan, -np.inf, 2.0] * 5)
    b = np.array([1.0, np.nan, np.nan, 3.0, -1.0] * 5)
    (ra, ca), (rb, cb) = both(a, dtype), both(b, dtype)
    rout, cout = ref.Array(a.size, dtype), cpu.Array(a.size, dtype)
    getattr(ref, f"ewise_{op}")(ra, rb, rout)
    getattr(cpu, f"ewise_{op}")(ca, cb, cout)
    np.testing.assert_array_equal(flat(cpu, cout), flat(ref, rout))


@pytest.mark.parametrize("dtype", DTYPES)
def test_power_of_negative_base_is_nan(dtype):
    a = np.array([-2.0, -0.5, 4.0])
    (ra, ca) = both(a, dtype)
    rout, cout = ref.Array(3, dtype), cpu.Array(3, dtype)
    with np.errstate(invalid="ignore"):
        ref.scalar_power(ra, 0.5, rout)
    cpu.scalar_power(ca, 0.5, cout)
    assert_close(flat(cpu, cout), flat(ref, rout), dtype)


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_ewise_cast_is_exact(src, dst, isa):
    rng = np.random.default_rng(5)
    values = np.concatenate([rng.standard_normal(1000) * 100, rng.standard_normal(100) * 1e-6,
                             [np.inf, -np.inf, 65504.0, 65520.0, 1e6, 6e-8, 3e-8, 0.0, -0.0],
                             # float16 ties: exactly halfway between neighbours
                             1.0 + (np.arange(1, 40, 2) * 2.0**-11)])
    ra, ca = both(values, src)
    rout, cout = ref.Array(values.size, dst), cpu.Array(values.size, dst)
    with np.errstate(over="ignore"):
        ref.ewise_cast(ra, rout)
    cpu.ewise_cast(ca, cout)
    np.testing.assert_array_equal(flat(cpu, cout), flat(ref, rout))


def test_float64_to_float16_rounds_once():
    # 1 + 2^-11 + 2^-40 is just above a float16 tie; through float32 it would round to the tie
    # and then to even (1.0). Direct rounding gives the next float16 up, as NumPy does.
    value = np.array([1.0 + 2.0**-11 + 2.0**-40])
    c = put(cpu, value, "float64")
    out = cpu.Array(1, "float16")
    cpu.ewise_cast(c, out)
    assert flat(cpu, out)[0] == value.astype(np.float16)[0] != np.float16(1.0)


# ---- reductions -----------------------------------------------------------------------------

# (4, 0): empty blocks, for sum only: max/min of an empty block has no identity (NDArray
# rejects that call before any kernel runs).
_REDUCE_CASES = [(op, rows, size) for op in ("sum", "max", "min")
                 for rows, size in [(1, 1), (5, 7), (300, 1000), (1, 300001), (3, 100003),
                                    (100000, 3), (4, 0)]
                 if size or op == "sum"]


@pytest.mark.parametrize("op,rows,size", _REDUCE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions(op, dtype, rows, size, isa, threads):
    values = _random(rows * size, seed=rows + size)
    if dtype == "float16":
        values = values / 10  # keep float16 sums finite and comparable
    ra, ca = both(values, dtype)
    rout, cout = ref.Array(rows, dtype), cpu.Array(rows, dtype)
    getattr(cpu, f"reduce_{op}")(ca, cout, size)
    if size == 0:  # the reference cannot reshape an empty block; NumPy's empty sum is 0
        expected = np.zeros(rows, dtype)
    else:
        getattr(ref, f"reduce_{op}")(ra, rout, size)
        expected = flat(ref, rout)
    if op == "sum":
        # Summation orders differ: compare within a rounding-error bound of the sum.
        scale = np.abs(values.astype(dtype).astype(np.float64)).reshape(rows, size).sum(axis=1)
        err = np.abs(flat(cpu, cout).astype(np.float64) - expected.astype(np.float64))
        eps = float(np.finfo(dtype).eps)
        assert np.all(err <= 4 * eps * (scale + np.abs(expected)) + 1e-30)
    else:
        np.testing.assert_array_equal(flat(cpu, cout), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_max_propagates_nan(dtype):
    values = _random(3 * 50000)
    values[70000] = np.nan
    ra, ca = both(values, dtype)
    rout, cout = ref.Array(3, dtype), cpu.Array(3, dtype)
    ref.reduce_max(ra, rout, 50000)
    cpu.reduce_max(ca, cout, 50000)
    np.testing.assert_array_equal(flat(cpu, cout), flat(ref, rout))


# ---- matmul ---------------------------------------------------------------------------------

MATMUL_TOL = {"float32": (1e-4, 1e-4), "float64": (1e-10, 1e-10), "float16": (1e-2, 1e-1)}


def _matmul_case(m, n, p, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, n)), rng.standard_normal((n, p))
    return a.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("m", [1, 7, 65, 300])
@pytest.mark.parametrize("n", [1, 7, 65, 300])
@pytest.mark.parametrize("p", [1, 7, 65, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_odd_sizes(m, n, p, dtype, isa):
    a, b = _matmul_case(m, n, p, dtype)
    (ra, ca), (rb, cb) = both(a, dtype), both(b, dtype)
    rout, cout = ref.Array(m * p, dtype), cpu.Array(m * p, dtype)
    cpu.fill(cout, np.nan)  # matmul must overwrite, not accumulate
    ref.matmul(ra, rb, rout, m, n, p)
    cpu.matmul(ca, cb, cout, m, n, p)
    rtol, atol = MATMUL_TOL[dtype]
    np.testing.assert_allclose(flat(cpu, cout).astype(np.float64),
                               flat(ref, rout).astype(np.float64), rtol=rtol, atol=atol * n**0.5)


@pytest.mark.parametrize("shape", [(513, 700, 389), (2, 1000, 3000), (1000, 300, 2), (0, 5, 4),
                                   (4, 0, 5)])
def test_matmul_threaded_blocks(shape, threads, isa):
    m, n, p = shape
    a, b = _matmul_case(m, n, p, "float32", seed=1)
    ca, cb = put(cpu, a, "float32"), put(cpu, b, "float32")
    cout = cpu.Array(m * p)
    cpu.fill(cout, np.nan)
    cpu.matmul(ca, cb, cout, m, n, p)
    expected = (a.astype(np.float64) @ b.astype(np.float64)).reshape(-1)
    np.testing.assert_allclose(flat(cpu, cout), expected, rtol=1e-4, atol=1e-4 * max(n, 1)**0.5)


@pytest.mark.parametrize("shape,dtype", [
    ((128, 784, 100), "float32"),  # 313 KB of B, few rows of C: B read in place
    ((97, 600, 60), "float64"),    # the same in float64
    ((300, 784, 100), "float32"),  # more rows: B packed, every K block before the products
    ((128, 600, 128), "float32"),  # rows of B 8 lines apart (few L1 sets): packed, all at once
    ((64, 3000, 90), "float32"),   # B over 1 MiB: packed block by block
])
def test_matmul_on_two_threads_is_bitwise_one_thread(shape, dtype, isa):
    # How B is read (in place, packed all at once, block by block; src/matmul_impl.h) and how
    # rows are split (128 rows: 64 + 64) change with the shape; each C tile still sees the K
    # blocks in order on one thread, so two threads give one thread's bits.
    m, n, p = shape
    a, b = _matmul_case(m, n, p, dtype, seed=3)
    ca, cb = put(cpu, a, dtype), put(cpu, b, dtype)
    before = cpu.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            cpu.set_num_threads(threads)
            out = cpu.Array(m * p, dtype)
            cpu.fill(out, np.nan)
            cpu.matmul(ca, cb, out, m, n, p)
            outs.append(flat(cpu, out))
    finally:
        cpu.set_num_threads(before)
    np.testing.assert_array_equal(outs[0], outs[1])
    rtol, atol = MATMUL_TOL[dtype]
    np.testing.assert_allclose(outs[1].astype(np.float64),
                               (a.astype(np.float64) @ b.astype(np.float64)).reshape(-1),
                               rtol=rtol, atol=atol * n**0.5)


def _to_tiles(x: np.ndarray, t: int) -> np.ndarray:
    r, c = x.shape
    return x.reshape(r // t, t, c // t, t).transpose(0, 2, 1, 3).copy()


@pytest.mark.parametrize("m,n,p", [(8, 8, 8), (16, 24, 8), (64, 40, 72), (128, 96, 160)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_tiled_course_layout(m, n, p, dtype, isa):
    t = cpu.__tile_size__
    a, b = _matmul_case(m, n, p, dtype, seed=2)
    ca, cb = put(cpu, _to_tiles(a, t), dtype), put(cpu, _to_tiles(b, t), dtype)
    cout = cpu.Array(m * p, dtype)
    cpu.fill(cout, 7.0)  # "arrives uninitialised": the kernel must zero it
    cpu.matmul_tiled(ca, cb, cout, m, n, p)
    expected = _to_tiles(a.astype(np.float64) @ b.astype(np.float64), t).reshape(-1)
    rtol, atol = MATMUL_TOL[dtype]
    np.testing.assert_allclose(flat(cpu, cout).astype(np.float64), expected, rtol=rtol,
                               atol=atol * n**0.5)


# ---- threads, concurrency, errors -----------------------------------------------------------

def test_set_num_threads_round_trips():
    before = cpu.get_num_threads()
    try:
        cpu.set_num_threads(1)
        assert cpu.get_num_threads() == 1
        cpu.set_num_threads(2)
        assert cpu.get_num_threads() in (1, 2)  # 1 when built without OpenMP
        with pytest.raises(ValueError, match="set_num_threads"):
            cpu.set_num_threads(0)
    finally:
        cpu.set_num_threads(before)


def test_kernels_run_concurrently_from_python_threads():
    # Kernels release the GIL and keep per-thread workspaces: concurrent calls stay correct.
    a, b = _matmul_case(200, 300, 250, "float32", seed=9)
    ca, cb = put(cpu, a, "float32"), put(cpu, b, "float32")
    expected = a.astype(np.float64) @ b.astype(np.float64)
    errors = []

    def work():
        out = cpu.Array(200 * 250)
        for _ in range(5):
            cpu.matmul(ca, cb, out, 200, 300, 250)
            got = cpu.to_numpy(out, (200, 250), (250, 1), 0)
            errors.append(float(np.abs(got - expected).max()))

    workers = [threading.Thread(target=work) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert len(errors) == 15 and max(errors) < 1e-3


def test_bad_input_raises_instead_of_crashing():
    a, b, small = cpu.Array(6), cpu.Array(6), cpu.Array(2)
    with pytest.raises(ValueError, match="Array: size"):
        cpu.Array(-1)
    with pytest.raises(ValueError, match="unknown dtype"):
        cpu.Array(3, "floot32")
    with pytest.raises(ValueError, match="ewise_add"):
        cpu.ewise_add(small, b, a)
    with pytest.raises(TypeError, match="dtypes differ"):
        cpu.ewise_mul(a, cpu.Array(6, "float64"), b)
    with pytest.raises(IndexError, match="outside its buffer"):
        cpu.compact(a, b, (2, 3), (3, 2), 0)
    with pytest.raises(IndexError, match="outside its buffer"):
        cpu.to_numpy(a, (3,), (-1,), 1)
    with pytest.raises(ValueError, match="scalar_setitem"):
        cpu.scalar_setitem(5, 1.0, a, (6,), (1,), 0)
    with pytest.raises(ValueError, match="matmul"):
        cpu.matmul(a, b, small, 2, 3, 2)
    with pytest.raises(ValueError, match="share memory"):
        cpu.matmul(a, b, a, 2, 3, 2)
    with pytest.raises(ValueError, match="multiples of 8"):
        cpu.matmul_tiled(cpu.Array(64), cpu.Array(64), cpu.Array(64), 4, 16, 4)
    with pytest.raises(ValueError, match="from_numpy"):
        cpu.from_numpy(np.zeros(3), a)
    with pytest.raises(ValueError, match="reduce_sum"):
        cpu.reduce_sum(a, small, 4)
    with pytest.raises(ValueError, match="_set_isa"):
        cpu._set_isa("sse9")


def test_matmul_strided_checks_extents_and_strides():
    """The strided matmul refuses views that would read outside the buffer (no crash)."""
    cpu = pytest.importorskip("needle.backend_ndarray.ndarray_backend_cpu")
    a, b, out = cpu.Array(12), cpu.Array(12), cpu.Array(9)
    cpu.fill(a, 1.0)
    cpu.fill(b, 2.0)
    cpu.matmul_strided(a, b, out, 3, 4, 3, 0, 4, 1, 0, 1, 4)  # b read transposed
    np.testing.assert_array_equal(cpu.to_numpy(out, (3, 3), (3, 1), 0), np.full((3, 3), 8.0))
    with pytest.raises(ValueError, match="a too small"):
        cpu.matmul_strided(a, b, out, 3, 4, 3, 1, 4, 1, 0, 3, 1)
    with pytest.raises(ValueError, match="strides must be >= 0"):
        cpu.matmul_strided(a, b, out, 3, 4, 3, 0, -4, 1, 0, 3, 1)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n,p", [(1, 1), (3, 33), (4, 2048), (7, 2049), (320, 5000)])
@pytest.mark.parametrize("a_stride", [0, 1, 3], ids=["broadcast-row", "row", "strided-row"])
def test_row_vector_times_matrix_against_numpy(isa, dtype, n, p, a_stride):
    """m == 1 with B's rows contiguous (the column sums of every bias gradient) takes its
    own path: checked against NumPy on sliced B rows, several column strips, both thread
    counts, and bitwise the same on 1 and 2 threads."""
    rng = np.random.default_rng(n * 7919 + p)
    a_np = rng.standard_normal(max(1, (n - 1) * a_stride + 1)).astype(dtype)
    pad = 5  # B's rows lie p + 5 apart, from offset 2: a slice, not a compact matrix
    b_np = rng.standard_normal(2 + n * (p + pad)).astype(dtype)
    a_arr, b_arr = put(cpu, a_np, dtype), put(cpu, b_np, dtype)
    got = []
    before = cpu.get_num_threads()
    try:
        for threads in (1, 2):
            cpu.set_num_threads(threads)
            out = cpu.Array(p, dtype)
            cpu.matmul_strided(a_arr, b_arr, out, 1, n, p, 0, 0, a_stride, 2, p + pad, 1)
            got.append(cpu.to_numpy(out, (1, p), (p, 1), 0))
    finally:
        cpu.set_num_threads(before)
    a_view = np.lib.stride_tricks.as_strided(a_np, (1, n), (0, a_stride * a_np.itemsize))
    b_view = np.lib.stride_tricks.as_strided(b_np[2:], (n, p), ((p + pad) * b_np.itemsize,
                                                                  b_np.itemsize))
    want = a_view.astype("float64") @ b_view.astype("float64")
    rtol, atol = (1e-5, 1e-5) if dtype == "float32" else (1e-12, 1e-12)
    np.testing.assert_allclose(got[0], want, rtol=rtol, atol=atol * np.sqrt(n))
    np.testing.assert_array_equal(got[0], got[1])
