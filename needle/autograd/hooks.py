"""Saved-tensor hooks: what an op keeps for backward can be routed through user functions.

Hook handles (``register_hook`` and friends) are the one handle type of needle,
:class:`needle._core.handles.RemovableHandle`, re-exported here.

Example:
    >>> import needle as ndl
    >>> x = ndl.Tensor([1.0, 2.0])
    >>> h = x.register_hook(lambda g: g * 2)
    >>> h.remove()
"""
from __future__ import annotations

from .._core.handles import RemovableHandle
from .grad_mode import STATE

__all__ = ["RemovableHandle", "saved_tensors_hooks", "pack_saved", "SAVED_SELF"]

# Stands for "the saved tensor is the node's own output" in a packed list (a reference to the
# node itself would make a cycle node -> _saved -> node).
SAVED_SELF = object()


def pack_saved(op, node, hooks) -> tuple:
    """``(unpack, packed)``: ``pack`` applied to every tensor ``op`` saves of ``node``."""
    pack, unpack = hooks
    idx = op.save_inputs
    inputs = node.inputs if idx is None else [node.inputs[i] for i in idx]
    packed = [pack(x) for x in inputs]
    if op.save_output:
        out = pack(node)
        packed.append(SAVED_SELF if out is node else out)
    return (unpack, packed)


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
