"""The course's tiled matmul path: restride operands into (rows/T, cols/T, T, T) tiles.

Used by ``NDArray.__matmul__`` when ``ndarray.USE_TILED_MATMUL`` is set and the backend has
``matmul_tiled``; the packed ``matmul`` kernel is faster, so it is off by default.
"""
from __future__ import annotations


def tiled_ok(device, m: int, n: int, p: int) -> bool:
    """True when ``device`` has ``matmul_tiled`` and m, n, p are multiples of its tile."""
    mod = device.mod
    tile = getattr(mod, "__tile_size__", 0)
    return hasattr(mod, "matmul_tiled") and tile > 1 and not (m % tile or n % tile or p % tile)


def _tile(a, tile: int):
    rows, cols = a.shape
    return a.compact().as_strided(
        (rows // tile, cols // tile, tile, tile), (tile * cols, tile, cols, 1)).compact()


def matmul_tiled(a, b, m: int, n: int, p: int):
    """``a @ b`` through the backend's ``matmul_tiled`` (the course's contract)."""
    from .ndarray import NDArray  # ndarray imports this module

    tile = a.device.__tile_size__
    t = NDArray.make((m // tile, p // tile, tile, tile), device=a.device, dtype=a.dtype)
    a.device.matmul_tiled(_tile(a, tile)._handle, _tile(b, tile)._handle, t._handle, m, n, p)
    return t.permute((0, 2, 1, 3)).compact().reshape((m, p))
