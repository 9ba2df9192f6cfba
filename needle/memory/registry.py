"""One allocator per device, and the public statistics functions built on them.

L2 creates the Python caching allocators and hands them to the L1 backend modules that accept
one (``mod.set_allocator``); the C++ allocator joins later through an adapter registered with
:func:`register_allocator`. ``device=None`` means L1's ``default_device()``.

Example:
    >>> from needle.memory.caching_allocator import CachingAllocator
    >>> alloc = register_allocator("demo", CachingAllocator("demo"))
    >>> alloc.allocate(10).size, stats("demo")["allocated_bytes"]
    (512, 512)
    >>> unregister_allocator("demo") is alloc
    True
"""
from __future__ import annotations

import threading

from needle._core.errors import DeviceError

from . import categories
from .caching_allocator import CachingAllocator

__all__ = ["register_allocator", "unregister_allocator", "get_allocator", "stats", "reset_peak",
           "empty_cache", "attribute", "install_python_allocators", "registered_devices"]

_ALLOCATORS: dict[str, object] = {}
_LOCK = threading.Lock()
_ALIASES = {"numpy": "cpu_numpy"}  # a backend module's __device_name__ -> device name


def _device_name(device) -> str:
    if device is None:
        from needle.backend_ndarray import default_device
        return default_device().name
    name = device if isinstance(device, str) else getattr(device, "name", None)
    if not isinstance(name, str):
        raise DeviceError(f"memory: bad device, expected a device or a device name, got {device!r}")
    name = name[:-2] if name.endswith("()") else name
    return _ALIASES.get(name, name)


def register_allocator(device, allocator):
    """Make ``allocator`` the one :func:`stats` reports for ``device``; returns it."""
    with _LOCK:
        _ALLOCATORS[_device_name(device)] = allocator
    return allocator


def unregister_allocator(device):
    """Forget the allocator of ``device`` (returns it, or ``None``)."""
    with _LOCK:
        return _ALLOCATORS.pop(_device_name(device), None)


def registered_devices() -> list[str]:
    """Names of the devices that have an allocator."""
    return sorted(_ALLOCATORS)


def get_allocator(device=None):
    """The allocator of ``device`` (default: L1's default device).

    Raises:
        DeviceError: when no allocator is registered for it.
        BackendUnavailable: for ``cpu`` while its C++ allocator exposes no statistics
            (see :mod:`needle.memory.cpp_adapter`).
    """
    name = _device_name(device)
    alloc = _ALLOCATORS.get(name)
    if alloc is None and name == "cpu":
        return _cpu_adapter()
    if alloc is None:
        raise DeviceError(
            f"memory: no allocator for device {name!r}, expected one of "
            f"{registered_devices()}, got {name!r}")
    return alloc


def _cpu_adapter():
    """Register the C++ allocator's adapter on first use, or raise BackendUnavailable.

    Lazy so that ``import needle`` does not load the compiled backend.
    """
    from needle.backend_ndarray import device_by_name

    from .cpp_adapter import make_adapter

    adapter = make_adapter(device_by_name("cpu").mod, "cpu")
    return register_allocator("cpu", adapter)


def _allocators_for(device) -> list:
    if device is None:
        _make_cpu_device()
        return list(_ALLOCATORS.values())
    return [get_allocator(device)]


def _make_cpu_device() -> None:
    """Make ``cpu()`` (its device hook registers the C++ allocator) so that "every device"
    includes it even when nothing has touched ``cpu()`` yet: a ``record()`` opened first must
    still see the C++ events of the block."""
    if "cpu" not in _ALLOCATORS:
        from needle.backend_ndarray import cpu

        cpu()


def stats(device=None) -> dict:
    """Allocator statistics of ``device`` (fields: docs/memory.md).

    Example:
        >>> from needle.memory.caching_allocator import CachingAllocator
        >>> _ = register_allocator("demo", CachingAllocator("demo"))
        >>> sorted(stats("demo")["by_category"])[:2]
        ['activation', 'gradient']
        >>> _ = unregister_allocator("demo")
    """
    return get_allocator(device).stats()


def reset_peak(device=None) -> None:
    """Set the peaks of ``device``'s statistics to their current values."""
    get_allocator(device).reset_peak()


def empty_cache(device=None) -> int:
    """Return ``device``'s wholly free cached segments to the system; returns bytes freed."""
    return get_allocator(device).empty_cache()


def attribute(x, category: str) -> None:
    """Re-attribute the buffer behind ``x`` to ``category`` (framework use: weight, gradient).

    ``x`` may be a Tensor (its cached data is used), an NDArray, or a backend ``Array``/block
    with a ``device``-less owner (then every allocator is asked). Buffers no allocator owns are
    ignored. Inside a user ``category()`` block the user's category wins.
    """
    categories.check_category(category, "attribute")
    if hasattr(x, "realize_cached_data"):
        x = x.realize_cached_data()
    handle = getattr(x, "_handle", x)
    owner = getattr(getattr(handle, "_block", None), "allocator", None)
    if isinstance(owner, CachingAllocator):  # the block knows its allocator (also a trace's)
        owner.retag(handle, category)
        return
    device = getattr(x, "device", None)
    if device is not None:
        alloc = _ALLOCATORS.get(_device_name(device))
        if alloc is not None:
            alloc.retag(handle, category)
        return
    for alloc in list(_ALLOCATORS.values()):
        alloc.retag(handle, category)


def install_python_allocators() -> list[str]:
    """Register a caching allocator for ``cpu_numpy`` and hand it to the backend module.

    Called once at ``import needle.memory``. The allocator is registered even while the
    backend cannot take one yet (its statistics then stay at zero). Returns the devices whose
    backend module accepted the allocator (``mod.set_allocator``).
    """
    from needle.backend_ndarray import cpu_numpy

    dev = cpu_numpy()
    alloc = _ALLOCATORS.get(dev.name)
    if alloc is None:
        alloc = register_allocator(dev.name, CachingAllocator(dev.name))
    if dev.mod is not None and hasattr(dev.mod, "set_allocator"):
        dev.mod.set_allocator(alloc)
        return [dev.name]
    return []


def _install_for_device(dev) -> None:
    """Device hook (L1 calls it for each enabled device, before anything is allocated on it).

    ``cpu``: register the adapter of the C++ allocator now, so that its category resolver is
    in place for the very first buffer (a weight made before any ``stats()`` call is counted
    as a weight) and :func:`~needle.memory.record` sees its events whatever the call order. A
    stale build without statistics is left to the lazy path, which explains what is missing.
    ``cuda``: give the backend its caching allocator.
    """
    if dev.name in _ALLOCATORS:
        return
    if dev.name == "cpu":
        from .cpp_adapter import make_adapter, missing_api

        if not missing_api(dev.mod):
            register_allocator("cpu", make_adapter(dev.mod, "cpu"))
        return
    if dev.name != "cuda":
        return
    from .cuda_allocator import install_cuda_allocator

    cupy = dev.mod.runtime.cupy_module()
    register_allocator(dev.name, install_cuda_allocator(dev.mod, cupy.cuda.alloc))


def install_device_hook() -> None:
    """Called once at ``import needle.memory``: allocators for devices made later (cuda)."""
    from needle.backend_ndarray.devices import add_device_hook

    add_device_hook(_install_for_device)
