"""Hook handles and the saved-tensor hooks context manager.

Example:
    >>> hooks = {}
    >>> h = RemovableHandle(hooks); hooks[h.id] = print
    >>> h.remove(); hooks
    {}
"""
from __future__ import annotations

import itertools

from .grad_mode import STATE

_HOOK_IDS = itertools.count()


class RemovableHandle:
    """Returned by ``register_hook``-style calls; ``remove()`` unregisters the hook."""

    __slots__ = ("_hooks", "id")

    def __init__(self, hooks: dict):
        self._hooks = hooks
        self.id = next(_HOOK_IDS)

    def remove(self) -> None:
        """Unregister the hook; removing twice is harmless."""
        self._hooks.pop(self.id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class saved_tensors_hooks:  # noqa: N801 - context manager named like PyTorch's
    """Route every tensor an op saves for backward through ``pack`` / ``unpack``.

    While the block is active, each op that records a graph calls ``pack(t)`` on every tensor
    its backward needs (inputs and, for some ops, its output) and keeps only what ``pack``
    returns; its backward calls ``unpack(packed)`` to get a Tensor back. Nested blocks: the
    innermost pair wins (as in PyTorch). This is the mechanism checkpointing and offloading
    build on.

    Example:
        >>> import needle as ndl
        >>> from needle.autograd import saved_tensors_hooks
        >>> seen = []
        >>> x = ndl.Tensor([1.0, 2.0])
        >>> with saved_tensors_hooks(lambda t: seen.append(t) or t, lambda p: p):
        ...     y = x * x
        >>> len(seen)
        2
    """

    def __init__(self, pack, unpack):
        self.pack = pack
        self.unpack = unpack

    def __enter__(self):
        self._prev = STATE.saved_hooks
        STATE.saved_hooks = (self.pack, self.unpack)
        return self

    def __exit__(self, *exc) -> None:
        STATE.saved_hooks = self._prev
