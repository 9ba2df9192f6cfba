"""needle.random (layer L0): the one place random numbers come from, per device, with saved states.

Every random draw in needle goes through a *stream*. The host stream, used by every device that
has not registered its own, **is NumPy's global generator**: ``np.random.seed(k)`` therefore
still decides weight init, dropout masks and data shuffling exactly as the course expects
(its golden values come from one global NumPy draw of the full shape per call), and the draw
functions here make exactly the NumPy call they name (one draw of
the full shape, C order), so swapping ``np.random.rand(*s)`` for ``ndl.random.rand(*s)`` changes
no number anywhere.

What this module adds on top of NumPy:

* ``get_state`` / ``set_state`` / ``fork_rng`` over *all* streams at once, which is what a
  checkpoint region needs to replay the first forward's draws during recomputation;
* per-device streams (``register_stream``) for a device that draws on its own generator;
* draw observers (``observe_draws``), so ``checkpoint(..., verify=True)`` can hash every draw
  made inside a region and compare the replay draw by draw;
* state observers (``add_state_observer``), told of every ``set_state`` (``needle.compiler``
  refuses to replay a step that rewinds a stream);
* ``host_mt19937``: NumPy's global Mersenne Twister, handed to a backend kernel that makes
  ``rand``'s draws itself (the C++ backend writes a Dropout mask straight from it), advancing
  the very same state, so the numbers and everything drawn afterwards stay NumPy's.

Example:
    >>> import numpy as np
    >>> from needle import random as ndl_random
    >>> ndl_random.seed(3); a = ndl_random.rand(2)
    >>> np.random.seed(3); bool((a == np.random.rand(2)).all())
    True
    >>> s = ndl_random.get_state(); x = ndl_random.randn(3)
    >>> ndl_random.set_state(s); bool((x == ndl_random.randn(3)).all())
    True
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np

from ._core.errors import DeviceError, RNGStateError
from ._core.handles import Callbacks, RemovableHandle

__all__ = ["seed", "manual_seed", "get_state", "set_state", "fork_rng", "rand", "randn", "randint",
           "permutation", "register_stream", "unregister_stream", "stream_for",
           "observe_draws", "add_draw_observer", "add_state_observer", "RNGState",
           "NumpyGlobalStream", "HOST", "host_mt19937", "draw_through_numpy"]

HOST = "host"  # key of the host stream (NumPy's global generator)


class NumpyGlobalStream:
    """The host stream: a thin view of NumPy's global ``np.random`` generator.

    A stream is any object with ``seed(n)``, ``get_state()``, ``set_state(s)`` and the draw
    methods ``rand``, ``randn``, ``randint``, ``permutation`` (NumPy's signatures).
    """

    name = HOST

    def seed(self, n: int) -> None:
        np.random.seed(n)

    def get_state(self):
        return np.random.get_state()  # a fresh tuple holding a copy of the key array

    def set_state(self, state) -> None:
        np.random.set_state(state)

    def rand(self, *shape):
        return np.random.rand(*shape)

    def randn(self, *shape):
        return np.random.randn(*shape)

    def randint(self, low, high=None, size=None):
        return np.random.randint(low, high=high, size=size)

    def permutation(self, n):
        return np.random.permutation(n)


_HOST_STREAM = NumpyGlobalStream()
_STREAMS: dict[str, Any] = {}  # device name -> stream; devices absent here use the host stream
_OBSERVERS = Callbacks()
_STATE_OBSERVERS = Callbacks()


def _device_name(device) -> str:
    if device is None:
        return HOST
    if isinstance(device, str):
        return device
    name = getattr(device, "name", None)
    if not isinstance(name, str):
        raise DeviceError(
            f"random: unknown device, expected a device object with a name or a str, got "
            f"{device!r}")
    return name


def stream_for(device=None):
    """The stream that draws for ``device`` (None or unregistered devices: the host stream).

    Example:
        >>> stream_for().name
        'host'
    """
    name = _device_name(device)
    return _STREAMS.get(name, _HOST_STREAM)


def register_stream(device, stream) -> None:
    """Give ``device`` (a device or its name) its own generator ``stream``.

    Example:
        >>> class Fixed(NumpyGlobalStream):
        ...     name = "fake"
        >>> register_stream("fake", Fixed()); stream_for("fake").name
        'fake'
        >>> unregister_stream("fake")
    """
    for method in ("seed", "get_state", "set_state", "rand", "randn", "randint", "permutation"):
        if not callable(getattr(stream, method, None)):
            raise DeviceError(
                f"register_stream: stream lacks {method}(), expected an object with seed, "
                f"get_state, set_state and the draw methods, got {type(stream).__name__}")
    _STREAMS[_device_name(device)] = stream


def unregister_stream(device) -> None:
    """Undo :func:`register_stream`; the device draws from the host stream again."""
    _STREAMS.pop(_device_name(device), None)


def _all_streams() -> dict[str, Any]:
    streams = {HOST: _HOST_STREAM}
    for name, stream in _STREAMS.items():
        if stream is not _HOST_STREAM:
            streams[name] = stream
    return streams


class RNGState(dict):
    """A snapshot of every stream: ``{stream key: that stream's own state}``.

    Returned by :func:`get_state` without a device; accepted by :func:`set_state`.
    """

    def __repr__(self) -> str:
        return f"RNGState(streams={sorted(self)})"


# ----- seeding and state --------------------------------------------------------------------
def seed(n: int, device=None) -> None:
    """Seed ``device``'s stream, or every stream (NumPy's global generator first) when None.

    Example:
        >>> seed(0); a = rand(1); seed(0); bool(a == rand(1))
        True
    """
    if device is not None:
        stream_for(device).seed(n)
        return
    for stream in _all_streams().values():
        stream.seed(n)


def manual_seed(n: int) -> None:
    """PyTorch's spelling of :func:`seed` for every stream (``ndl.manual_seed``): NumPy's
    global generator included, so weight init, dropout and shuffling all follow it.

    Raises:
        RNGStateError: ``n`` not an int in ``[0, 2**32)`` (what NumPy's generator takes).

    Example:
        >>> import needle as ndl
        >>> ndl.manual_seed(7); a = ndl.init.rand(2); ndl.manual_seed(7)
        >>> bool((a.numpy() == ndl.init.rand(2).numpy()).all())
        True
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n < 2 ** 32:
        raise RNGStateError(f"manual_seed: seed out of range, expected an int in [0, 2**32), "
                            f"got {n!r}")
    seed(int(n))


def get_state(device=None):
    """A copy of the generator state: of ``device``'s stream, or of all streams when None.

    The host state is exactly ``np.random.get_state()``.

    Example:
        >>> s = get_state(); x = rand(2); set_state(s); bool((x == rand(2)).all())
        True
    """
    if device is not None:
        return stream_for(device).get_state()
    return RNGState({key: stream.get_state() for key, stream in _all_streams().items()})


def set_state(state, device=None) -> None:
    """Restore a state from :func:`get_state` (all streams for an :class:`RNGState`), then
    tell the state observers (:func:`add_state_observer`).

    Raises:
        RNGStateError: an RNGState naming a stream that is not registered any more.
    """
    if device is not None or not isinstance(state, RNGState):
        stream_for(device).set_state(state)
    else:
        streams = _all_streams()
        for key, value in state.items():
            stream = streams.get(key)
            if stream is None:
                raise RNGStateError(
                    f"set_state: no stream {key!r}, expected one of {sorted(streams)}, got a "
                    f"state saved while {key!r} was registered")
            stream.set_state(value)
    if _STATE_OBSERVERS:
        for fn in _STATE_OBSERVERS:
            fn(state, device)


@contextlib.contextmanager
def fork_rng(devices=None, enabled: bool = True) -> Iterator[None]:
    """Run the block on a copy of the RNG state: draws inside do not advance the outside.

    Args:
        devices: devices whose streams are saved and restored (None: every stream).
        enabled: False makes this a no-op (handy for ``fork_rng(enabled=flag)``).

    Example:
        >>> seed(1); s = get_state()
        >>> with fork_rng():
        ...     _ = rand(100)
        >>> after = get_state()[HOST][1]; bool((after == s[HOST][1]).all())
        True
    """
    if not enabled:
        yield
        return
    if devices is None:
        saved = [(None, get_state())]
    else:
        saved = [(d, get_state(d)) for d in devices]
    try:
        yield
    finally:
        for device, state in saved:
            set_state(state, device)


# ----- draws ----------------------------------------------------------------------------------
def _notify(kind: str, device, value) -> None:
    if _OBSERVERS:
        name = _device_name(device)
        for fn in _OBSERVERS:
            fn(kind, name, value)


def rand(*shape, device=None):
    """Uniform [0, 1) samples: ``np.random.rand(*shape)`` on the host stream (one draw).

    Example:
        >>> seed(0); rand(2).shape
        (2,)
    """
    value = stream_for(device).rand(*shape)
    _notify("rand", device, value)
    return value


def randn(*shape, device=None):
    """Standard normal samples: ``np.random.randn(*shape)`` on the host stream (one draw)."""
    value = stream_for(device).randn(*shape)
    _notify("randn", device, value)
    return value


def randint(low, high=None, size=None, device=None):
    """Integers in [low, high): ``np.random.randint(low, high=high, size=size)`` (one draw).

    Example:
        >>> seed(0); randint(-3, 4, size=2).shape
        (2,)
    """
    value = stream_for(device).randint(low, high=high, size=size)
    _notify("randint", device, value)
    return value


def permutation(n, device=None):
    """A random order of ``range(n)``: ``np.random.permutation(n)`` (one draw)."""
    value = stream_for(device).permutation(n)
    _notify("permutation", device, value)
    return value


def host_mt19937(device=None, *, replaying: bool = False):
    """NumPy's global MT19937 bit generator, when a kernel may make ``rand``'s draws for
    ``device`` in NumPy's place; otherwise None.

    That is when ``device`` draws from the host stream, NumPy's global RandomState runs an
    MT19937 (``np.random.set_bit_generator`` may have swapped it) and no draw observer listens
    (observers are handed the float64 array NumPy returns). The kernel must advance the
    generator exactly as ``np.random.rand`` would: the C++ backend's ``mt19937_uniform`` does,
    under the generator's lock. ``replaying``: a compiled step's kernel program asks; it runs
    none of the step's Python, so :func:`draw_through_numpy` does not apply to it.

    Example:
        >>> import numpy as np
        >>> type(host_mt19937()).__name__
        'MT19937'
        >>> with observe_draws():
        ...     print(host_mt19937())
        None
    """
    if _OBSERVERS or (_LOCAL.numpy_only and not replaying) \
            or (_STREAMS and stream_for(device) is not _HOST_STREAM):
        return None
    generator = getattr(_NUMPY_GLOBAL, "_bit_generator", None)
    return generator if type(generator) is np.random.MT19937 else None


def draw_through_numpy(flag: bool) -> bool:
    """While ``flag`` holds on this thread, :func:`host_mt19937` answers None, so that every
    draw goes through NumPy. A compiled step sets it for its Python: its trace and its
    recordings must see one and the same sequence of kernels. Returns the previous value.

    Example:
        >>> previous = draw_through_numpy(True); host_mt19937() is None
        True
        >>> _ = draw_through_numpy(previous)
    """
    previous, _LOCAL.numpy_only = _LOCAL.numpy_only, bool(flag)
    return previous


class _Local(threading.local):
    numpy_only = False  # a class default: threads that never set it read False


_LOCAL = _Local()
# NumPy's global RandomState, whose bit generator ``np.random.rand`` draws from (a private name
# of NumPy's: when it is missing, host_mt19937 answers None and NumPy draws as usual).
_NUMPY_GLOBAL = getattr(np.random.mtrand, "_rand", None)


# ----- observers ------------------------------------------------------------------------------
def add_draw_observer(fn: Callable[[str, str, Any], None]) -> RemovableHandle:
    """Call ``fn(kind, device_name, value)`` after every draw made through this module.

    Returns a handle with ``remove()``. Observers must not draw themselves.

    Example:
        >>> seen = []; h = add_draw_observer(lambda k, d, v: seen.append(k))
        >>> _ = randn(2); h.remove(); seen
        ['randn']
    """
    return _OBSERVERS.add(fn)


def add_state_observer(fn: Callable[[Any, Any], None]) -> RemovableHandle:
    """Call ``fn(state, device)`` after every :func:`set_state` (``fork_rng`` restoring its
    saved state included), with the arguments it was given; from whichever thread called it.

    Returns a handle with ``remove()``, also a context manager that removes it on exit.
    Observers must not set a state themselves.

    Example:
        >>> seen = []
        >>> with add_state_observer(lambda state, device: seen.append(device)):
        ...     set_state(get_state())
        ...     set_state(get_state("cpu"), "cpu")
        >>> set_state(get_state()); seen
        [None, 'cpu']
    """
    return _STATE_OBSERVERS.add(fn)


@contextlib.contextmanager
def observe_draws() -> Iterator[list]:
    """Collect ``(kind, device_name, value)`` for every draw made inside the block.

    Example:
        >>> with observe_draws() as draws:
        ...     _ = rand(3); _ = permutation(4)
        >>> [kind for kind, _, _ in draws]
        ['rand', 'permutation']
    """
    draws: list = []
    handle = add_draw_observer(lambda kind, device, value: draws.append((kind, device, value)))
    try:
        yield draws
    finally:
        handle.remove()
