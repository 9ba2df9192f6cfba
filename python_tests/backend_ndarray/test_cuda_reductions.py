"""The CUDA reductions (cuda_kernels/reduce.cu) on every launch path, against NumPy.

Runs on the GPU when ``cuda()`` is enabled, else on the host emulator (2 SMs, so the shapes
below are small and still reach every path: one thread, one warp or one block per row, rows
split across blocks; column sums, max and min in row order, with row lanes, split across
blocks). Sums
of whole numbers are exact in any order, so those compare bitwise with NumPy and any element
dropped or read twice shows. The plan tests count blocks and launches for 1e8 elements on an
H100/H200 without running anything.
"""
from __future__ import annotations

import numpy as np
import pytest
from _cuda_emulator import compiler_available

import needle.backend_ndarray as nd
from needle.backend_ndarray import ndarray_backend_cuda as B
from needle.backend_ndarray._cuda import launch as L
from needle.backend_ndarray._cuda import runtime

# (rows, reduce_size, kind with 2 SMs): odd lengths put most rows off a 16-byte boundary
ROW_CASES = ((5, 7, "small"), (9, 33, "warp"), (3, 1021, "warp"), (2, 1024, "warp"),
             (9, 1031, "block"), (8, 4099, "block"), (1, 70_001, "split"),
             (3, 20_003, "split"))
# (m, n): row order, row lanes with one- and many-column loads, split across blocks
LEADING_CASES = ((5, 7), (200, 33), (300, 7), (300, 64), (300, 66), (1, 5), (4000, 300),
                 (65_536, 17))
SMS = (114, 132)  # H100 PCIe, H100 SXM / H200
# Every path in float32; the other dtypes on the unaligned warp, block and split paths.
ROW_PARAMS = ([("float32", *case) for case in ROW_CASES]
              + [(dt, *ROW_CASES[i]) for dt in ("float64", "float16") for i in (2, 5, 7)])
NAN_PARAMS = ([("float32", *ROW_CASES[i]) for i in (1, 4, 7)]
              + [("float16", *ROW_CASES[7]), ("float64", *ROW_CASES[2])])
LEADING_PARAMS = ([("float32", *case) for case in LEADING_CASES]
                  + [(dt, *LEADING_CASES[i]) for dt in ("float64", "float16")
                     for i in (1, 4, 6)])


@pytest.fixture(scope="module")
def backend(request):
    """The GPU backend where there is one, else the same module on the emulator."""
    if nd.cuda().enabled():
        return B
    if not compiler_available():
        pytest.skip("no GPU and no g++ for the CUDA emulator")
    request.getfixturevalue("emulated_cuda")
    return B


def _num_sms() -> int:
    return runtime.num_sms(runtime.device_id())


def _put(x: np.ndarray):
    arr = B.Array(x.size, x.dtype.name)
    B.from_numpy(np.ascontiguousarray(x).ravel(), arr)
    return arr


def _get(arr) -> np.ndarray:
    return B.to_numpy(arr, (arr.size,), (1,), 0)


def _whole_numbers(rng, shape, dtype) -> np.ndarray:
    # -1, 0, 1: every partial sum is exact in float16's float accumulator and in the result
    return rng.integers(-1, 2, size=shape).astype(dtype)


def _reduce(op: str, x: np.ndarray) -> np.ndarray:
    out = B.Array(x.shape[0], x.dtype.name)
    getattr(B, f"reduce_{op}")(_put(x), out, x.shape[1])
    return _get(out)


def _leading(op: str, x: np.ndarray) -> np.ndarray:
    out = B.Array(x.shape[1], x.dtype.name)
    getattr(B, f"reduce_{op}_leading")(_put(x), out, *x.shape)
    return _get(out)


def _sum_leading(x: np.ndarray) -> np.ndarray:
    return _leading("sum", x)


# ---- plans: counts only ------------------------------------------------------------------
@pytest.mark.parametrize("sms", SMS)
def test_row_plans_for_1e8_elements_fill_the_gpu(sms):
    """1e8 elements over the last axis: at least 4 blocks per SM, at most 2 launches."""
    for rows, size in ((1, 10**8), (10, 10**7), (10**4, 10**4)):
        plan = L.plan_reduce(rows, size, sms)
        assert plan.kind in ("block", "split") and plan.launches <= 2
        assert plan.blocks >= 4 * sms, (rows, size, plan)
    many = L.plan_reduce(10**6, 100, sms)  # short rows: a warp each, one launch
    assert many.kind == "warp" and many.launches == 1 and many.blocks * 8 >= 10**6


@pytest.mark.parametrize("sms", SMS)
def test_leading_plans_for_1e8_elements_fill_the_gpu(sms):
    """1e8 elements over leading axes: 16-byte loads when aligned, >= 4 blocks per SM,
    at most 2 launches, few columns included."""
    for m, n in ((10**4, 10**4), (10**6, 100), (10**7, 10), (10**8, 1), (2 * 10**5, 500)):
        plan = L.plan_reduce_leading(m, n, 4, 0, sms)
        assert plan.launches <= 2 and plan.blocks >= 4 * sms, (m, n, plan)
        assert plan.width == (4 if n % 4 == 0 else 2 if n % 2 == 0 else 1)
        assert plan.lanes * plan.width >= min(n, L.THREADS_PER_BLOCK), (m, n, plan)


def test_leading_load_width_follows_alignment_and_dtype():
    assert L.plan_reduce_leading(300, 64, 4, 256, 132).width == 4
    assert L.plan_reduce_leading(300, 64, 4, 264, 132).width == 2  # 8-byte aligned
    assert L.plan_reduce_leading(300, 64, 4, 260, 132).width == 1
    assert L.plan_reduce_leading(300, 6, 4, 0, 132).width == 2
    assert L.plan_reduce_leading(300, 64, 8, 0, 132).width == 2
    assert L.plan_reduce_leading(300, 64, 2, 0, 132).width == 8


def test_leading_plan_keeps_row_order_for_batches():
    """A batch's bias gradient (<= 256 rows) adds each column in row order, one launch:
    bitwise the NumPy and C++ backends."""
    for m, n in ((128, 100), (256, 7), (1, 10**6)):
        plan = L.plan_reduce_leading(m, n, 4, 0, 132)
        assert plan.ordered and plan.launches == 1
    assert not L.plan_reduce_leading(257, 7, 4, 0, 132).ordered
    assert L.plan_reduce_leading(10**6, 7, 4, 0, 132, split=False).ordered


# ---- values ------------------------------------------------------------------------------
# ~20 s on the emulator of a loaded 2-core machine; a fraction of a second on a GPU
_emulated = pytest.mark.slow


@_emulated
@pytest.mark.parametrize("dtype,rows,size,kind", ROW_PARAMS, ids=str)
def test_row_reductions_every_path(backend, dtype, rows, size, kind):
    if _num_sms() == 2:  # the emulator: the shape takes the path it is listed for
        assert L.plan_reduce(rows, size, 2).kind == kind
    rng = np.random.default_rng(rows * 7 + size)
    whole = _whole_numbers(rng, (rows, size), dtype)
    np.testing.assert_array_equal(_reduce("sum", whole), whole.astype(np.float64).sum(1))
    x = rng.uniform(-2, 2, (rows, size)).astype(dtype)
    np.testing.assert_array_equal(_reduce("max", x), x.max(1))
    np.testing.assert_array_equal(_reduce("min", x), x.min(1))


@_emulated
@pytest.mark.parametrize("dtype,rows,size,kind", NAN_PARAMS, ids=str)
def test_row_reductions_propagate_nan(backend, dtype, rows, size, kind):
    """NaN in a row's unaligned head, its vector body and its tail: max, min and sum of
    that row are NaN, as in NumPy; the other rows are not."""
    x = np.random.default_rng(3).uniform(-2, 2, (rows, size)).astype(dtype)
    where = {0: 0, rows - 1: size - 1}
    if rows > 2:
        where[1] = size // 2
    for row, col in where.items():
        x[row, col] = np.nan
    for op in ("max", "min", "sum"):
        got = _reduce(op, x)
        assert np.isnan(got[list(where)]).all(), (op, got)
        assert not np.isnan(np.delete(got, list(where))).any(), (op, got)


@_emulated
@pytest.mark.parametrize("dtype,m,n", LEADING_PARAMS, ids=str)
def test_sum_leading_every_path(backend, dtype, m, n):
    rng = np.random.default_rng(m + n)
    whole = _whole_numbers(rng, (m, n), dtype)
    np.testing.assert_array_equal(_sum_leading(whole), whole.astype(np.float64).sum(0))
    x = rng.uniform(-2, 2, (m, n)).astype(dtype)
    got = _sum_leading(x)
    plan = L.plan_reduce_leading(m, n, x.itemsize, 0, _num_sms())
    if plan.ordered:  # row by row in the compute type, bitwise
        total = np.zeros(n, np.float32 if dtype == "float16" else dtype)
        for row in x:
            total += row
        np.testing.assert_array_equal(got, total.astype(dtype))
    else:
        exact = x.astype(np.float64).sum(0)
        eps = {"float32": 1.2e-7, "float64": 2.3e-16, "float16": 9.8e-4}[dtype]
        bound = np.abs(x.astype(np.float64)).sum(0) * 64 * eps + (eps if dtype == "float16"
                                                                 else 0.0)
        assert np.all(np.abs(got.astype(np.float64) - exact) <= bound)


@_emulated
@pytest.mark.parametrize("dtype,m,n", LEADING_PARAMS, ids=str)
def test_max_min_leading_every_path(backend, dtype, m, n):
    """Column max and min on the column sums' paths; a NaN in a column (first row, a middle
    row, the last row) makes that column's max and min NaN, as in NumPy."""
    x = np.random.default_rng(m * n).uniform(-2, 2, (m, n)).astype(dtype)
    for op in ("max", "min"):
        np.testing.assert_array_equal(_leading(op, x), getattr(x, op)(0))
    if n >= 3:
        x[0, 0] = x[m // 2, 1] = x[m - 1, n - 1] = np.nan
        for op in ("max", "min"):
            got = _leading(op, x)
            assert np.isnan(got[[0, n - 1]]).all() and (m == 1 or np.isnan(got[1])), got
            assert not np.isnan(got[2:n - 1]).any(), got


@_emulated
def test_split_reductions_are_deterministic(backend):
    """The same input gives the same bits again: partials combine in a fixed order."""
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((2, 50_001)).astype(np.float32)
    cols = rng.standard_normal((20_000, 60)).astype(np.float32)
    assert L.plan_reduce(2, 50_001, _num_sms()).launches == 2
    assert L.plan_reduce_leading(20_000, 60, 4, 0, _num_sms()).launches == 2
    np.testing.assert_array_equal(_reduce("sum", rows), _reduce("sum", rows))
    np.testing.assert_array_equal(_sum_leading(cols), _sum_leading(cols))


@_emulated
@pytest.mark.parametrize("grid", [1, 3])
def test_leading_blocks_that_walk_several_column_blocks_give_the_same_bits(backend,
                                                                          monkeypatch, grid):
    """A grid smaller than the plan's (chunk, column block) pairs (the grid-stride loop of
    the column kernels): every block reuses its shared partials for the next pair, and the
    sums, maxima and minima are those of the full grid bit for bit."""
    rng = np.random.default_rng(grid)
    cases = [rng.uniform(-2, 2, (300, 4000)).astype(np.float32),  # 2 chunks x 4 column blocks
             rng.uniform(-2, 2, (20_000, 60)).astype(np.float32)]  # 16 row lanes, 8 chunks
    want = [[_sum_leading(x), _leading("max", x), _leading("min", x)] for x in cases]
    monkeypatch.setattr(L, "MAX_GRID_X", grid)
    for x, full in zip(cases, want, strict=True):
        plan = L.plan_reduce_leading(*x.shape, x.itemsize, 0, _num_sms())
        assert plan.blocks > grid and not plan.ordered, plan
        got = [_sum_leading(x), _leading("max", x), _leading("min", x)]
        for g, w in zip(got, full, strict=True):
            np.testing.assert_array_equal(g, w)


@_emulated
def test_ndarray_reductions_of_views(backend):
    """NDArray on cuda(): sums, max and min over the last axis and leading axes of compact
    arrays (max and min over leading axes through the column kernels, no copy) and of
    permuted, sliced views, against NumPy."""
    dev = nd.BackendDevice("cuda", B)
    rng = np.random.default_rng(11)
    whole = rng.integers(-3, 4, (4, 24, 70)).astype(np.float32)
    a = nd.NDArray(whole, device=dev)
    views = {"compact": (a, whole),
             "permuted": (a.permute((2, 0, 1)), whole.transpose(2, 0, 1)),
             "sliced": (a[1:4, ::3, 3:], whole[1:4, ::3, 3:])}
    column_max = runtime.function("reduce.cu", "reduce_max_leading_f32")
    before = len(getattr(column_max, "launches", ()))
    np.testing.assert_array_equal(a.max(axis=(0, 1)).numpy(), whole.max(axis=(0, 1)))
    if hasattr(column_max, "launches"):  # the emulator counts launches: one, and no copy
        assert len(column_max.launches) == before + 1
    for name, (view, ref) in views.items():
        for op, axis in (("sum", 2), ("sum", 0), ("sum", (0, 1)), ("max", 2), ("max", 0),
                         ("min", (0, 1))):
            np.testing.assert_array_equal(getattr(view, op)(axis=axis).numpy(),
                                          getattr(ref, op)(axis=axis),
                                          err_msg=f"{name} {op} {axis}")
