"""Per-parameter bookkeeping of ZeRO: which piece this rank owns, and the host/device moves.

What crosses the network is staged through host NumPy buffers (so any device works) by
``needle.distributed._buffers``' ``to_host``/``to_device``, except on a group whose collectives
run on the device (``nccl`` with ``cuda()`` parameters): there the flat buffers are device
arrays (``_device_buckets``) and every move is a device copy. The model state that stays
(weights, shard gradients) lives in the device's arrays, allocated from its caching allocator
in the right memory category.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from needle.autograd import Tensor
from needle.autograd.release import Released
from needle.memory import attribute, framework_category

from .. import _buffers, _device_buckets
from ..flat_layout import piece_bounds


class Sharded(Released):
    """Stands in for a stage-3 parameter's data between its module's forward and backward:
    answers ``shape``/``dtype``/``device``, refuses to be computed on."""

    __slots__ = ()

    def _fail(self, what: str):
        from needle._core.errors import ReleasedDataError

        raise ReleasedDataError(
            f"ZeroDataParallel: parameter {self.op_name} is sharded (stage 3) outside its "
            f"module's forward and backward, expected reads only while the module runs, got "
            f"a read of {what} (use ZeroDataParallel.full_parameters() or gathered())")


def host(array: Any) -> np.ndarray:
    """A flat, contiguous host copy of a device array."""
    return _buffers.to_host(array, flat=True)


def to_device(values: Any, like: "Entry", category: str, shape=None) -> Any:
    """A new device array of ``values`` (host values, or a device array: a device copy) on
    ``like``'s device and dtype, in ``category``."""
    with framework_category(category):
        if isinstance(values, np.ndarray):
            data = _buffers.to_device(values, like=like, shape=shape)
        else:
            data = _device_buckets.copy(values, shape)
    attribute(data, category)
    return data


def piece_of(data: Any, e: "Entry", device: Any) -> Any:
    """``e``'s piece of its whole array ``data``: a host copy, or a device view (``device``)."""
    return host(data)[e.lo:e.hi] if device is None else flat_view(data, e.lo, e.hi)


def new_flat(numel: int, dtype: str, device: Any) -> Any:
    """A flat buffer for a collective: on ``device`` (device buffers), else on the host."""
    if device is None:
        return np.empty(numel, dtype=dtype)
    return _device_buckets.empty(numel, dtype, device)


def mine(entries: list["Entry"], dtype: str, device: Any) -> list:
    """The entries' shard data to pack: host copies, or the device arrays themselves."""
    if device is not None:
        return [None if e.shard is None else e.shard.realize_cached_data() for e in entries]
    return [host(e.shard.realize_cached_data()) if e.shard is not None
            else np.empty(0, dtype) for e in entries]


def pack_mine(layout: Any, pieces: list, rank: int, flat: Any) -> None:
    if isinstance(flat, np.ndarray):
        layout.pack_mine(pieces, rank, flat)
    else:
        _device_buckets.pack_mine(layout, pieces, rank, flat)


def unpack_all(layout: Any, flat: Any) -> list:
    if isinstance(flat, np.ndarray):
        return layout.unpack_all(flat)
    return _device_buckets.unpack_all(layout, flat)


def flat_view(array: Any, lo: int, hi: int) -> Any:
    """Elements ``[lo, hi)`` of a compact array, as a view (no copy)."""
    return array.reshape((int(np.prod(array.shape)),))[lo:hi]


class Entry:
    """One parameter under ZeRO: its piece on this rank and the optimizer's view of it."""

    def __init__(self, index: int, name: str, param: Any, rank: int, world_size: int):
        self.index, self.name, self.param = index, name, param
        self.shape = tuple(param.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.dtype = str(param.dtype)
        self.device = param.device
        self.itemsize = np.dtype(self.dtype).itemsize
        self.bounds = piece_bounds(self.size, world_size)
        self.lo, self.hi = self.bounds[rank], self.bounds[rank + 1]
        self.shard: Tensor | None = None  # the optimizer's parameter (None: empty piece)
        self.grad: Any = None  # stages 2-3: the reduced gradient piece (device array)
        self.synced: Any = None  # stage 1: the whole gradient of the last sync (Tensor)

    @property
    def numel(self) -> int:
        """Elements of this rank's piece."""
        return self.hi - self.lo

    def make_shard(self, data: Any) -> None:
        """The 1-D Tensor the optimizer updates (nothing when the piece is empty)."""
        if self.numel:
            self.shard = Tensor.make_const(data, requires_grad=True)

    def release(self) -> None:
        """Stage 3: drop the full data, keep a stand-in with its shape."""
        data = self.param.cached_data
        if not isinstance(data, Released):
            self.param.cached_data = Sharded(self.shape, self.dtype, self.device,
                                             repr(self.name))

    @property
    def materialized(self) -> bool:
        return not isinstance(self.param.cached_data, Released)
