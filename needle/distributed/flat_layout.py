"""Where every element of a gradient bucket lives: per-parameter pieces, rank-major buffers.

Rule: each parameter, flattened, is cut into ``world_size`` contiguous pieces whose sizes
differ by at most one (:func:`~needle.distributed.collectives.shard_bounds`); rank r owns
piece r of *every* parameter. Shards therefore never need to divide evenly, and the bytes a
rank holds are ``sum_p (b_p[r+1] - b_p[r])`` times the element size, which is what
``needle.memory.estimate(model=..., zero_stage=s, dp=n, rank=r)`` predicts.

A :class:`FlatLayout` packs a group of parameters (a GradSync bucket, a ZeRO stage-3 module) into
one 1-D buffer, *rank-major*: all of rank 0's pieces, then rank 1's, ... Segment r of the
buffer is then exactly rank r's data, which is what a ring reduce-scatter leaves reduced on
rank r and what a ring all-gather takes from rank r (``reduce_scatter_v``/``all_gather_v``
with :attr:`FlatLayout.bounds`). This module is pure NumPy: no communication, no needle
objects.

Example:
    >>> lay = FlatLayout([5, 2], world_size=2)
    >>> lay.bounds                      # rank 0: 2 + 1 elements, rank 1: 3 + 1
    [0, 3, 7]
    >>> import numpy as np
    >>> flat = lay.pack_all([np.arange(5.0), np.array([10.0, 11.0])])
    >>> flat.tolist()
    [0.0, 1.0, 10.0, 2.0, 3.0, 4.0, 11.0]
    >>> [p.tolist() for p in lay.unpack_mine(flat, 1)]
    [[2.0, 3.0, 4.0], [11.0]]
"""
from __future__ import annotations

import numpy as np


def piece_bounds(size: int, world_size: int) -> list[int]:
    """Offsets of the ``world_size`` pieces of a flattened parameter of ``size`` elements."""
    return [size * r // world_size for r in range(world_size + 1)]


class FlatLayout:
    """Rank-major packing of parameters of ``sizes`` (elements) over ``world_size`` ranks.

    ``offsets[r][j]``: where rank r's piece of parameter j starts in the flat buffer;
    ``bounds``: the ``world_size + 1`` segment offsets (segment r = rank r's pieces).
    """

    def __init__(self, sizes: list[int], world_size: int):
        self.sizes = [int(s) for s in sizes]
        self.world_size = int(world_size)
        self.pieces = [piece_bounds(s, self.world_size) for s in self.sizes]
        self.offsets: list[list[int]] = []
        self.bounds = [0]
        at = 0
        for r in range(self.world_size):
            row = []
            for b in self.pieces:
                row.append(at)
                at += b[r + 1] - b[r]
            self.offsets.append(row)
            self.bounds.append(at)
        self.numel = at

    def segment(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]

    def pack_all(self, arrays: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Every rank's pieces of full (flattened) arrays into one rank-major buffer."""
        out = np.empty(self.numel, dtype=arrays[0].dtype) if out is None else out
        for j, a in enumerate(arrays):
            a = a.reshape(-1)
            b = self.pieces[j]
            for r in range(self.world_size):
                at = self.offsets[r][j]
                out[at:at + b[r + 1] - b[r]] = a[b[r]:b[r + 1]]
        return out

    def pack_mine(self, pieces: list[np.ndarray], rank: int, out: np.ndarray) -> np.ndarray:
        """Rank's own pieces into its segment of ``out`` (the rest is left as it is)."""
        for j, a in enumerate(pieces):
            at = self.offsets[rank][j]
            out[at:at + a.size] = a.reshape(-1)
        return out

    def unpack_mine(self, flat: np.ndarray, rank: int) -> list[np.ndarray]:
        """Views of rank's pieces in its segment of ``flat``."""
        out = []
        for j, b in enumerate(self.pieces):
            at = self.offsets[rank][j]
            out.append(flat[at:at + b[rank + 1] - b[rank]])
        return out

    def unpack_all(self, flat: np.ndarray) -> list[np.ndarray]:
        """Full flattened parameters from a buffer whose every segment is filled."""
        out = []
        for j, b in enumerate(self.pieces):
            full = np.empty(self.sizes[j], dtype=flat.dtype)
            for r in range(self.world_size):
                at = self.offsets[r][j]
                full[b[r]:b[r + 1]] = flat[at:at + b[r + 1] - b[r]]
            out.append(full)
        return out

    def sent_elements(self, rank: int, kind: str) -> int:
        """Elements ``rank`` sends in a ring ``reduce_scatter`` (every segment but its own) or
        ``all_gather`` (every segment but its right neighbour's) of this buffer."""
        if self.world_size == 1:
            return 0
        skip = rank if kind == "reduce_scatter" else (rank + 1) % self.world_size
        lo, hi = self.segment(skip)
        return self.numel - (hi - lo)

