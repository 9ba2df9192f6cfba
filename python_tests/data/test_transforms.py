"""Transforms: exact RNG draws and results, re-derived with NumPy."""
from __future__ import annotations

import numpy as np
import pytest

from needle._core.errors import ShapeError
from needle.data import RandomCrop, RandomFlipHorizontal


def _image(h=5, w=4, c=2):
    return np.arange(h * w * c, dtype=np.float32).reshape(h, w, c)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_flip_matches_one_rand_draw(seed):
    img = _image()
    np.random.seed(seed)
    out = RandomFlipHorizontal(p=0.5)(img)
    after = np.random.rand()
    np.random.seed(seed)
    flip = np.random.rand() < 0.5
    expected = img[:, ::-1, :] if flip else img
    np.testing.assert_array_equal(out, expected)
    assert after == np.random.rand()  # exactly one draw was consumed


def test_flip_draws_even_when_certain():
    np.random.seed(7)
    RandomFlipHorizontal(p=0.0)(_image())
    RandomFlipHorizontal(p=1.0)(_image())
    x = np.random.rand()
    np.random.seed(7)
    np.random.rand(2)
    assert x == np.random.rand()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("padding", [1, 3])
def test_crop_matches_reference(seed, padding):
    img = _image(6, 5, 3)
    np.random.seed(seed)
    out = RandomCrop(padding)(img)
    np.random.seed(seed)
    sx, sy = np.random.randint(low=-padding, high=padding + 1, size=2)
    # Reference by explicit index arithmetic: out[i, j] = img[i + sx, j + sy] or zero outside.
    expected = np.zeros_like(img)
    for i in range(img.shape[0]):
        for j in range(img.shape[1]):
            a, b = i + sx, j + sy
            if 0 <= a < img.shape[0] and 0 <= b < img.shape[1]:
                expected[i, j] = img[a, b]
    np.testing.assert_array_equal(out, expected)
    assert out.shape == img.shape


def test_transforms_reject_non_hwc():
    with pytest.raises(ShapeError, match="RandomCrop"):
        RandomCrop(2)(np.zeros((4, 4)))
    with pytest.raises(ShapeError, match="RandomFlipHorizontal"):
        RandomFlipHorizontal()(np.zeros(4))
