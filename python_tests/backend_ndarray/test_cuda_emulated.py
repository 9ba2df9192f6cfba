"""The CUDA backend end to end on the host: real launcher, real .cu kernels, emulated GPU.

``_cuda_emulator.FakeCupy`` stands in for CuPy and compiles each kernel source with g++ and a
shim of the CUDA built-ins (each CUDA thread a fiber, real barriers and warp shuffles).
Every kernel test of cuda_checks.py runs here, so that indexing, guards, reduction trees,
argument packing and scalar casts are checked on machines without a GPU. Skipped when g++ is
missing; on a GPU machine test_cuda_backend.py runs the same tests on the device.
"""
from __future__ import annotations

import numpy as np
import pytest
from _cuda_emulator import compiler_available
from cuda_checks import *  # noqa: F401,F403 - the shared test functions
from cuda_checks import put

import needle.backend_ndarray as nd
from needle.backend_ndarray import ndarray_backend_cuda as B
from needle.backend_ndarray._cuda import launch as L
from needle.backend_ndarray._cuda import runtime

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not compiler_available(), reason="g++ not found")]


@pytest.fixture(scope="module")
def emulated(emulated_cuda):
    """The stand-in for CuPy behind conftest's emulated cuda() device (which also puts the
    runtime's state back afterwards)."""
    return runtime.cupy_module()


@pytest.fixture
def backend(emulated):
    return B


def test_reduction_plans_take_every_path(backend):
    """The reduce shapes of cuda_checks cover the small, warp and split kernels (the block
    kernel: test_cuda_reductions.py)."""
    plans = {L.plan_reduce(r, s, 2).kind for r, s in ((7, 5), (40, 100), (2, 100_000))}
    assert plans == {"small", "warp", "split"}


def test_kernels_compiled_once_per_source(backend, emulated):
    a = put(B, np.ones(10, np.float32))
    out = B.Array(10, "float32")
    B.ewise_add(a, a, out)
    fn = runtime.function("elementwise.cu", "ewise_add_f32")
    B.ewise_add(a, a, out)
    assert runtime.function("elementwise.cu", "ewise_add_f32") is fn
    assert fn.launches[-1] == ((1, 1), (256,))
    assert len([k for k in runtime._modules if k[1] == "elementwise.cu"]) == 1


def test_allocator_seam(backend, emulated):
    calls = []

    def counting(nbytes):
        calls.append(nbytes)
        return emulated.cuda.alloc(nbytes)

    B.set_allocator(counting)
    try:
        a = B.Array(10, "float64")
        assert calls == [80] and a.ptr() % 256 == 0
        B.Array(0, "float16")
        assert calls[-1] == 2  # zero-size arrays still own one element
    finally:
        B.set_allocator(None)


def test_ndarray_on_emulated_device(backend):
    """NDArray drives the backend: non-compact views, reductions, matmul, transfers."""
    dev = nd.BackendDevice("cuda", B)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6, 5)).astype(np.float32)
    a = nd.NDArray(x, device=dev)
    view = a.permute((2, 0, 1))[1:4, ::-1, ::2]
    want = x.transpose(2, 0, 1)[1:4, ::-1, ::2]
    np.testing.assert_allclose((view * 2.0 + view).numpy(), want * 3.0, rtol=1e-6)
    np.testing.assert_allclose(view.sum(axis=(0, 2)).numpy(), want.sum(axis=(0, 2)),
                               rtol=1e-5)
    np.testing.assert_array_equal(a.flip((1,)).numpy(), x[:, ::-1])
    np.testing.assert_array_equal(a.pad(((0, 0), (1, 0), (0, 2))).numpy(),
                                  np.pad(x, ((0, 0), (1, 0), (0, 2))))
    m = nd.NDArray(x.reshape(4, 30), device=dev)
    np.testing.assert_allclose((m @ m.permute((1, 0))).numpy(),
                               x.reshape(4, 30) @ x.reshape(4, 30).T, rtol=1e-5, atol=1e-5)
    back = a.to(nd.cpu_numpy())
    assert back.device == nd.cpu_numpy()
    np.testing.assert_array_equal(back.to(dev).numpy(), x)
    np.testing.assert_array_equal(a.astype("float16").numpy(), x.astype(np.float16))


def test_needle_caching_allocator_serves_the_cuda_backend(backend, emulated):
    """ndl.memory.stats(cuda) reports the same fields, from blocks cut out of CuPy segments."""
    import needle.memory as mem
    from needle.memory import registry
    from needle.memory.caching_allocator import round_size
    from needle.memory.cuda_allocator import install_cuda_allocator

    cupy_before = emulated.cuda.allocated_bytes
    alloc = install_cuda_allocator(B, emulated.cuda.alloc)
    saved = registry._ALLOCATORS.get("cuda")
    registry.register_allocator("cuda", alloc)
    dev = nd.BackendDevice("cuda", B)
    try:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        a = nd.NDArray(x, device=dev)                       # 48 B -> one 512 B block
        s = mem.stats(dev)
        assert s["device"] == "cuda" and s["allocated_bytes"] == round_size(48)
        assert s["requested_bytes"] == 48 and s["num_segments"] == 1
        assert emulated.cuda.allocated_bytes - cupy_before == s["reserved_bytes"] == 2 << 20
        with mem.category("activation"):
            b = a * 2.0                                      # kernels write into the block
        np.testing.assert_array_equal(b.numpy(), x * 2)
        assert mem.stats(dev)["by_category"]["activation"]["current"] == round_size(48)
        del b
        s1 = mem.stats(dev)
        c = a + 1.0                                          # reuses a freed block
        s2 = mem.stats(dev)
        assert s2["num_reused"] - s1["num_reused"] == 1
        assert s2["reserved_bytes"] == s["reserved_bytes"]
        np.testing.assert_array_equal(c.numpy(), x + 1)
        del a, c
        assert mem.stats(dev)["allocated_bytes"] == 0
    finally:
        B.set_allocator(None)
        if saved is None:
            registry.unregister_allocator("cuda")
        else:
            registry.register_allocator("cuda", saved)


def test_memory_layer_installs_the_cuda_allocator_when_the_device_appears(backend, emulated):
    """The L1 device hook hands a new cuda device to needle.memory, which wires its allocator."""
    import needle.memory as mem
    from needle.backend_ndarray import devices
    from needle.memory import registry

    assert registry._install_for_device in devices._DEVICE_HOOKS  # installed at import
    saved = registry._ALLOCATORS.pop("cuda", None)
    try:
        registry._install_for_device(nd.BackendDevice("cuda", B))
        dev = nd.BackendDevice("cuda", B)
        before = mem.stats(dev)["num_allocs"]
        a = nd.NDArray(np.ones(300, np.float32), device=dev)
        assert mem.stats(dev)["num_allocs"] - before == 1
        assert mem.stats(dev)["requested_bytes"] >= 1200
        del a
    finally:
        B.set_allocator(None)
        registry._ALLOCATORS.pop("cuda", None)
        if saved is not None:
            registry._ALLOCATORS["cuda"] = saved
