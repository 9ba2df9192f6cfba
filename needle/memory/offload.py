"""``offload_saved_tensors()``: keep what backward needs in host memory, not on the device.

Inside the block every tensor an op saves for backward is copied to a host NumPy array when
the op runs (``pack``) and copied back to the device when backward reads it (``unpack``).
The device copy is then referenced by nothing but graph links, so autograd's release
(``needle/autograd/release.py``) frees it: between forward and backward the device holds only
what nobody could offload. The block lowers the release threshold to every size (as
``release_unsaved`` does), so small saved arrays go too.

What stays on the device:

* leaves (parameters, inputs): they are alive anyway, a host copy would only add bytes;
* tensors you still name (the loss, an output you keep): released once you drop them;
* anything saved outside the block.

Where the bytes go: on ``cpu_numpy()`` and ``cpu()`` the "device" is needle's caching
allocator and the host copies are plain NumPy arrays outside it, so ``needle.memory.stats``
shows the drop (the process's total memory does not drop: on a CPU the host is the same RAM;
the point is what the device allocator must hold, which is what matters on ``cuda()``).
Unpacked copies are allocated in the ``activation`` category during backward.

Gradients are unchanged (the copies are exact). As with checkpoint regions, gradients of
gradients (``create_graph=True``) see the unpacked tensors as constants.

This module is L2: the saved-tensor hooks and the release come from the autograd layer
(L3), which hands them over when it is imported (:func:`provide`).

Example:
    >>> import numpy as np, needle as ndl
    >>> x = ndl.Tensor(np.ones((4, 4)), device=ndl.cpu_numpy())
    >>> with offload_saved_tensors() as off:
    ...     y = (ndl.exp(x * 2) * 3).sum()
    >>> y.backward(); off.packed, x.grad.shape
    (1, (4, 4))
"""
from __future__ import annotations

from .categories import framework_category

__all__ = ["offload_saved_tensors", "provide"]

_HOOKS = None    # L3's saved_tensors_hooks(pack, unpack) class
_RELEASE = None  # L3's release_unsaved() context manager


def provide(saved_tensors_hooks, release_unsaved) -> None:
    """Called by ``needle.autograd`` at import: the two mechanisms the block is made of."""
    global _HOOKS, _RELEASE
    _HOOKS, _RELEASE = saved_tensors_hooks, release_unsaved


class _OnHost:
    """A saved tensor's values in host memory, and what is needed to bring them back."""

    __slots__ = ("values", "device", "dtype", "cls")

    def __init__(self, values, device, dtype, cls):
        self.values, self.device, self.dtype, self.cls = values, device, dtype, cls


class offload_saved_tensors:  # noqa: N801 - a context manager, named like one
    """Pack saved tensors to host NumPy arrays inside the block (see the module docstring).

    Attributes:
        packed: tensors copied to the host so far; ``packed_bytes``: their bytes;
        unpacked: tensors brought back by backward.
    """

    def __init__(self):
        self.packed = self.packed_bytes = self.unpacked = 0

    def _pack(self, tensor):
        if tensor.op is None:
            return tensor  # a leaf: alive anyway, keep the reference
        data = tensor.realize_cached_data()
        values = data.numpy()  # a copy, in host memory outside needle's allocators
        self.packed += 1
        self.packed_bytes += values.nbytes
        return _OnHost(values, data.device, data.dtype, type(tensor))

    def _unpack(self, packed):
        if not isinstance(packed, _OnHost):
            return packed
        from needle.backend_ndarray import NDArray

        with framework_category("activation"):
            array = NDArray(packed.values, device=packed.device, dtype=packed.dtype)
        self.unpacked += 1
        return packed.cls.make_const(array)

    def __enter__(self) -> "offload_saved_tensors":
        if _HOOKS is None:
            raise RuntimeError("offload_saved_tensors: needle.autograd is not imported, "
                               "expected `import needle` first, got no saved-tensor hooks")
        self._hooks = _HOOKS(self._pack, self._unpack)
        self._release = _RELEASE()
        self._release.__enter__()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._release.__exit__(*exc)
