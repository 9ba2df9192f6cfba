"""The Python state a step reads and writes: where its buffers live, and what must not change.

A kernel program replays a step without running its Python, so everything the Python would
have looked up must be found again by other means. :func:`discover` walks from the step
function (its closure, the globals its code names, a bound method's object, default
arguments, functions it can reach) through modules, optimisers, user objects, dicts, lists and
tuples, and lists every *location*: an attribute of an object or an item of a container,
with its current value. A :class:`Tensor` found on the way contributes its ``cached_data``
and ``grad`` locations (a ``grad`` tensor is not walked: the step replaces it).

Comparing the locations before and after a traced call tells the compiler where each buffer
the kernels read comes from (a parameter's ``cached_data``, an optimiser's moment in a dict)
and where each buffer the step leaves behind goes. A :class:`Guard` made from the locations
after a call checks, before the next replay, that nothing changed them since (a learning
rate set, ``model.eval()``, a parameter loaded, a layer swapped): if anything did, the step
runs its Python again.

Example:
    >>> class Box:
    ...     def __init__(self): self.lr = 0.1
    >>> box = Box()
    >>> snap = snapshot(discover(lambda: box.lr))
    >>> [(loc.kind, loc.key) for loc in snap.values()]  # the global ``box``, then its lr
    [('global', 'box'), ('attr', 'lr')]
"""
from __future__ import annotations

import dis
import functools
import os
import sys
import sysconfig
import types
import weakref
from dataclasses import dataclass

import numpy as np

from needle.autograd import Tensor
from needle.backend_ndarray import NDArray

__all__ = ["Location", "discover", "snapshot", "Guard", "token", "unchanged", "bare",
           "MAX_OBJECTS", "WalkTooLarge"]

MAX_OBJECTS = 50_000  # a walk that reaches more gives up (the step keeps running its Python)
_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_OPAQUE = (types.ModuleType, type, types.BuiltinFunctionType, np.ndarray, NDArray,
           types.CodeType, types.FrameType, types.GeneratorType)


class WalkTooLarge(Exception):
    """The state reachable from the step is larger than :data:`MAX_OBJECTS`."""


@dataclass
class Location:
    """``container.key`` (``kind == "attr"``) or ``container[key]`` (``"item"``); a tuple's
    items (``"tuple"``) can be read but not set; ``"global"`` is a module global (an item of
    the module namespace, whose size is not guarded). ``value`` is what it held when walked."""

    container: object
    key: object
    kind: str
    value: object
    arg: int = -1  # >= 0: an attribute of the step's arg-th tensor argument (per call)

    def get(self, tensors=()):
        container = tensors[self.arg] if self.arg >= 0 else self.container
        if self.kind == "attr":
            return getattr(container, self.key, _MISSING)
        try:
            return container[self.key]  # type: ignore[index]
        except (KeyError, IndexError):
            return _MISSING

    def set(self, value, tensors=()) -> None:
        container = tensors[self.arg] if self.arg >= 0 else self.container
        if self.kind == "attr":
            setattr(container, self.key, value)
        else:
            container[self.key] = value  # type: ignore[index]

    @property
    def ident(self) -> tuple:
        if self.arg >= 0:
            return ("arg", self.arg, self.key)
        key = id(self.key) if isinstance(self.key, Tensor) else self.key
        return (id(self.container), self.kind, key)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


class _Global:
    """A module global a step function loads: walked as the location ``globals[name]``."""

    __slots__ = ("namespace", "name")

    def __init__(self, namespace: dict, name: str):
        self.namespace, self.name = namespace, name


_NEEDLE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = tuple({os.path.join(p, "") for p in (sys.prefix, sys.base_prefix,
                                                     sysconfig.get_paths()["purelib"])})


def _user_function(f) -> bool:
    """A function of the user's code: its globals and closures are the step's state.
    needle's own functions and those of installed libraries are not walked."""
    path = os.path.abspath(f.__code__.co_filename)
    return not path.startswith(_NEEDLE_DIR) and not path.startswith(_LIBRARY_DIRS)


def _roots(fn, seen_fns: set) -> list:
    """The objects (and module globals, as :class:`_Global`) a step function can reach
    without arguments."""
    out: list = []
    stack = [fn]
    while stack:
        f = stack.pop()
        if id(f) in seen_fns:
            continue
        seen_fns.add(id(f))
        if isinstance(f, types.MethodType):
            out.append(f.__self__)
            stack.append(f.__func__)
            continue
        if not isinstance(f, types.FunctionType):
            if callable(f) and hasattr(f, "__dict__") and not isinstance(f, type):
                out.append(f)  # a callable object (a Module, a functools.partial...)
                for extra in (getattr(f, "func", None), getattr(f, "__wrapped__", None)):
                    if extra is not None:
                        stack.append(extra)
                out.extend(getattr(f, "args", ()) or ())
            continue
        if not _user_function(f):
            continue
        for cell in f.__closure__ or ():
            if _filled(cell):
                value = cell.cell_contents
                if isinstance(value, (types.FunctionType, types.MethodType)):
                    stack.append(value)  # a helper defined around the step: its state too
                else:
                    out.append(value)
        out.extend(f.__defaults__ or ())
        out.extend((f.__kwdefaults__ or {}).values())
        g = f.__globals__
        for name in sorted(_global_names(f.__code__)):
            if name in g:
                value = g[name]
                if isinstance(value, (types.FunctionType, types.MethodType)):
                    stack.append(value)
                elif not isinstance(value, (types.ModuleType, type)):
                    out.append(_Global(g, name))
    return out


def _global_names(code) -> set:
    """The globals a code object (and the code nested in it) loads: ``co_names`` alone
    would also list attribute names (``opt.step`` names ``step``)."""
    names: set = set()
    codes = [code]
    while codes:
        c = codes.pop()
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                names.add(ins.argval)
        codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell (a name bound later in the enclosing function)
        return False
    return True


def discover(fn) -> list:
    """The roots of the state ``fn`` can reach without its arguments (module docstring)."""
    return _roots(fn, set())


def snapshot(roots: list, arguments: list = ()) -> dict[tuple, Location]:
    """Every location reachable from ``roots``, keyed by :attr:`Location.ident`, and the
    ``cached_data``/``grad`` locations of the tensor ``arguments`` (relative to the call).

    Raises:
        WalkTooLarge: more than :data:`MAX_OBJECTS` objects are reachable.
    """
    out: dict[tuple, Location] = {}
    for i, t in enumerate(arguments):
        for key in ("cached_data", "grad"):
            loc = Location(t, key, "attr", t.__dict__.get(key), i)
            out[loc.ident] = loc
    seen: set[int] = {id(t) for t in arguments}
    stack = list(roots)
    count = 0

    def add(container, key, kind, value):
        loc = Location(container, key, kind, value)
        out[loc.ident] = loc
        stack.append(value)

    while stack:
        obj = stack.pop()
        if isinstance(obj, _Global):
            add(obj.namespace, obj.name, "global", obj.namespace[obj.name])
            continue
        if isinstance(obj, _SCALARS) or isinstance(obj, _OPAQUE) or id(obj) in seen:
            continue
        if callable(obj) and isinstance(obj, (types.FunctionType, types.MethodType,
                                              types.BuiltinMethodType)):
            continue
        if getattr(type(obj), "_needle_opaque_state", False):
            continue  # e.g. a compiled step: its own counters are not the step's state
        seen.add(id(obj))
        count += 1
        if count > MAX_OBJECTS:
            raise WalkTooLarge(f"more than {MAX_OBJECTS} objects reachable from the step")
        if isinstance(obj, Tensor):
            out_key = (id(obj), "attr", "cached_data")
            out[out_key] = Location(obj, "cached_data", "attr", obj.__dict__.get("cached_data"))
            out[(id(obj), "attr", "grad")] = Location(obj, "grad", "attr",
                                                      obj.__dict__.get("grad"))
            continue
        if isinstance(obj, dict):
            for key, value in list(obj.items()):
                add(obj, key, "item", value)
                stack.append(key)
        elif isinstance(obj, list):
            for i, value in enumerate(obj):
                add(obj, i, "item", value)
        elif isinstance(obj, tuple):
            for i, value in enumerate(obj):
                add(obj, i, "tuple", value)
        elif isinstance(obj, (set, frozenset)):
            stack.extend(obj)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                for key, value in list(attrs.items()):
                    add(obj, key, "attr", value)
    return out


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) is type(b) and isinstance(a, _SCALARS):
        return a == b or (a != a and b != b)  # NaN equals NaN here
    return False


def token(value):
    """What identifies ``value`` without keeping it alive when it can be weakly referenced
    (a replaced buffer must be freed as it would be eagerly): a weak reference, the value
    itself for plain scalars and for objects without weak references (containers)."""
    if isinstance(value, _SCALARS):
        return ("value", value)
    try:
        return weakref.ref(value)
    except TypeError:
        return ("value", value)


def unchanged(tok, value) -> bool:
    """``value`` is what ``tok`` (from :func:`token`) identifies."""
    if isinstance(tok, weakref.ref):
        return tok() is value
    return _same(tok[1], value)


def bare(loc: Location) -> Location:
    """``loc`` without its value (a lookup that must not keep the value alive)."""
    return Location(loc.container, loc.key, loc.kind, None, loc.arg)


class Guard:
    """Checks that every location still holds what it held (identity; equality for plain
    scalars), and that no container grew or shrank. ``skip``: idents of locations not to
    check (those a program reads afresh or sets itself on every call)."""

    def __init__(self, locations: dict[tuple, Location], skip=()):
        skip = set(skip)
        state = [loc for loc in locations.values() if loc.arg < 0 and loc.ident not in skip]
        self.names = [f"{type(loc.container).__name__}.{loc.key}" for loc in state]
        self.checks = [(_getter(loc), token(loc.value)) for loc in state]
        sizes: dict[int, tuple] = {}
        for loc in locations.values():
            if loc.arg >= 0:
                continue
            if loc.kind == "attr" and not isinstance(loc.container, Tensor):
                attrs = getattr(loc.container, "__dict__", None)
                if isinstance(attrs, dict):
                    sizes[id(loc.container)] = (attrs, len(attrs))
            elif loc.kind == "item":
                sizes[id(loc.container)] = (loc.container, len(loc.container))  # type: ignore
        self.sizes = list(sizes.values())
        # the same checks split by kind, for the pass that finds nothing changed (every call
        # of a compiled step): identities through weak references, then plain values
        self._refs = [(get, tok) for get, tok in self.checks if tok.__class__ is weakref.ref]
        self._values = [(get, tok[1]) for get, tok in self.checks
                        if tok.__class__ is not weakref.ref]

    def failure(self) -> str | None:
        """None when nothing changed, else what did (the first difference found)."""
        for container, size in self.sizes:
            if len(container) != size:
                return self._first_difference()
        for get, ref in self._refs:
            if ref() is not get():
                return self._first_difference()
        for get, value in self._values:
            now = get()
            if now is not value and not _same(value, now):
                return self._first_difference()
        return None

    def _first_difference(self) -> str | None:
        for container, size in self.sizes:
            if len(container) != size:
                return f"a container of the step's state changed size ({size} -> " \
                       f"{len(container)})"
        for i, (get, tok) in enumerate(self.checks):
            value = get()
            if tok.__class__ is weakref.ref:
                if tok() is not value:
                    return f"{self.names[i]} changed since the last call"
            elif not _same(tok[1], value):
                return f"{self.names[i]} changed since the last call"
        return None


def _getter(loc: Location):
    """A fast ``loc.get`` (one C-level call where the container is a dict or has one)."""
    container, key = loc.container, loc.key
    if loc.kind == "attr":
        attrs = getattr(container, "__dict__", None)
        if isinstance(attrs, dict) and key in attrs:
            return functools.partial(attrs.get, key, _MISSING)
    elif isinstance(container, dict):
        return functools.partial(container.get, key, _MISSING)
    return loc.get
