"""Devices of the NDArray layer: ``cpu()`` (C++), ``cpu_numpy()`` (NumPy reference), ``cuda()``.

A :class:`BackendDevice` pairs a name with a backend module that follows
docs/backend_protocol.md. Backend modules are imported lazily and at most once; a missing
backend gives a *disabled* device (``enabled()`` is False) instead of an import error, so
``import needle`` works without the compiled module or without a GPU.

Example:
    >>> from needle.backend_ndarray import cpu_numpy
    >>> d = cpu_numpy(); str(d), d.enabled()
    ('cpu_numpy()', True)
"""
from __future__ import annotations

import ctypes
import importlib
import os

import numpy as np

from .. import random as _random
from .._core.dtypes import canonical_dtype
from .._core.errors import BackendAttributeError, BackendUnavailable, DeviceError
from .._core.handles import Callbacks, RemovableHandle
from .._core.job_env import is_rank
from .ndarray_limits import check_alloc, check_dims

_MODULE_FOR_DEVICE = {
    "cpu": "needle.backend_ndarray.ndarray_backend_cpu",
    "cpu_numpy": "needle.backend_ndarray.ndarray_backend_numpy",
    "cuda": "needle.backend_ndarray.ndarray_backend_cuda",
}
_DEVICES: dict[str, "BackendDevice"] = {}
_LOAD_ERRORS: dict[str, str] = {}


class BackendDevice:
    """A device: a name and the backend module whose kernels run there."""

    def __init__(self, name: str, mod):
        self.name = name
        self.mod = mod

    def __eq__(self, other) -> bool:
        return isinstance(other, BackendDevice) and self.name == other.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return self.name + "()"

    def __getattr__(self, name):
        # Only reached for names not on the device itself: forward to the backend module so
        # that course code can write device.matmul_tiled, device.__tile_size__, device.Array.
        mod = self.__dict__.get("mod")
        if mod is None:
            # Also an AttributeError: getattr(dev, name, default) and hasattr() probes (pytest
            # builds parametrize ids from getattr(value, "__name__", None)) see "absent", while
            # any use of the disabled device still fails with this message.
            reason = _LOAD_ERRORS.get(self.__dict__.get("name", "?"), "not built")
            raise BackendAttributeError(
                f"{self.__dict__.get('name')}(): backend is not available ({reason}); "
                f"expected an enabled device, got a disabled one (looking up {name!r})")
        if name == "new_array":  # optional: Array(size, dtype) through a cheaper call
            value = getattr(mod, "new_array", None) or mod.Array
        else:
            value = getattr(mod, name)
        # Cache on the instance so the next lookup is a plain attribute hit (hot path).
        self.__dict__[name] = value
        return value

    def enabled(self) -> bool:
        return self.mod is not None

    # Constructors. Random draws go through needle.random (so its observers, which
    # checkpoint(verify=True) relies on, see them): this device's stream, NumPy's global
    # generator unless one was registered, exactly one draw of the full shape per call (the
    # course's golden values depend on it).
    def randn(self, *shape, dtype="float32"):
        return _nd().NDArray(_random.randn(*_draw_shape("randn", shape), device=self),
                             device=self, dtype=dtype)

    def rand(self, *shape, dtype="float32"):
        return _kernel_draws().rand(self, shape, dtype)  # by this device's kernel where it can

    def one_hot(self, n, i, dtype="float32"):
        """Rows of the n×n identity picked by the indices ``i`` (shape ``i.shape + (n,)``)."""
        idx = np.asarray(i, dtype=np.int64)
        check_alloc("one_hot", check_dims("one_hot", (idx.size, n)), 4, "float32")
        # Scatter the ones directly: np.eye(n)[i] would build n*n floats (800 MB at n=10k).
        rows = np.zeros((idx.size, n), dtype=np.float32)
        rows[np.arange(idx.size), idx.reshape(-1)] = 1.0
        return _nd().NDArray(rows.reshape(idx.shape + (n,)), device=self, dtype=dtype)

    def empty(self, shape, dtype="float32"):
        """Uninitialised array; :class:`SizeLimitError` past 2**62 bytes (docs/limits.md)."""
        return self._filled("empty", shape, None, dtype)

    def full(self, shape, fill_value, dtype="float32"):
        return self._filled("full", shape, fill_value, dtype)

    def zeros(self, *shape, dtype="float32"):
        return self._filled("zeros", _shape_args(shape), 0.0, dtype)

    def ones(self, *shape, dtype="float32"):
        return self._filled("ones", _shape_args(shape), 1.0, dtype)

    def _filled(self, op: str, shape, fill_value, dtype):
        # (a disabled device fails at self.Array with BackendUnavailable)
        arr = _nd().empty_checked(op, shape, self, canonical_dtype(dtype, op))
        if fill_value is not None:
            arr._fill(fill_value)  # a fresh array: no version bump (needle._core.versions)
        return arr


def _draw_shape(op: str, shape) -> tuple:
    # NumPy draws float64 first: refuse what cannot be drawn before asking it to.
    shape = check_dims(op, shape)
    check_alloc(op, shape, 8, "float64")
    return shape


def _shape_args(shape) -> tuple:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(shape[0])
    return tuple(shape)


def _nd():
    # ndarray imports this module: looked up at first use, then kept (an import statement
    # run per call costs ~1 µs, and rand runs this per Dropout mask)
    if not _LAZY:
        from . import kernel_draws, ndarray
        _LAZY.extend((ndarray, kernel_draws))
    return _LAZY[0]


def _kernel_draws():
    _nd()
    return _LAZY[1]


_LAZY: list = []


# libgomp counts its spin in iterations of a pause loop: 1000 lasted 20-40 us on a Zen 4 VM
# (a 2-thread kernel issued 20 us after the last one found its worker awake, at 40 us asleep).
_SHORT_SPIN = "1000"


def _prepare_cpu_threads() -> tuple:
    # The C++ kernels use OpenMP (libgomp), which reads its settings once, when it is loaded.
    # Its default lets an idle worker spin for milliseconds; when anything else wants
    # that core (a second rank, a data loader) every parallel region then waits a whole
    # scheduler slice, and a ResNet9 step measured 20-40x slower. Sleeping workers
    # (OMP_WAIT_POLICY=passive) avoid that, but waking one cost ~40 us per parallel region on
    # the project's VMs: 4x a 131k-element add, and the MLPResNet step ran ~35% slower. A
    # process on its own spins a little first (GOMP_SPINCOUNT, 20-40 us: back-to-back kernels
    # find the worker awake, an idle one still sleeps); a distributed rank does not spin
    # (two ResNet9 processes sharing 2 cores ran 14% slower each with the short spin).
    # Only what the user left unset is chosen; if another library loaded libgomp first
    # (import torch before needle), its settings stand and nothing is set: the kernels read
    # the environment libgomp was loaded with to pick their matmul thread threshold
    # (src/threads.cc). Returns the names set, which the caller removes again once the
    # module is loaded: child processes (the ranks a launcher starts) choose for themselves.
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ \
            or _libgomp_loaded():
        return ()
    chosen = {"OMP_WAIT_POLICY": "passive"}
    if not is_rank():  # ranks of one job usually share a machine's cores
        chosen["GOMP_SPINCOUNT"] = _SHORT_SPIN
    os.environ.update(chosen)
    return tuple(chosen)


def _libgomp_loaded() -> bool:
    """Whether this process already holds libgomp (the soname PyTorch's wheel ships too)."""
    try:
        ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded (or no RTLD_NOLOAD on this platform)
        return False
    return True


def _device(name: str) -> BackendDevice:
    dev = _DEVICES.get(name)
    if dev is None:
        chosen = _prepare_cpu_threads() if name == "cpu" else ()
        try:
            mod = importlib.import_module(_MODULE_FOR_DEVICE[name])
            if hasattr(mod, "available") and not mod.available():
                _LOAD_ERRORS[name] = getattr(mod, "unavailable_reason", lambda: "no device")()
                mod = None
        except Exception as exc:  # noqa: BLE001 - a broken/missing backend disables the device
            _LOAD_ERRORS[name] = f"{type(exc).__name__}: {exc}"
            mod = None
        finally:
            for key in chosen:  # libgomp has read them (or failed to load)
                os.environ.pop(key, None)
        dev = _DEVICES[name] = BackendDevice(name, mod)
        if mod is not None:
            for hook in _DEVICE_HOOKS:
                hook(dev)
    return dev


# Called with each device the first time it is made and enabled: the seam through which the
# memory layer (L2) installs its allocators without L1 importing it.
_DEVICE_HOOKS = Callbacks()


def add_device_hook(fn) -> RemovableHandle:
    """Call ``fn(device)`` for every enabled device already made and every later one.

    Returns a handle whose ``remove()`` stops the calls for devices made later.
    """
    handle = _DEVICE_HOOKS.add(fn)
    for dev in list(_DEVICES.values()):
        if dev.mod is not None:
            fn(dev)
    return handle


def cpu() -> BackendDevice:
    """The compiled C++ CPU backend (disabled if the extension was not built)."""
    return _device("cpu")


def cpu_numpy() -> BackendDevice:
    """The NumPy reference backend, always available."""
    return _device("cpu_numpy")


def cuda() -> BackendDevice:
    """The CUDA backend; never raises, ``enabled()`` is False without CuPy or a GPU."""
    return _device("cuda")


def default_device() -> BackendDevice:
    """``cpu()`` when the compiled module is built, else the NumPy reference backend."""
    dev = cpu()
    return dev if dev.enabled() else cpu_numpy()


def all_devices() -> list[BackendDevice]:
    """Every device whose backend is usable here."""
    return [d for d in (cpu(), cuda(), cpu_numpy()) if d.enabled()]


def device_by_name(name: str) -> BackendDevice:
    """Look a device up by name (``"cpu"``, ``"cuda"``, ``"cpu_numpy"``, or with ``()``).

    Raises:
        DeviceError: for an unknown name.
    """
    key = name[:-2] if name.endswith("()") else name
    if key not in _MODULE_FOR_DEVICE:
        raise DeviceError(
            f"device: unknown device, expected one of {sorted(_MODULE_FOR_DEVICE)}, got {name!r}")
    return _device(key)


def check_enabled(device: BackendDevice, op: str) -> BackendDevice:
    if not isinstance(device, BackendDevice):
        raise DeviceError(f"{op}: expected a BackendDevice, got {device!r}")
    if device.mod is None:
        reason = _LOAD_ERRORS.get(device.name, "not built")
        raise BackendUnavailable(
            f"{op}: device {device} is not available ({reason}), expected an enabled device")
    return device

