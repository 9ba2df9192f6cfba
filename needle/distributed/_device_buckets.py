"""GradSync buckets in device memory, for groups whose collectives run on the device (an
``nccl`` group with ``cuda()`` parameters): gradients are packed into the bucket and unpacked
from it with device copies, so a DDP step moves no gradient through host memory.

The layout is the host buckets' own rank-major :class:`FlatLayout`, so every bucket, hook and
bound means the same thing on both paths. Buffers made here are new, seen by no graph yet:
they are filled with ``_setitem`` (no version bump), as a new array from host values would be.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .flat_layout import FlatLayout


def on_device(group: Any, params: list) -> Any:
    """The device the buckets live on: the parameters' when ``group`` runs its collectives
    there (NCCL) and every parameter is on that one device; None for host buckets."""
    if getattr(group, "nccl", None) is None or not params:
        return None
    device = params[0].device
    if getattr(device, "name", None) != "cuda" or any(p.device != device for p in params):
        return None
    return device


def empty(numel: int, dtype: str, device: Any) -> Any:
    from needle.backend_ndarray.ndarray import NDArray

    return NDArray.make((numel,), device=device, dtype=dtype)


def zeros(numel: int, dtype: str, device: Any) -> Any:
    out = empty(numel, dtype, device)
    out.fill(0)
    return out


def pack(layout: FlatLayout, flat: Any, j: int, grad: Any, weight: float) -> None:
    """Member j's gradient (an NDArray), times ``weight``, into every rank's segment."""
    b, grad = layout.pieces[j], grad.compact().reshape((layout.sizes[j],))
    for r in range(layout.world_size):
        if b[r + 1] == b[r]:
            continue
        at = layout.offsets[r][j]
        piece = grad[b[r]:b[r + 1]]
        flat._setitem(slice(at, at + b[r + 1] - b[r]), piece if weight == 1.0 else piece * weight)


def pack_mine(layout: FlatLayout, pieces: list, rank: int, flat: Any) -> None:
    """Rank's own pieces (NDArrays, None for an empty one) into its segment of ``flat``."""
    for j, piece in enumerate(pieces):
        if piece is not None and piece.size:
            at = layout.offsets[rank][j]
            flat._setitem(slice(at, at + piece.size), piece.compact().reshape((piece.size,)))


def unpack_mine(layout: FlatLayout, flat: Any, rank: int) -> list:
    """Views of rank's pieces in its segment of ``flat``."""
    return [flat[layout.offsets[rank][j]:layout.offsets[rank][j] + b[rank + 1] - b[rank]]
            for j, b in enumerate(layout.pieces)]


def copy(values: Any, shape: tuple | None = None) -> Any:
    """A new compact NDArray on ``values``' device holding ``values`` (reshaped)."""
    out = empty(values.size, values.dtype, values.device)
    if values.size:
        out._setitem(slice(None), values.compact().reshape((values.size,)))
    return out if shape is None else out.reshape(tuple(shape))


def unpack_all(layout: FlatLayout, flat: Any) -> list:
    """Each member's full (flattened) gradient from a bucket whose every segment is filled:
    a view of ``flat`` when the member is one piece, else a gathered copy."""
    out = []
    for j, b in enumerate(layout.pieces):
        pieces = [(layout.offsets[r][j], b[r], b[r + 1]) for r in range(layout.world_size)
                  if b[r + 1] > b[r]]
        if len(pieces) == 1:
            at, lo, hi = pieces[0]
            out.append(flat[at:at + hi - lo])
            continue
        full = empty(layout.sizes[j], flat.dtype, flat.device)
        for at, lo, hi in pieces:
            full._setitem(slice(lo, hi), flat[at:at + hi - lo])
        out.append(full)
    return out


# ---- what the sync engine and ZeRO call, on either kind of bucket --------------------------
def attach(buckets: list, group: Any, params: list, hook: Any) -> Any:
    """Put the buckets on the parameters' device when the hook allows it (``device_buckets``)
    and ``group`` runs on the device; returns that device (None: host buckets)."""
    device = on_device(group, params) if getattr(hook, "device_buckets", False) else None
    for b in buckets:
        b.device = device
    return device


def pack_into(bucket: Any, j: int, grad: Any, weight: float) -> None:
    """Bucket.pack for a device bucket (allocated at its first pack)."""
    if bucket.flat is None:
        bucket.flat = empty(bucket.layout.numel, bucket.dtype, bucket.device)
    pack(bucket.layout, bucket.flat, j, grad, weight)


def gradient_of(param: Any, device: Any, owner: str) -> Any:
    """The gradient to pack: the device array itself, or a host buffer of it."""
    if device is not None:
        return param.grad.realize_cached_data()
    from ._buffers import borrow

    return borrow(param.grad, owner, readonly=True).arr


def zeros_for(param: Any, bucket: Any) -> Any:
    """A zero gradient for ``param`` (it got none), host or device as ``bucket`` is."""
    numel = int(np.prod(param.shape))
    if bucket.device is None:
        return np.zeros(numel, bucket.dtype)
    return zeros(numel, bucket.dtype, bucket.device)


def unpack_bucket(bucket: Any) -> list:
    """Every member's full gradient of a filled bucket, host or device."""
    if bucket.device is None:
        return bucket.layout.unpack_all(bucket.flat)
    return unpack_all(bucket.layout, bucket.flat)


def unpack_bucket_mine(bucket: Any, rank: int) -> list:
    """Rank's pieces of a bucket, host or device."""
    if bucket.device is None:
        return bucket.layout.unpack_mine(bucket.flat, rank)
    return unpack_mine(bucket.layout, bucket.flat, rank)


def values_like(t: Any, like: Any) -> Any:
    """``t``'s values where ``like`` lives: a NumPy copy next to host values, else its array."""
    return t.numpy() if isinstance(like, np.ndarray) else t.realize_cached_data()
