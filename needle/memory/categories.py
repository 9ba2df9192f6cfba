"""Memory categories: which part of training a buffer belongs to.

Every allocation is attributed to one of :data:`CATEGORIES`. The framework sets the category
(``framework_category``: forward ops are ``activation``, backward ``gradient``, ...); a user
``with category(name):`` block overrides the framework inside it. The state is thread-local, so a
communication thread does not inherit the main thread's category.

Resolution order (:func:`resolve`): innermost user ``category`` > explicit hint passed by the
caller (e.g. L1's ``workspace``) > innermost ``framework_category`` > the op default >
``"other"``. The op default is one thread-local field (``thread_state().op_category``) that the
autograd dispatch sets to ``"activation"`` only while it computes an op it records: two
attribute writes per op instead of a scope, because small models are dispatch-bound.

Example:
    >>> from needle.memory.categories import category, current_category
    >>> with category("optimizer"):
    ...     current_category()
    'optimizer'
    >>> current_category()
    'other'
"""
from __future__ import annotations

import threading
from typing import Callable

from .._core.handles import Callbacks, RemovableHandle
from ._errors import MemoryArgumentError

__all__ = ["CATEGORIES", "category", "framework_category", "as_forward", "current_category",
           "resolve", "check_category", "add_listener", "thread_state"]

# ``optimizer`` is the optimizer's state (moments, momentum); ``master`` its float32 master
# copies of float16 parameters (mixed precision); ``optimizer_temp`` the temporaries of its
# update, alive only inside ``step()``.
CATEGORIES = ("weight", "gradient", "optimizer", "master", "optimizer_temp", "activation",
              "workspace", "other")
_CATEGORY_SET = frozenset(CATEGORIES)
_DEFAULT = "other"


class _State(threading.local):
    # Class attributes = the per-thread defaults (a fresh thread is outside any op and scope).
    # ``user_top`` and ``framework_top`` repeat the stacks' innermost entries: the C++
    # allocator reads these three fields at each allocation instead of calling resolve().
    op_category: str | None = None
    user_top: str | None = None
    framework_top: str | None = None

    def __init__(self) -> None:
        self.user: list[str] = []
        self.framework: list[str | None] = []
        # set on every thread, so that the C++ allocator finds all three in this thread's
        # attribute dict (one lookup per allocation instead of three)
        self.op_category = self.user_top = self.framework_top = None


_STATE = _State()


def thread_state() -> _State:
    """The thread-local category state; L3 writes its ``op_category`` field directly.

    Example:
        >>> st = thread_state(); st.op_category = "activation"; current_category()
        'activation'
        >>> st.op_category = None
    """
    return _STATE
# Listeners learn the resolved category whenever a scope opens or closes; the C++ allocator
# keeps its own "current category" and is kept in sync this way.
_LISTENERS = Callbacks()


def check_category(name: str, op: str = "category") -> str:
    """Return ``name`` if it is a known category, else raise :class:`MemoryArgumentError`.

    Example:
        >>> check_category("weight")
        'weight'
    """
    if name not in _CATEGORY_SET:
        raise MemoryArgumentError(
            f"{op}: unknown memory category, expected one of {list(CATEGORIES)}, got {name!r}")
    return name


def resolve(hint: str | None = None) -> str:
    """The category an allocation made now is attributed to (see the module docstring).

    ``hint`` is assumed valid (callers inside needle pass constants).

    Example:
        >>> resolve("workspace")
        'workspace'
    """
    state = _STATE
    name = state.user_top
    if name is not None:
        return name
    if hint is not None:
        return hint
    name = state.framework_top
    if name is not None:
        return name
    return state.op_category or _DEFAULT


def current_category() -> str:
    """The category of an allocation made now without a hint.

    Example:
        >>> current_category()
        'other'
    """
    return resolve(None)


def _notify() -> None:
    if _LISTENERS:
        name = resolve(None)
        for fn in _LISTENERS:
            fn(name)


class _scope:
    """The context manager of :func:`category` and :func:`framework_category`: pushes
    ``name`` on ``stack`` for the block and keeps the state's matching ``*_top`` field equal
    to the stack's innermost entry. A class rather than a generator context manager:
    optimizers open one per parameter and step, and this is a third of the cost."""

    __slots__ = ("_stack", "_name", "_top")

    def __init__(self, stack: list, name: str | None, top: str):
        self._stack, self._name, self._top = stack, name, top

    def __enter__(self) -> str | None:
        self._stack.append(self._name)
        setattr(_STATE, self._top, self._name)
        if _LISTENERS:
            _notify()
        return self._name

    def __exit__(self, *exc) -> None:
        stack = self._stack
        stack.pop()
        setattr(_STATE, self._top, stack[-1] if stack else None)
        if _LISTENERS:
            _notify()


def category(name: str):
    """Attribute every allocation (and framework re-attribution) inside the block to ``name``.

    Args:
        name: one of :data:`CATEGORIES`.

    Raises:
        MemoryArgumentError: for an unknown name.

    Example:
        >>> with category("workspace"):
        ...     resolve("activation")
        'workspace'
    """
    check_category(name)
    return _scope(_STATE.user, name, "user_top")


def framework_category(name: str):
    """Default category for allocations inside the block; a user ``category`` wins over it.

    Used by the autograd engine (``activation``, ``gradient``) and optimizers (``optimizer``).

    Example:
        >>> with framework_category("activation"):
        ...     current_category()
        'activation'
    """
    check_category(name, "framework_category")
    return _scope(_STATE.framework, name, "framework_top")


def as_forward():
    """Inside the block allocations are attributed as in a forward pass, whatever framework
    scope is open outside (``activation`` for recorded ops, else ``other``): a checkpoint
    region recomputes its forward inside backward this way, so a recomputed buffer lands in
    the category its first forward gave it.

    Example:
        >>> with framework_category("gradient"), as_forward():
        ...     current_category()
        'other'
    """
    return _scope(_STATE.framework, None, "framework_top")


def add_listener(fn: Callable[[str], None]) -> RemovableHandle:
    """Call ``fn(resolved_name)`` each time a category scope opens or closes (any thread).

    Returns a handle whose ``remove()`` unregisters ``fn``.
    """
    return _LISTENERS.add(fn)
