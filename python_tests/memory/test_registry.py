"""The per-device registry, the public stats functions and the L1 wiring contract."""
from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
import needle.memory as mem
from needle._core.errors import DeviceError, NeedleError
from needle.memory import registry
from needle.memory.caching_allocator import CachingAllocator


@pytest.fixture
def fake_device():
    alloc = mem.register_allocator("fake", CachingAllocator("fake"))
    yield alloc
    registry.unregister_allocator("fake")


class FakeArray:
    """What docs/memory.md asks of an L1 Python backend Array."""

    def __init__(self, alloc, size, dtype="float32"):
        self._block = alloc.allocate(size * np.dtype(dtype).itemsize)
        self.array = self._block.view(dtype, size)

    def __del__(self):
        self._block.release()


class FakeNDArray:
    def __init__(self, handle, device_name):
        self._handle = handle
        self.device = type("Dev", (), {"name": device_name})()


def test_public_api_names():
    for name in ("stats", "reset_peak", "empty_cache", "category", "record", "plot_timeline",
                 "trace", "plan", "estimate", "compare"):
        assert callable(getattr(mem, name)), name


def test_stats_by_device_name_and_object(fake_device):
    arr = FakeArray(fake_device, 1000)
    assert mem.stats("fake")["allocated_bytes"] == 4096
    assert mem.stats(FakeNDArray(None, "fake").device)["requested_bytes"] == 4000
    del arr
    s = mem.stats("fake()")
    assert s["allocated_bytes"] == 0 and s["num_frees"] == 1
    assert mem.empty_cache("fake") == 2 * 2**20
    assert mem.stats("fake")["reserved_bytes"] == 0


def test_reset_peak_through_registry(fake_device):
    a = FakeArray(fake_device, 10_000)
    del a
    assert mem.stats("fake")["peak_bytes"] == 40_448
    mem.reset_peak("fake")
    assert mem.stats("fake")["peak_bytes"] == 0


def test_record_filters_by_device(fake_device):
    other = mem.register_allocator("fake2", CachingAllocator("fake2"))
    try:
        keep = fake_device.allocate(100)
        with mem.record("fake") as events:
            fake_device.allocate(700).release()
            other.allocate(700).release()
        assert [(e.kind, e.device, e.nbytes) for e in events] == [
            ("alloc", "fake", 1024), ("free", "fake", 1024)]
        assert events.baseline["other"] == 512
        with mem.record() as everything:
            other.allocate(1).release()
        assert [e.device for e in everything] == ["fake2", "fake2"]
        keep.release()
    finally:
        registry.unregister_allocator("fake2")


def test_unknown_device_raises():
    with pytest.raises(DeviceError, match="no allocator for device 'nowhere'"):
        mem.stats("nowhere")
    with pytest.raises(NeedleError):
        mem.stats(3.5)


def test_default_device_is_l1_default(monkeypatch):
    monkeypatch.setattr(nd, "default_device", nd.cpu_numpy)
    assert mem.stats()["device"] == "cpu_numpy"
    assert mem.get_allocator(None) is mem.get_allocator("numpy")


def test_attribute_moves_bytes_between_categories(fake_device):
    with mem.framework_category("activation"):
        arr = FakeArray(fake_device, 256)
    x = FakeNDArray(arr, "fake")
    mem.attribute(x, "gradient")
    by = mem.stats("fake")["by_category"]
    assert by["gradient"]["current"] == 1024 and by["activation"]["current"] == 0
    with mem.category("other"):
        mem.attribute(x, "weight")  # the user's category wins
    assert mem.stats("fake")["by_category"]["other"]["current"] == 1024
    mem.attribute(FakeNDArray(object(), "fake"), "weight")  # not ours: ignored
    with pytest.raises(NeedleError, match="attribute"):
        mem.attribute(x, "grad")


def test_install_hands_allocator_to_backend(monkeypatch):
    mod = nd.cpu_numpy().mod
    got = []
    monkeypatch.setattr(mod, "set_allocator", got.append, raising=False)
    assert registry.install_python_allocators() == ["cpu_numpy"]
    assert got == [mem.get_allocator("cpu_numpy")]


_WIRED = hasattr(nd.cpu_numpy().mod, "set_allocator")


@pytest.mark.skipif(not _WIRED, reason="L1 numpy backend has no set_allocator yet")
def test_ndarray_buffers_come_from_the_allocator():
    mem.install_python_allocators()
    before = mem.stats("cpu_numpy")
    a = nd.NDArray(np.ones((100, 10), dtype=np.float32), device=nd.cpu_numpy())
    block = max(512, -(-4000 // 512) * 512)
    mid = mem.stats("cpu_numpy")
    assert mid["allocated_bytes"] - before["allocated_bytes"] == block
    assert mid["requested_bytes"] - before["requested_bytes"] == 4000
    view = a.permute((1, 0))  # a view: no new buffer
    assert mem.stats("cpu_numpy")["num_allocs"] == mid["num_allocs"]
    del a, view
    after = mem.stats("cpu_numpy")
    assert after["allocated_bytes"] == before["allocated_bytes"]
    assert after["num_frees"] - before["num_frees"] == 1
