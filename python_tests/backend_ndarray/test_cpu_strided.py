"""The fast paths of the C++ strided copies (compact / ewise_setitem) against NumPy views.

test_cpu_kernels.py covers small random views; these views are big enough to take the tiled
transposing path (a strided innermost dim with a contiguous dim elsewhere), the broadcast-row
fill and the threaded split, and mirror what the framework really compacts: permutes,
transposes, conv's im2col windows, broadcasts.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    from needle.backend_ndarray import ndarray_backend_cpu as cpu
except ImportError:  # pragma: no cover - depends on the build
    pytest.skip("compiled module ndarray_backend_cpu is missing: build it with `pip install -e .`",
                allow_module_level=True)

DTYPES = ["float32", "float64", "float16"]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = cpu.get_num_threads()
    cpu.set_num_threads(request.param)
    yield request.param
    cpu.set_num_threads(before)


def _array(values: np.ndarray):
    arr = cpu.Array(values.size, str(values.dtype))
    cpu.from_numpy(values, arr)
    return arr


def _flat(arr) -> np.ndarray:
    return cpu.to_numpy(arr, (arr.size,), (1,), 0)


def _expected_view(base: np.ndarray, shape, strides, offset) -> np.ndarray:
    item = base.itemsize
    return np.lib.stride_tricks.as_strided(base[offset:], shape, [s * item for s in strides])


def check_view(base: np.ndarray, shape, strides, offset) -> None:
    """compact == NumPy's copy of the view; ewise_setitem writes exactly the view's elements."""
    shape, strides = tuple(shape), tuple(strides)
    src = _array(base)
    n = int(np.prod(shape))
    out = cpu.Array(n, str(base.dtype))
    cpu.compact(src, out, shape, strides, offset)
    want = _expected_view(base, shape, strides, offset)
    np.testing.assert_array_equal(_flat(out), want.reshape(-1))

    values = (np.arange(n) % 251 - 125).astype(base.dtype)
    dst_np = base.copy()
    # Negative strides reach below `offset`: write through a view of the whole buffer.
    target = np.lib.stride_tricks.as_strided(dst_np[offset:], shape,
                                             [s * base.itemsize for s in strides])
    target[...] = values.reshape(shape)
    dst = _array(base)
    cpu.ewise_setitem(_array(values), dst, shape, strides, offset)
    np.testing.assert_array_equal(_flat(dst), dst_np)


def _base(size: int, dtype: str, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(size) * 100).astype(dtype)


def _compact_strides(shape) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(16, 16), (37, 53), (100, 17), (17, 300), (600, 400)])
def test_transposes(dtype, rows, cols, threads):
    base = _base(rows * cols, dtype)
    check_view(base, (cols, rows), (1, cols), 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_permute_of_a_4d_array(dtype):
    shape = (3, 20, 17, 18)
    base = _base(int(np.prod(shape)), dtype)
    strides = _compact_strides(shape)
    for perm in itertools.permutations(range(4)):
        check_view(base, [shape[p] for p in perm], [strides[p] for p in perm], 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c,h,w", [(3, 32, 32), (2, 5, 7), (3, 1, 9), (2, 17, 19), (3, 4, 2)])
def test_nchw_images_viewed_as_nhwc(dtype, c, h, w, threads):
    """The narrow-channel path: 2-3 channels far apart, pixels contiguous (conv1's input);
    odd pixel counts leave quads and single pixels at the end of each 256-pixel block."""
    n = 5
    base = _base(n * c * h * w, dtype)
    check_view(base, (n, h, w, c), (c * h * w, w, 1, h * w), 0)
    # a flipped channel order and a batch slice (offset) take the same path
    check_view(base, (n - 1, h, w, c), (c * h * w, w, 1, -h * w), c * h * w + (c - 1) * h * w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flipped_and_offset_transposes(dtype, threads):
    rows, cols = 300, 200
    base = _base(rows * cols + 5, dtype)
    # innermost dim runs backwards through rows, the contiguous one is the outer dim
    check_view(base, (cols, rows), (1, -cols), 5 + (rows - 1) * cols)
    # a sub-block with an offset: rows 10..290, columns 3..197, transposed
    check_view(base, (194, 280), (1, cols), 5 + 10 * cols + 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c,k,stride", [(1, 3, 1), (3, 3, 1), (16, 3, 1), (16, 3, 2), (5, 1, 1)])
def test_im2col_views(dtype, c, k, stride, threads):
    n, h, w = 4, 18, 20
    base = _base(n * h * w * c, dtype)
    ho, wo = (h - k) // stride + 1, (w - k) // stride + 1
    check_view(base, (n, ho, wo, k, k, c),
               (h * w * c, stride * w * c, stride * c, w * c, c, 1), 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_rows_and_columns(dtype, threads):
    base = _base(700, dtype)
    out_shape = (700, 500)
    src = _array(base)
    for strides in [(1, 0), (0, 1)]:
        shape = out_shape if strides == (1, 0) else (500, 700)
        out = cpu.Array(350000, dtype)
        cpu.compact(src, out, shape, strides, 0)
        np.testing.assert_array_equal(_flat(out),
                                      _expected_view(base, shape, strides, 0).reshape(-1))


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=2, max_size=4),
       data=st.data(), dtype=st.sampled_from(DTYPES))
def test_permuted_slices_of_compact_arrays(shape, data, dtype):
    """Any permutation of any step-sliced compact array (the views NDArray produces)."""
    base = _base(int(np.prod(shape)), dtype, seed=len(shape))
    steps = [data.draw(st.integers(1, 3)) for _ in shape]
    perm = data.draw(st.permutations(range(len(shape))))
    strides = _compact_strides(shape)
    view_shape = [-(-n // s) for n, s in zip(shape, steps, strict=True)]
    view_strides = [st_ * s for st_, s in zip(strides, steps, strict=True)]
    check_view(base, [view_shape[p] for p in perm], [view_strides[p] for p in perm], 0)
