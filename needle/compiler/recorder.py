"""Record every kernel call a step makes on a device: the raw material of a kernel program.

While :func:`record_kernels` is active, a proxy of the device's backend module
(:class:`_RecordingModule`) intercepts the recording thread's kernel lookups
(``needle.backend_ndarray.intercept``): the NDArray layer reaches every kernel through it
(``device.ewise_add``, ``device.mod.matmul_strided``, ``device.Array``). Each call is written
down with its arguments, a buffer handle replaced by a :class:`Ref` to a *slot*:

* a handle made during the recording (``Array(size, dtype)``) is an internal slot, numbered
  in allocation order (the order the memory plan of the same call uses);
* a handle that existed before is an *external* slot (a parameter, an input, optimiser
  state), to be found again at replay time through the step's arguments or state.

A host-to-device copy (``from_numpy``) of a value drawn from :mod:`needle.random` during the
step becomes a :class:`RandomFill`: the replay draws again from the same stream, so dropout
masks are fresh each step, exactly as eagerly. Any other copied host array is kept as a
constant. Keyword arguments are constants of the step (``conv2d_forward``'s ``x_view``),
bound into the recorded call; a keyword that is a buffer or a float (a scalar that may change
between steps) is refused. Calls that return a value (a host read) or take arguments the
recorder cannot describe make the recording unreplayable: ``Recording.problems`` says why,
and the compiled step keeps running its Python instead.

Example:
    >>> import numpy as np, needle as ndl
    >>> x = ndl.Tensor(np.ones((2, 2)), device=ndl.cpu_numpy())
    >>> with record_kernels(ndl.cpu_numpy()) as rec:
    ...     y = (x * 3).sum()
    >>> [op.name for op in rec.ops if isinstance(op, Call)]
    ['scalar_mul', 'reduce_sum']
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from needle import random as _random
from needle.autograd.engine import HOOK_CALLS
from needle.backend_ndarray.devices import intercept
from needle.memory import categories as _categories

from . import effects as _effects

__all__ = ["Ref", "Const", "Alloc", "Call", "RandomFill", "ScalarRef", "PyCall", "Recording",
           "record_kernels"]

_LITERALS = (int, float, str, bool, type(None), np.integer, np.floating)


@dataclass(frozen=True)
class Ref:
    """An argument that is a buffer: slot ``slot`` of the recording."""

    slot: int


@dataclass(frozen=True, eq=False)
class Const:
    """A host array copied to the device that is not a random draw (kept as recorded)."""

    array: np.ndarray

    def __eq__(self, other) -> bool:
        return (isinstance(other, Const) and self.array.dtype == other.array.dtype
                and self.array.shape == other.array.shape
                and bool(np.array_equal(self.array, other.array)))

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Alloc:
    """``Array(size, dtype)``: internal slot ``slot`` comes to life, attributed to memory
    ``category`` (what ``needle.memory`` resolved for it when recorded)."""

    slot: int
    size: int
    dtype: str
    category: str | None = None


@dataclass(frozen=True)
class Call:
    """A kernel call: ``fn(*args)`` with every :class:`Ref` bound to its slot's buffer."""

    name: str
    fn: Any = field(compare=False, repr=False)
    args: tuple = ()


@dataclass(frozen=True)
class ScalarRef:
    """A kernel's scalar argument that is result ``index`` (-1: the whole result) of the
    step's ``call``-th :func:`~needle.compiler.effects.replayed` call."""

    call: int
    index: int


@dataclass(frozen=True)
class PyCall:
    """``replayed(fn, owner)`` (:mod:`needle.compiler.effects`): run again at each replay;
    ``key`` (the function and its owner) is what two recordings compare."""

    index: int
    key: tuple
    n_values: int
    fn: Any = field(compare=False, repr=False)
    owner: Any = field(compare=False, repr=False)


@dataclass(frozen=True)
class RandomFill:
    """``from_numpy(asarray(needle.random.<kind>(*shape), dtype), slot)``: a fresh draw."""

    kind: str
    shape: tuple
    stream: str
    dtype: str
    slot: int
    fn: Any = field(compare=False, repr=False)


class Recording:
    """What :func:`record_kernels` saw: ``ops`` in call order; ``external``, the slots of
    buffers that existed before the call, with ``handles`` giving each one's ``id`` (valid
    against a lookup made before the call: buffers alive together have distinct ids); and
    ``problems``, why the call cannot be replayed (empty when it can).

    Buffers made during the call are known by ``id`` only: holding them would keep them
    alive past their last use, and a planned run would then see a buffer outlive its plan.
    Every buffer made on the device goes through the recorded ``Array``, which registers its
    id when it is made, so an id that a dead buffer had is registered afresh when reused."""

    def __init__(self, array_type):
        self.array_type = array_type
        self.ops: list = []
        self.n_slots = 0
        self.handles: dict[int, int] = {}  # external slot -> id of its handle
        self.slot_of: dict[int, int] = {}
        self.external: list[int] = []
        self.problems: list[str] = []
        self.draws: list[tuple[str, str, np.ndarray]] = []
        self.owners: list = []  # owners of replayed() calls: their numbers are theirs to change
        self._scalars: dict[int, tuple] = {}  # id(float) -> (the float, its ScalarRef)

    def python(self, fn, owner, value) -> None:
        """A :func:`~needle.compiler.effects.replayed` call of the step."""
        index = sum(isinstance(op, PyCall) for op in self.ops)
        key = (getattr(fn, "__func__", fn), id(getattr(fn, "__self__", None)), id(owner))
        values = value if isinstance(value, tuple) else (value,)
        self.ops.append(PyCall(index, key, len(values), fn, owner))
        self.owners.append(owner)
        for j, v in enumerate(values):
            if type(v) is not float:
                self.problem(f"a replayed() call returns a {type(v).__name__}, not floats")
                continue
            # the float itself is kept: its id stays its own for the whole recording
            self._scalars[id(v)] = (v, ScalarRef(index, j if isinstance(value, tuple) else -1))

    def problem(self, message: str) -> None:
        if len(self.problems) < 8:
            self.problems.append(message)

    def slot(self, handle) -> int:
        slot = self.slot_of.get(id(handle))
        if slot is None:  # a buffer from before the step
            slot = self._new_slot(handle)
            self.handles[slot] = id(handle)
            self.external.append(slot)
        return slot

    def _new_slot(self, handle) -> int:
        slot = self.n_slots
        self.n_slots += 1
        self.slot_of[id(handle)] = slot
        return slot

    # ---- arguments ------------------------------------------------------------------------
    def describe(self, value, name: str):
        if isinstance(value, self.array_type):
            return Ref(self.slot(value))
        if type(value) is float:
            known = self._scalars.get(id(value))
            if known is not None and known[0] is value:
                return known[1]
        if isinstance(value, _LITERALS):
            return value
        if isinstance(value, (tuple, list)):
            items = tuple(self.describe(v, name) for v in value)
            return items if isinstance(value, tuple) else list(items)
        if isinstance(value, np.ndarray):
            return Const(value.copy())
        self.problem(f"{name} takes an argument of type {type(value).__name__}")
        return value

    def from_numpy(self, fn, src, out) -> None:
        src = np.asarray(src)
        for i, (kind, stream, value) in enumerate(self.draws):
            if value.shape == src.shape and np.array_equal(np.asarray(value, src.dtype), src):
                del self.draws[i]
                self.ops.append(RandomFill(kind, tuple(value.shape), stream, str(src.dtype),
                                           self.slot(out), fn))
                return
        self.ops.append(Call("from_numpy", fn, (Const(src.copy()), Ref(self.slot(out)))))


class _Alloc:
    """Stands in for the backend's ``Array`` class: records each buffer made; ``isinstance``
    checks against it see the real class."""

    def __init__(self, real, rec: Recording, thread: int):
        self.real, self.rec, self.thread = real, rec, thread

    def __instancecheck__(self, instance) -> bool:
        return isinstance(instance, self.real)

    def __call__(self, size, dtype="float32", *rest):
        handle = self.real(size, dtype, *rest)
        if threading.get_ident() == self.thread:
            slot = self.rec._new_slot(handle)
            self.rec.ops.append(Alloc(slot, int(size), str(dtype), _categories.resolve(None)))
        return handle


class _RecordingModule:
    """A backend module whose callables record themselves (see the module docstring)."""

    def __init__(self, real, rec: Recording):
        self._real, self._rec = real, rec
        self._thread = threading.get_ident()

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if name in ("Array", "new_array"):  # new_array: Array(size, dtype) made cheaply
            wrapped: Any = _Alloc(value, self._rec, self._thread)
        elif callable(value) and not isinstance(value, type) and not name.startswith("_") \
                and not getattr(value, "query", False):
            # a backend function marked ``query`` computes a value from its arguments alone
            # (no buffer, no device state): called through, not recorded, no host read
            wrapped = self._wrap(name, value)
        else:
            wrapped = value
        self.__dict__[name] = wrapped
        return wrapped

    def _wrap(self, name: str, fn):
        rec, thread = self._rec, self._thread

        def recorded(*args, **kwargs):
            if threading.get_ident() != thread:
                return fn(*args, **kwargs)
            call = fn
            if kwargs:
                # keyword arguments that are constants of the trace (conv2d's x_view) are
                # bound into the recorded callable; a buffer or a scalar that may change
                # between steps must come positionally, where it is described
                for key, value in kwargs.items():
                    if rec.describe(value, name) != value or isinstance(value, float):
                        rec.problem(f"{name} takes {key}= that is not a constant of the step")
                call = functools.partial(fn, **kwargs)
            if name == "from_numpy" and len(args) == 2 and not kwargs:
                rec.from_numpy(fn, args[0], args[1])
                return fn(*args)
            described = tuple(rec.describe(a, name) for a in args)
            result = fn(*args, **kwargs)
            if result is not None:
                rec.problem(f"{name} returns a value to Python (a host read)")
            rec.ops.append(Call(name, call, described))
            return result

        recorded.__name__ = name
        return recorded


@contextlib.contextmanager
def record_kernels(device) -> Iterator[Recording]:
    """Record the kernel calls made on ``device`` by this thread while the block runs."""
    real = device.mod
    rec = Recording(real.Array)
    thread = threading.get_ident()

    def on_draw(kind, stream, value):
        if threading.get_ident() != thread:
            return
        if kind in ("rand", "randn") and isinstance(value, np.ndarray):
            rec.draws.append((kind, stream, value))
        else:
            rec.problem(f"the step draws {kind} from needle.random for use on the host")

    def on_set_state(state, stream):
        if threading.get_ident() == thread:
            # a checkpoint region replaying its draws: a replay drawing afresh would differ
            rec.problem("the step sets a needle.random state (a checkpoint region)")

    hooks_before = HOOK_CALLS[0]
    previous_listener = _effects.set_listener(rec.python)
    try:
        with _random.add_draw_observer(on_draw), _random.add_state_observer(on_set_state), \
                intercept(device, _RecordingModule(real, rec)):
            yield rec
    finally:
        _effects.set_listener(previous_listener)
    if HOOK_CALLS[0] != hooks_before:
        rec.problem("autograd hooks ran during the step (Python a replay would not run)")
    for kind, _, _ in rec.draws:
        rec.problem(f"a {kind} draw of the step is not copied to the device as drawn")
