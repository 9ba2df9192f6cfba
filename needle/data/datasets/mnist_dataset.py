"""MNIST from the gzip-compressed IDX files (big-endian; magic 2051 images, 2049 labels).

Example (needs the files, hence skipped by doctest):
    >>> ds = MNISTDataset("data/t10k-images-idx3-ubyte.gz",
    ...                   "data/t10k-labels-idx1-ubyte.gz")  # doctest: +SKIP
    >>> ds[0][0].shape  # doctest: +SKIP
    (784,)
"""
from __future__ import annotations

import gzip
import os
import struct

import numpy as np

from ..._core.errors import NeedleError, ShapeError
from ..data_basic import Dataset

__all__ = ["MNISTDataset", "parse_mnist", "read_idx"]

_MAGIC_IMAGES = 2051
_MAGIC_LABELS = 2049


def read_idx(filename: str, magic: int) -> np.ndarray:
    """Read an IDX file (gzip-compressed or plain) of unsigned bytes.

    Raises:
        NeedleError: for a missing file or a wrong magic number.
    """
    if not os.path.exists(filename):
        raise NeedleError(f"read_idx: file not found, expected an IDX file, got {filename!r}")
    opener = gzip.open if filename.endswith(".gz") else open
    with opener(filename, "rb") as f:
        raw = f.read()
    (found,) = struct.unpack(">i", raw[:4])
    if found != magic:
        raise NeedleError(
            f"read_idx: bad magic number in {filename!r}, expected {magic}, got {found}")
    ndim = found & 0xFF
    dims = struct.unpack(">" + "i" * ndim, raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ShapeError(
            f"read_idx: truncated file {filename!r}, expected {int(np.prod(dims))} values, "
            f"got {data.size}")
    return data.reshape(dims)


def parse_mnist(image_filename: str, label_filename: str) -> tuple[np.ndarray, np.ndarray]:
    """Images as float32 (N, 784) scaled to [0, 1] and labels as uint8 (N,)."""
    images = read_idx(image_filename, _MAGIC_IMAGES)
    labels = read_idx(label_filename, _MAGIC_LABELS)
    if images.shape[0] != labels.shape[0]:
        raise ShapeError(
            f"parse_mnist: image and label counts differ, expected {images.shape[0]} labels, "
            f"got {labels.shape[0]}")
    X = images.reshape(images.shape[0], -1).astype(np.float32) / np.float32(255.0)
    return X, labels.astype(np.uint8)


class MNISTDataset(Dataset):
    """MNIST images (N, 784) in [0, 1] and uint8 labels.

    ``ds[i]`` (int, slice or index array) is ``(X[i], y[i])``; with transforms each image is
    viewed as 28×28×1, transformed, and flattened back.
    """

    def __init__(self, image_filename: str, label_filename: str, transforms=None):
        super().__init__(transforms)
        self.X, self.y = parse_mnist(image_filename, label_filename)
        side = int(round(np.sqrt(self.X.shape[1])))
        self._image_shape = (side, side, 1)

    def __len__(self) -> int:
        return self.X.shape[0]

    def __getitem__(self, index) -> tuple:
        X, y = self.X[index], self.y[index]
        if self.transforms:
            if X.ndim == 1:
                X = self.apply_transforms(X.reshape(self._image_shape)).reshape(-1)
            else:
                X = np.stack([self.apply_transforms(x.reshape(self._image_shape)).reshape(-1)
                              for x in X])
        return X, y
