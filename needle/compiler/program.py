"""A step as a kernel program: the recorded kernel calls, replayed without the step's Python.

:func:`build_program` turns a :class:`~needle.compiler.recorder.Recording` of one call, the
state locations before and after it (:mod:`needle.compiler.state`) and what the call
returned into a :class:`KernelProgram`, or says why it cannot:

* every buffer the kernels read that existed before the call must be found again: a tensor
  argument of the step, or a location of its state (a parameter's ``cached_data``, an
  optimiser's moment in a dict, a ``grad``);
* every location the call changed must now hold a buffer the kernels made (a new weight, a
  new moment, a new gradient tensor) or ``None``; a changed Python value (a step counter, a
  list that grew) means the step's Python has effects a replay would lose.

The program runs as a C++ kernel list where the backend has one (:mod:`.native`), else as a
generated Python function (:mod:`.codegen`); either frees each buffer after its last use (so
the planned arena serves the same requests as the traced call), with no op dispatch and no
autograd. :meth:`KernelProgram.prepare` makes the runner, fusing its elementwise runs
(:mod:`.fusion`). After it ran, the new buffers are installed where the traced call put them,
and the step's result is rebuilt as constant tensors (a replayed result has no graph:
``backward`` belongs inside the step).

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle.compiler.recorder import record_kernels
    >>> x = ndl.Tensor(np.ones(3), device=ndl.cpu_numpy())
    >>> with record_kernels(ndl.cpu_numpy()) as rec:
    ...     y = x * 2 + 1
    >>> prog = build_program(rec, Before({}, [x]), {}, (x,), {}, y)
    >>> prog.run((ndl.Tensor(np.arange(3.0), device=ndl.cpu_numpy()),), {}).numpy().tolist()
    [1.0, 3.0, 5.0]
"""
from __future__ import annotations

from needle.autograd import Tensor
from needle.autograd.versions import note_replaced
from needle.backend_ndarray import NDArray
from needle.backend_ndarray.ndarray import _view

from .codegen import generate, random_fill
from .fusion import FusedCall, fuse
from .native import build_kernel_list
from .recorder import Alloc, Call, RandomFill, Recording
from .state import Guard, bare, token, unchanged

__all__ = ["KernelProgram", "Before", "build_program", "flat_arguments", "NotReplayable"]


class NotReplayable(Exception):
    """The recorded call cannot become a kernel program (the message says why)."""


def _meta(array: NDArray) -> tuple:
    return (array._shape, array._strides, array._offset, array._handle.dtype,
            array._handle.size)


def flat_arguments(args: tuple, kwargs: dict) -> list:
    """The tensors among a step's arguments, in a fixed order; raises NotReplayable for an
    argument whose content would be baked into the program (a NumPy array)."""
    out: list = []
    _collect_tensors(tuple(args), "args", out)
    _collect_tensors(dict(kwargs), "kwargs", out)
    return out


def _collect_tensors(value, path: str, out: list) -> None:
    # a module-level function, not a closure calling itself: such a closure is a reference
    # cycle that would keep `out` (the step's arguments) alive until a garbage collection
    if isinstance(value, Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _collect_tensors(v, f"{path}[{i}]", out)
    elif isinstance(value, dict):
        for k in sorted(value, key=repr):
            _collect_tensors(value[k], f"{path}[{k!r}]", out)
    elif not isinstance(value, (int, float, str, bool, type(None))):
        raise NotReplayable(f"argument {path} is a {type(value).__name__}, whose values "
                            "the program could not take anew (pass a Tensor)")


class Before:
    """The state before a recorded call, kept without keeping its values alive: a token per
    location (:func:`~needle.compiler.state.token`) and, for every buffer the state or the
    arguments hold, where it is and its layout (keyed by the buffer's ``id``)."""

    def __init__(self, locations: dict, tensors: list):
        self.tokens = {ident: token(loc.value) for ident, loc in locations.items()}
        self.locations = {ident: bare(loc) for ident, loc in locations.items()}
        self.by_handle: dict[int, tuple] = {}
        for i, t in enumerate(tensors):
            data = t.cached_data
            if isinstance(data, NDArray):
                self.by_handle.setdefault(id(data._handle), (i, None, False, _meta(data)))
        for loc in locations.values():
            v = loc.value
            if isinstance(v, NDArray):
                self.by_handle.setdefault(id(v._handle), (-1, bare(loc), False, _meta(v)))
            elif isinstance(v, Tensor) and loc.key == "grad" \
                    and isinstance(v.cached_data, NDArray):
                self.by_handle.setdefault(id(v.cached_data._handle),
                                          (-1, bare(loc), True, _meta(v.cached_data)))
        self.arg_sharing = buffer_sharing(tensors)
        self.arg_grads = [(bare(loc), loc.value is None) for loc in locations.values()
                          if loc.arg >= 0 and loc.key == "grad"]


def buffer_sharing(tensors: list) -> tuple:
    """Which tensor arguments share a buffer: for each, the index of the first argument with
    the same buffer (``step(x, x)`` gives (0, 0), ``step(x, y)`` (0, 1)). A program recorded
    with one pattern reads one slot where another would need two, or the other way round."""
    first: dict[int, int] = {}
    out = []
    for i, t in enumerate(tensors):
        data = t.cached_data
        key = id(data._handle) if isinstance(data, NDArray) else -1 - i
        out.append(first.setdefault(key, i))
    return tuple(out)


class _Binder:
    """Finds one external buffer at replay time: argument ``index``, or a state location
    (holding the array itself, or a tensor holding it)."""

    __slots__ = ("slot", "index", "loc", "through_tensor", "meta")

    def __init__(self, slot, index, loc, through_tensor, meta):
        self.slot, self.index, self.loc = slot, index, loc
        self.through_tensor, self.meta = through_tensor, meta


class _Setter:
    """Puts a buffer the program made (or None) where the traced call put one."""

    __slots__ = ("loc", "slot", "view", "as_tensor", "requires_grad", "device")

    def __init__(self, loc, slot, view, as_tensor, requires_grad, device):
        self.loc, self.slot, self.view = loc, slot, view
        self.as_tensor, self.requires_grad, self.device = as_tensor, requires_grad, device


def _install_row(s: _Setter) -> tuple:
    """What :meth:`KernelProgram.finish` needs of setter ``s``, flat: ``(container, key)``
    for an attribute of a fixed object (None: set through ``loc``, per call), the slot and
    view of the buffer, and whether a replaced ``cached_data`` must be noted."""
    loc = s.loc
    static = loc.kind == "attr" and loc.arg < 0
    shape, strides, offset = s.view if s.slot is not None else (None, None, None)
    note = loc.key == "cached_data" and loc.kind == "attr"
    return (loc.container if static else None, loc.key, loc, s.slot, shape, strides, offset,
            s.device, s.as_tensor, s.requires_grad, note)


class KernelProgram:
    """A replayable kernel list (see the module docstring). ``run(args, kwargs)`` executes it
    and returns the step's result; :meth:`bind` and :meth:`finish` split that for callers
    that run the kernels inside a memory plan."""

    def __init__(self, rec: Recording, binders, setters, result, guard, device, made: list,
                 arg_grads=(), arg_sharing=()):
        self._rec = rec
        self.ops = list(rec.ops)
        self.binders = binders
        self.setters = setters
        self.result = result
        self.guard = guard
        self.device = device
        self._made = list(made)
        self._external_slots = [b.slot for b in binders]
        # (location, traced value was None) of the tensor arguments' grad: a replay needs
        # the same (a gradient accumulating into x.grad takes another path than a first one)
        self.arg_locations = list(arg_grads)
        self.arg_sharing = tuple(arg_sharing)
        self._installs = [_install_row(s) for s in setters]
        # set by prepare(): the runner (a C++ kernel list, else a generated Python function)
        self.native = None
        self._fn = None
        self.source = None
        self.n_kernels = 0
        self.fused_runs = 0
        self.ops_run: list | None = None
        self.prepared = False

    def bind(self, args: tuple, kwargs: dict):
        """``(external buffers, tensor arguments)`` for a call, or a string saying why this
        call cannot replay (the state changed, an argument has another layout)."""
        if self.guard is not None:
            failure = self.guard.failure()
            if failure is not None:
                return failure
        tensors = flat_arguments(args, kwargs)
        if buffer_sharing(tensors) != self.arg_sharing:
            return "the tensor arguments share buffers otherwise than in the traced call"
        for loc, was_none in self.arg_locations:
            if (loc.get(tensors) is None) != was_none:
                return f"argument {loc.arg}'s grad is {'not ' if was_none else ''}None, " \
                       "unlike the traced call's"
        handles = []
        for b in self.binders:
            if b.index >= 0:
                value = tensors[b.index].cached_data
            else:
                value = b.loc.get(tensors)
                if b.through_tensor:
                    value = getattr(value, "cached_data", None)
            if not isinstance(value, NDArray) or _meta(value) != b.meta:
                where = f"argument {b.index}" if b.index >= 0 else \
                    f"{type(b.loc.container).__name__}.{b.loc.key}"
                return f"the buffer at {where} has another layout than traced"
            handles.append(value._handle)
        if len({id(h) for h in handles}) != len(handles):
            return "two buffers the traced call read apart are one buffer now"
        return handles, tensors

    def execute(self, handles: list, tensors: list) -> tuple:
        """Run the kernels on the bound buffers (``handles`` is emptied: the program frees
        each buffer after its last use, as the step would); returns the buffers it made.

        The locations the program will set are cleared first, so that a replaced buffer
        (an old weight, an old gradient) is freed at its last use, not at the end. If a
        kernel raises, they stay cleared: the step's state is then as undefined as after an
        eager step that raised halfway."""
        for container, key, loc, *_ in self._installs:
            if container is not None:
                setattr(container, key, None)
            else:
                loc.set(None, tensors)
        if self.native is not None:
            return self.native.run(handles, self._external_slots, self._made)
        return self._fn(handles)

    def finish(self, made: tuple, tensors: list):
        """Install what the program made into the state (``tensors``: the call's tensor
        arguments) and rebuild the result."""

        # One pass over rows prepared at construction (_install_row): this runs on every call
        # of a compiled step, once per parameter and gradient the step replaces.
        view, make_const = _view, Tensor.make_const
        for container, key, loc, slot, shape, strides, offset, device, as_tensor, \
                requires_grad, note in self._installs:
            if slot is None:
                value = None
            else:
                value = view(shape, strides, offset, device, made[slot])
                if as_tensor:
                    value = make_const(value, requires_grad=requires_grad)
            if container is not None:
                setattr(container, key, value)
            else:
                loc.set(value, tensors)
            if note:
                owner = container if container is not None else tensors[loc.arg]
                if isinstance(owner, Tensor):
                    note_replaced(owner)
        return _rebuild(self.result, made.__getitem__, self.device)

    def prepare(self, kernel=None, arena: dict | None = None, native: bool = True) -> None:
        """Make the runner, once, for the program that replays: its elementwise runs fused
        into ``kernel`` when given (the backend's ``ewise_program``; :mod:`.fusion`), where
        ``arena`` (slot -> (offset, size) in the planned arena) keeps buffers that share bytes
        out of one run, and the others (from the pools) from being made in a run before one
        it finished with is freed; a C++ kernel list when ``native`` and the backend has one
        (:mod:`.native`), else the generated Python function (:mod:`.codegen`)."""
        rec, made = self._rec, self._made
        ops = rec.ops
        if kernel is not None:
            sizes: dict = {op.slot: (op.size, op.dtype) for op in ops if isinstance(op, Alloc)}
            for b in self.binders:
                sizes[b.slot] = (b.meta[4], b.meta[3])  # (handle size, dtype)
            pooled = None if arena is None else \
                {s for s in sizes if s not in arena} | set(self._external_slots)
            arena = arena or {}

            def overlaps(a: int, b: int) -> bool:
                ra, rb = arena.get(a), arena.get(b)
                return ra is not None and rb is not None and ra[0] < rb[0] + rb[1] \
                    and rb[0] < ra[0] + ra[1]

            ops = fuse(ops, sizes, set(made) | set(self._external_slots), kernel, overlaps,
                       pooled)
        self.fused_runs = sum(isinstance(op, FusedCall) for op in ops)
        self.ops_run = ops  # what the runner runs (a CUDA graph captures the same: .graph)
        mod = self.device.mod
        self.native = build_kernel_list(ops, self._external_slots, set(made), mod,
                                        lambda op: random_fill(op, mod)) if native else None
        if self.native is None:
            self._fn, self.source, self.n_kernels = generate(
                rec, self._external_slots, made, ops, self.device.mod)
        else:
            self.n_kernels = sum(isinstance(op, (Call, FusedCall, RandomFill)) for op in ops)
        self.prepared = True

    def shape(self) -> tuple:
        """Everything that decides what the program does, comparable between two recordings
        of the same step (kernels and their arguments, where buffers come from and go)."""
        return (self.ops,
                [(b.slot, b.index, None if b.loc is None else b.loc.ident, b.through_tensor,
                  b.meta) for b in self.binders],
                [(s.loc.ident, s.slot, s.view, s.as_tensor, s.requires_grad)
                 for s in self.setters],
                self.result)

    def run(self, args: tuple, kwargs: dict):
        """Bind, execute and finish in one (no memory plan around the kernels)."""
        bound = self.bind(args, kwargs)
        if isinstance(bound, str):
            raise NotReplayable(bound)
        if not self.prepared:
            self.prepare()
        handles, tensors = bound
        return self.finish(self.execute(handles, tensors), tensors)


def _rebuild(spec, buffer, device):
    kind = spec[0]
    if kind == "tensor":
        _, slot, (shape, strides, offset), requires_grad = spec
        return Tensor.make_const(_view(shape, strides, offset, device, buffer(slot)),
                                 requires_grad=requires_grad)
    if kind in ("tuple", "list"):
        items = [_rebuild(s, buffer, device) for s in spec[1]]
        return tuple(items) if kind == "tuple" else items
    return spec[1]


def build_program(rec: Recording, before: Before, after: dict, args: tuple, kwargs: dict,
                  result, guard: bool = True, device=None) -> KernelProgram:
    """Make a :class:`KernelProgram` of a recorded call (see the module docstring).

    Raises:
        NotReplayable: the call has effects or inputs a kernel program cannot reproduce.
    """
    if rec.problems:
        raise NotReplayable("; ".join(rec.problems))
    device = device if device is not None else _device_of(args, kwargs, result)
    binders = _binders(rec, before)
    outputs: dict[int, int] = {}
    owned: set = set()
    setters = _setters(rec, before, after, set(rec.external), outputs, device, owned)
    result_spec = _describe_result(rec, result, outputs, set(rec.external))
    made = sorted(outputs, key=outputs.__getitem__)
    # locations a program reads afresh (binders) or sets itself (setters) every call need
    # no guard: a value put there between calls is what the program then uses or replaces
    fresh = {b.loc.ident for b in binders if b.loc is not None} | {s.loc.ident for s in setters}
    fresh |= owned
    return KernelProgram(rec, binders, setters, result_spec,
                         Guard(after, fresh) if guard else None, device, made,
                         before.arg_grads, before.arg_sharing)


def _device_of(args, kwargs, result):
    for t in flat_arguments(args, kwargs) + _result_tensors(result):
        return t.cached_data.device
    raise NotReplayable("the step's device is unknown (no tensor argument or result)")


def _result_tensors(result) -> list:
    if isinstance(result, Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in _result_tensors(r)]
    return []


def _binders(rec: Recording, before: Before) -> list:
    binders = []
    for slot in rec.external:
        found = before.by_handle.get(rec.handles[slot])
        if found is None:
            raise NotReplayable("a kernel reads a buffer that is neither a tensor argument "
                                "nor reachable from the step's state")
        index, loc, through_tensor, meta = found
        binders.append(_Binder(slot, index, loc, through_tensor, meta))
    return binders


def _setters(rec: Recording, before: Before, after: dict, externals: set, outputs: dict,
             device, owned: set) -> list:
    setters = []

    def slot_of(array: NDArray) -> int:
        slot = rec.slot_of.get(id(array._handle))
        if slot is None or slot in externals:
            raise NotReplayable("the step stores a buffer that it did not make")
        outputs.setdefault(slot, len(outputs))
        return outputs[slot]

    for key in before.tokens.keys() | after.keys():
        new = after.get(key)
        if key not in before.tokens or new is None:
            loc = new or before.locations[key]
            raise NotReplayable(f"the step adds or removes state "
                                f"({type(loc.container).__name__}.{loc.key})")
        if unchanged(before.tokens[key], new.value):
            continue
        value, loc = new.value, bare(new)
        if isinstance(value, (int, float)) and any(loc.container is o for o in rec.owners):
            owned.add(key)  # a replayed() call's own counter: it runs again on every replay
            continue
        if value is None:
            setters.append(_Setter(loc, None, None, False, False, device))
        elif isinstance(value, NDArray):
            setters.append(_Setter(loc, slot_of(value), value_view(value), False, False,
                                   device))
        elif isinstance(value, Tensor) and loc.key == "grad" \
                and isinstance(value.cached_data, NDArray):
            setters.append(_Setter(loc, slot_of(value.cached_data),
                                   value_view(value.cached_data), True, value.requires_grad,
                                   device))
        else:
            raise NotReplayable(f"the step changes {type(loc.container).__name__}."
                                f"{loc.key} to a {type(value).__name__} (Python state a "
                                "replay would not update)")
    return setters


def value_view(array: NDArray) -> tuple:
    return (array._shape, array._strides, array._offset)


def _describe_result(rec: Recording, result, outputs: dict, externals: set):
    if isinstance(result, Tensor):
        data = result.cached_data
        slot = rec.slot_of.get(id(data._handle)) if isinstance(data, NDArray) else None
        if slot is None or slot in externals:
            raise NotReplayable("the step returns a tensor it did not compute")
        outputs.setdefault(slot, len(outputs))
        return ("tensor", outputs[slot], value_view(data), False)
    if isinstance(result, (tuple, list)):
        return (type(result).__name__,
                [_describe_result(rec, r, outputs, externals) for r in result])
    if isinstance(result, (int, float, str, bool, type(None))):
        return ("const", result)
    raise NotReplayable(f"the step returns a {type(result).__name__}")
