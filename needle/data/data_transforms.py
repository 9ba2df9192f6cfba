"""Image transforms on H×W×C NumPy arrays.

Each transform consumes NumPy's global RNG in a fixed way (``RandomFlipHorizontal``: one
``np.random.rand()``; ``RandomCrop``: one ``np.random.randint(size=2)``): the course's
golden arrays depend on the exact draws.

Example:
    >>> import numpy as np
    >>> from needle.data import RandomFlipHorizontal
    >>> RandomFlipHorizontal(p=1.0)(np.arange(6.0).reshape(1, 3, 2))[0, :, 0].tolist()
    [4.0, 2.0, 0.0]
"""
from __future__ import annotations

import numpy as np

from .. import random as _random
from .._core.errors import ShapeError

__all__ = ["Transform", "RandomFlipHorizontal", "RandomCrop"]


class Transform:
    """Base class: a callable from an H×W×C array to an H×W×C array."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def _check_hwc(name: str, img) -> None:
    if np.ndim(img) != 3:
        raise ShapeError(
            f"{name}: image must be H x W x C, expected 3 dimensions, got shape {np.shape(img)}")


class RandomFlipHorizontal(Transform):
    """Flip the image left-right (along W) with probability ``p``.

    Draws ``np.random.rand()`` exactly once per call, even when ``p`` is 0 or 1.
    """

    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, img: np.ndarray) -> np.ndarray:
        flip = _random.rand() < self.p
        _check_hwc("RandomFlipHorizontal", img)
        return np.flip(img, axis=1) if flip else img


class RandomCrop(Transform):
    """Zero-pad H and W by ``padding`` and cut an H×W window shifted at random.

    Draws ``np.random.randint(-padding, padding + 1, size=2)`` once per call: the first value
    shifts rows (H), the second columns (W).
    """

    def __init__(self, padding: int = 3):
        self.padding = padding

    def __call__(self, img: np.ndarray) -> np.ndarray:
        pad = self.padding
        shift_x, shift_y = _random.randint(-pad, high=pad + 1, size=2)
        _check_hwc("RandomCrop", img)
        h, w = img.shape[0], img.shape[1]
        padded = np.pad(img, ((pad, pad), (pad, pad), (0, 0)))
        return padded[pad + shift_x:pad + shift_x + h, pad + shift_y:pad + shift_y + w, :]
