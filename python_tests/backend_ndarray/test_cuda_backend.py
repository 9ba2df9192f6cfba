"""The CUDA backend on a real GPU against the NumPy reference backend.

Runs every kernel test of cuda_checks.py (each entry point, every dtype, compact and
non-compact views) on the device, plus GPU-only checks: large sizes that take the parallel
reduction and tiled-matmul paths at full scale, the allocator seam, kernel caching, and NDArray
on ``cuda()`` with transfers both ways. Skipped as a whole, with the reason, when
``cuda()`` is disabled (no CuPy or no GPU); test_cuda_emulated.py runs the same kernel tests on
the host.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd

if not nd.cuda().enabled():
    from needle.backend_ndarray import devices as _devices

    pytest.skip(f"cuda() is not available here ({_devices._LOAD_ERRORS.get('cuda', '?')})",
                allow_module_level=True)

from cuda_checks import *  # noqa: E402,F401,F403 - the shared kernel tests
from cuda_checks import assert_close, get, put, rand  # noqa: E402

from needle.backend_ndarray import ndarray_backend_cuda as B  # noqa: E402
from needle.backend_ndarray._cuda import runtime  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.fixture
def backend():
    return B


def test_large_elementwise_and_reductions():
    rng = np.random.default_rng(0)
    x = rand(rng, (1 << 22,), "float32")
    out = B.Array(x.size, "float32")
    B.ewise_mul(put(B, x), put(B, x), out)
    np.testing.assert_array_equal(get(B, out), x * x)
    for rows, size in ((1, 10**7), (3, 1 << 20), (4096, 1000)):
        y = rand(rng, (rows, size), "float32")
        got = B.Array(rows, "float32")
        B.reduce_sum(put(B, y), got, size)
        assert_close(get(B, got), y.astype(np.float64).sum(axis=1), "float32",
                     np.abs(y.astype(np.float64)).sum(axis=1), ulps=8.0)
        B.reduce_max(put(B, y), got, size)
        np.testing.assert_array_equal(get(B, got), y.max(axis=1))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tiled_kernel_matches_cublas_at_scale(dtype):
    rng = np.random.default_rng(1)
    m, n, p = 1000, 1536, 777
    a, b = put(B, rand(rng, (m, n), dtype)), put(B, rand(rng, (n, p), dtype))
    results = {}
    before = B.get_matmul_impl()
    try:
        for impl in B.MATMUL_IMPLS:
            B.set_matmul_impl(impl)
            out = B.Array(m * p, dtype)
            B.matmul(a, b, out, m, n, p)
            results[impl] = get(B, out, (m, p)).astype(np.float64)
    finally:
        B.set_matmul_impl(before)
    ref = get(B, a, (m, n)).astype(np.float64) @ get(B, b, (n, p)).astype(np.float64)
    scale = np.abs(get(B, a, (m, n)).astype(np.float64)) @ np.abs(
        get(B, b, (n, p)).astype(np.float64))
    for impl, got in results.items():
        assert_close(got, ref, dtype, scale, ulps=4 * n ** 0.5), impl


def test_default_matmul_is_cublas():
    assert B.get_matmul_impl() == "cublas"
    with pytest.raises(ValueError, match="expected one of"):
        B.set_matmul_impl("magic")


def test_allocator_seam_and_pool():
    cupy = runtime.cupy_module()
    calls = []

    def counting(nbytes):
        calls.append(nbytes)
        return cupy.cuda.alloc(nbytes)

    # needle.memory's caching allocator is installed when cuda() is made: put it back after,
    # or every later test allocates past it (test_nn_basic counts its events)
    previous = runtime._allocator
    B.set_allocator(counting)
    try:
        a = B.Array(1000, "float16")
        assert calls == [2000]
        B.fill(a, 1.0)
        np.testing.assert_array_equal(get(B, a), np.ones(1000, np.float16))
        B.set_allocator(None)  # CuPy's pool
        pool = cupy.get_default_memory_pool()
        used = pool.used_bytes()
        keep = B.Array(1 << 20, "float32")
        assert pool.used_bytes() >= used + (1 << 22)
        del keep
    finally:
        B.set_allocator(previous)


def test_kernels_cached_per_device():
    a = put(B, np.ones(8, np.float64))
    out = B.Array(8, "float64")
    B.ewise_exp(a, out)
    fn = runtime.function("elementwise.cu", "ewise_exp_f64")
    B.ewise_exp(a, out)
    assert runtime.function("elementwise.cu", "ewise_exp_f64") is fn
    assert [k for k in runtime._modules if k[1] == "elementwise.cu"] == [
        (runtime.device_id(), "elementwise.cu")]


def test_float16_scalar_is_cast_to_half():
    """0.1 must arrive as float16(0.1), exactly as the reference rounds it."""
    x = np.linspace(-3, 3, 257).astype(np.float16)
    out = B.Array(x.size, "float16")
    B.scalar_mul(put(B, x), 0.1, out)
    np.testing.assert_array_equal(get(B, out), x * np.float16(0.1))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_ndarray_on_cuda_views_and_transfers(dtype):
    dev = nd.cuda()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 6, 7)).astype(dtype)
    a = nd.NDArray(x, device=dev, dtype=dtype)
    view = a.permute((2, 0, 1))[1:6, ::-1, ::3]
    want = x.transpose(2, 0, 1)[1:6, ::-1, ::3].astype(np.float64)
    assert_close((view * 2.0 - view).numpy(), want, dtype)
    assert_close(view.max(axis=(0, 2)).numpy(), want.max(axis=(0, 2)), dtype)
    assert_close(a.flip((0, 2)).numpy(), x[::-1, :, ::-1], dtype)
    for other in nd.all_devices():
        moved = a.to(other)
        assert moved.device == other
        np.testing.assert_array_equal(moved.numpy(), x)
        np.testing.assert_array_equal(moved.to(dev).numpy(), x)
