"""CuPy side of the CUDA backend: availability, allocation, kernel compilation and launch.

Kernels are compiled from ``needle/backend_ndarray/cuda_kernels/*.cu`` with NVRTC through
``cupy.RawModule``, once per (device, source file), and their functions cached per
(device, name); CuPy's disk cache makes later processes skip NVRTC. Memory comes from a
pluggable allocator (:func:`set_allocator`), CuPy's memory pool by default.

This module imports CuPy lazily: importing it never fails.

Example:
    >>> from needle.backend_ndarray._cuda import runtime
    >>> isinstance(runtime.available(), bool)
    True
"""
from __future__ import annotations

import os
import re
from typing import Callable

from ..._core.errors import BackendUnavailable
from . import launch as L

KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "cuda_kernels")
_HEADER_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+\.cuh)"\s*$', re.MULTILINE)
BASE_OPTIONS = ("-std=c++17",)

_cupy = None
_reason: str | None = None
_modules: dict = {}
_functions: dict = {}
_num_sms: dict = {}
_allocator: Callable | None = None


def _probe() -> None:
    """Import CuPy and look for a GPU once; remember why not if either is missing."""
    global _cupy, _reason
    if _cupy is not None or _reason is not None:
        return
    if os.environ.get("NEEDLE_DISABLE_CUDA") == "1":
        _reason = "disabled by NEEDLE_DISABLE_CUDA=1"
        return
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means "no CuPy here"
        _reason = f"cupy is not importable ({type(exc).__name__}: {exc})"
        return
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver / no device raise various errors
        _reason = f"no CUDA device ({type(exc).__name__}: {exc})"
        return
    if count < 1:
        _reason = "no CUDA device (device count is 0)"
        return
    _cupy = cupy


def available() -> bool:
    """True when CuPy imports and at least one GPU is visible."""
    _probe()
    return _cupy is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    _probe()
    return _reason or ""


def cupy_module():
    """The ``cupy`` module; raises :class:`BackendUnavailable` when there is none."""
    if not available():
        raise BackendUnavailable(f"cuda: backend is not available ({_reason}), expected "
                                 f"CuPy and a GPU")
    return _cupy


# ---- memory ----------------------------------------------------------------------------
def set_allocator(fn: Callable | None) -> None:
    """Route every new buffer through ``fn(nbytes) -> owner`` (``None``: CuPy's pool).

    ``owner`` must expose the device address as ``owner.ptr`` and keep the memory alive until
    it is dropped (a ``cupy.cuda.MemoryPointer`` does both). The memory statistics of
    ``needle.memory`` plug in here.
    """
    global _allocator
    _allocator = fn


def get_allocator() -> Callable:
    """The allocator in use (CuPy's current allocator, its memory pool, by default)."""
    return _allocator if _allocator is not None else cupy_module().cuda.alloc


def allocate(nbytes: int):
    return get_allocator()(nbytes)


def device_id() -> int:
    return cupy_module().cuda.runtime.getDevice()


def num_sms(dev: int) -> int:
    n = _num_sms.get(dev)
    if n is None:
        attrs = cupy_module().cuda.runtime.getDeviceProperties(dev)
        n = _num_sms[dev] = int(attrs["multiProcessorCount"])
    return n


# ---- kernels -----------------------------------------------------------------------------
def kernel_source(source: str) -> str:
    """The text of ``cuda_kernels/<source>`` with its local headers pasted in.

    Inlining (rather than ``-I``) keeps CuPy's disk cache, which hashes the source text,
    correct when a header changes.
    """
    with open(os.path.join(KERNEL_DIR, source), encoding="utf-8") as f:
        text = f.read()

    def paste(match) -> str:
        with open(os.path.join(KERNEL_DIR, match.group(1)), encoding="utf-8") as f:
            # "#pragma once" would be a warning in the middle of a main file.
            return f.read().replace("#pragma once", "")

    return _HEADER_INCLUDE.sub(paste, text)


def _module(dev: int, source: str):
    key = (dev, source)
    mod = _modules.get(key)
    if mod is None:
        cupy = cupy_module()
        code = kernel_source(source)
        try:
            mod = cupy.RawModule(code=code, options=BASE_OPTIONS)
            mod.compile()
        except Exception:  # noqa: BLE001 - NVRTC could not use cuda_fp16.h: own half type
            mod = cupy.RawModule(code=code, options=BASE_OPTIONS + ("-DNEEDLE_OWN_HALF",))
            mod.compile()
        _modules[key] = mod
    return mod


def function(source: str, name: str):
    """The compiled kernel ``name`` of ``source`` on the current device (cached)."""
    dev = device_id()
    key = (dev, name)
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = _module(dev, source).get_function(name)
    return fn


def launch(spec: L.KernelSpec, dtype: str, work, *args, src_dtype: str | None = None) -> None:
    """The typed launcher: check and cast through :func:`launch.prepare`, then call."""
    name, grid, block, kernel_args = L.prepare(spec, dtype, work, args, src_dtype)
    # function(), written out for the cached case (one launch per op on the host's path)
    cupy = _cupy if _cupy is not None else cupy_module()
    fn = _functions.get((cupy.cuda.runtime.getDevice(), name))
    if fn is None:
        fn = function(spec.source, name)
    fn(grid, block, kernel_args)


def synchronize() -> None:
    """Wait for every kernel queued on the current device (benchmarks, tests)."""
    cupy_module().cuda.runtime.deviceSynchronize()


# ---- CUDA graphs (needle.compiler.graph) ---------------------------------------------------
def graphs_unsupported() -> str | None:
    """Why this CuPy cannot capture CUDA graphs, or None when it can."""
    cupy = cupy_module()
    stream = getattr(cupy.cuda, "Stream", None)
    if stream is None or not hasattr(stream, "begin_capture"):
        version = getattr(cupy, "__version__", "?")
        return f"CuPy {version} has no stream capture (cupy.cuda.Stream.begin_capture)"
    return None


class Capture:
    """``with Capture() as cap:`` queues the block's launches and copies on a side stream
    that captures them; ``cap.graph`` is the CUDA graph once the block ended without error.
    Nothing runs while capturing: :func:`launch_graph` runs it."""

    def __init__(self):
        self.graph = None
        self._stream = cupy_module().cuda.Stream(non_blocking=True)

    def __enter__(self) -> "Capture":
        self._stream.__enter__()
        try:
            self._stream.begin_capture()
        except BaseException:
            self._stream.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, kind, value, tb) -> None:
        try:
            graph = self._stream.end_capture()  # ends even a failed capture: the stream is free
        except Exception:  # noqa: BLE001 - an invalidated capture: the block's error says why
            if kind is None:
                raise
            graph = None
        finally:
            self._stream.__exit__(None, None, None)
        if kind is None:
            self.graph = graph


def launch_graph(graph) -> None:
    """Run a captured graph on the current stream, after everything queued there."""
    cupy = _cupy if _cupy is not None else cupy_module()  # once per step: no probe
    graph.launch(cupy.cuda.get_current_stream())


def copy_device(dst: int, src: int, nbytes: int) -> None:
    """Queue a device-to-device copy of ``nbytes`` on the current stream (captured when it
    captures)."""
    cupy = _cupy if _cupy is not None else cupy_module()
    rt = cupy.cuda.runtime
    rt.memcpyAsync(dst, src, nbytes, getattr(rt, "memcpyDeviceToDevice", 3),
                   cupy.cuda.get_current_stream().ptr)
