"""Devices of the NDArray layer: ``cpu()`` (C++), ``cpu_numpy()`` (NumPy reference), ``cuda()``.

A :class:`BackendDevice` pairs a name with a backend module that follows
docs/backend_protocol.md. Backend modules are imported lazily and at most once; a missing
backend gives a *disabled* device (``enabled()`` is False) instead of an import error, so
``import needle`` works without the compiled module or without a GPU.

:func:`intercept` is the one way to put something between a device and its backend module:
for the length of a ``with`` block, on the calling thread only, the kernels the device hands
out come from a handler instead (``needle.compiler`` records a step's kernel calls so).

Example:
    >>> from needle.backend_ndarray import cpu_numpy
    >>> d = cpu_numpy(); str(d), d.enabled()
    ('cpu_numpy()', True)
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import threading
from typing import Any, Iterator

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


# ----- interception ---------------------------------------------------------------------------
# A device caches each kernel it hands out as an attribute of its own, so that the next lookup
# is a plain attribute hit (the NDArray hot path). intercept() leaves those attributes alone.
# While some thread intercepts a device, the device is an instance of a subclass of its own
# class whose __getattribute__ asks the calling thread's handlers first; when the last
# intercept() block on it ends (on any thread), it is an instance of its own class again, so
# a device nobody intercepts looks its kernels up exactly as fast as before.


class _Intercepts(threading.local):
    # a class default: a thread that never intercepted reads None without an AttributeError
    handlers: dict | None = None  # id(device) -> [handler, ...], innermost last


_INTERCEPTS = _Intercepts()
_INTERCEPT_LOCK = threading.Lock()
_ACTIVE: dict[int, int] = {}  # id(device) -> intercept() blocks running on it, all threads
_INTERCEPTED_CLASS: dict[type, type] = {}  # a device class -> its intercepted subclass
_OWN_CLASS: dict[type, type] = {}  # the other way round


def _handler(device) -> Any:
    """The innermost handler of ``device`` on this thread, or None."""
    handlers = _INTERCEPTS.handlers
    if handlers:
        stack = handlers.get(id(device))
        if stack:
            return stack[-1]
    return None


class _Intercepted:
    """Mixed in front of a device's class while the device is intercepted (see above)."""

    _own_names: frozenset = frozenset()  # the class's own attributes, and ``name``

    def __getattribute__(self, name):
        handlers = _INTERCEPTS.handlers
        if handlers:
            stack = handlers.get(id(self))
            if stack and name not in type(self)._own_names:
                handler = stack[-1]
                if name == "mod":
                    return handler
                if name == "new_array":
                    return getattr(handler, "new_array", None) or handler.Array
                return getattr(handler, name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name):
        if _handler(self) is not None:  # the handler does not have it: neither does the device
            raise AttributeError(f"{self!r} is intercepted on this thread and its handler "
                                 f"has no attribute {name!r}")
        return _OWN_CLASS[type(self)].__getattr__(self, name)


def _intercepted_class(cls: type) -> type:
    made = _INTERCEPTED_CLASS.get(cls)
    if made is None:
        made = type(cls.__name__, (_Intercepted, cls),
                    {"_own_names": frozenset(dir(cls)) | {"name"},
                     "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _INTERCEPTED_CLASS[cls], _OWN_CLASS[made] = made, cls
    return made


@contextlib.contextmanager
def intercept(device: BackendDevice, handler: Any) -> Iterator[Any]:
    """Route ``device``'s backend lookups made by this thread to ``handler`` for the block.

    ``handler`` stands in for the device's backend module: inside the block, on the calling
    thread, ``device.mod`` is ``handler`` and every name the device would take from its
    module (``device.ewise_add``, ``device.Array``, ``device.new_array``) is looked up on
    ``handler`` instead (its methods ``randn``, ``empty``, ... stay the device's own and reach
    the kernels the same way). A handler usually wraps the real module, taken as
    ``device.mod`` before the block. Yields ``handler``.

    * Thread-local: other threads keep using the real module while the block runs.
    * Nestable: the innermost block's handler wins; on exit, normal or by an exception, the
      enclosing one is in force again, and after the outermost the device is as it was.
    * The device's attributes are not touched (its cached kernels stay cached); kernels
      fetched *before* the block and kept elsewhere are not intercepted. While any thread
      intercepts it, ``type(device)`` is a subclass of its class of the same name (whose
      attribute lookups ask this thread's handler first); ``isinstance`` and equality hold.

    Raises:
        DeviceError: ``device`` is not a :class:`BackendDevice`, or ``handler`` is None.

    Example:
        >>> import numpy as np
        >>> from needle.backend_ndarray import NDArray, cpu_numpy, intercept
        >>> class Counting:
        ...     def __init__(self, mod):
        ...         self.mod, self.calls = mod, []
        ...     def __getattr__(self, name):
        ...         kernel = getattr(self.mod, name)
        ...         if not name.startswith("ewise_"):
        ...             return kernel
        ...         def counted(*args):
        ...             self.calls.append(name)
        ...             return kernel(*args)
        ...         return counted
        >>> dev = cpu_numpy(); a = NDArray(np.ones(3), device=dev)
        >>> with intercept(dev, Counting(dev.mod)) as counting:
        ...     b = a + a
        >>> counting.calls, b.numpy().tolist(), dev.mod is counting.mod
        (['ewise_add'], [2.0, 2.0, 2.0], True)
    """
    if not isinstance(device, BackendDevice):
        raise DeviceError(f"intercept: expected a BackendDevice, got {device!r}")
    if handler is None:
        raise DeviceError("intercept: expected a handler standing in for the backend module, "
                          "got None")
    key = id(device)
    with _INTERCEPT_LOCK:
        if not _ACTIVE.get(key):
            device.__class__ = _intercepted_class(type(device))
        _ACTIVE[key] = _ACTIVE.get(key, 0) + 1
    handlers = _INTERCEPTS.handlers
    if handlers is None:
        handlers = _INTERCEPTS.handlers = {}
    stack = handlers.setdefault(key, [])
    stack.append(handler)
    try:
        yield handler
    finally:
        for i in range(len(stack) - 1, -1, -1):  # the innermost entry of this handler
            if stack[i] is handler:
                del stack[i]
                break
        if not stack and handlers.get(key) is stack:
            del handlers[key]
        with _INTERCEPT_LOCK:
            left = _ACTIVE[key] - 1
            if left:
                _ACTIVE[key] = left
            else:
                del _ACTIVE[key]
                device.__class__ = _OWN_CLASS[type(device)]


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

