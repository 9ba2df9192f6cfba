"""MNIST from the gzip-compressed IDX files (big-endian; magic 2051 images, 2049 labels).

Example (needs the files, hence skipped by doctest):
    >>> ds = MNISTDataset("data/t10k-images-idx3-ubyte.gz",
    ...                   "data/t10k-labels-idx1-ubyte.gz")  # doctest: +SKIP
    >>> ds[0][0].shape  # doctest: +SKIP
    (784,)
"""
from __future__ import annotations

import gzip
import math
import os
import struct
import zlib

import numpy as np

from ..._core.errors import DataError, NeedleError, ShapeError
from ..data_basic import Dataset

__all__ = ["MNISTDataset", "parse_mnist", "read_idx"]

_MAGIC_IMAGES = 2051
_MAGIC_LABELS = 2049
_INFLATE_MAX = 1032  # DEFLATE cannot inflate data by more than this factor


def read_idx(filename: str, magic: int) -> np.ndarray:
    """Read an IDX file (gzip-compressed or plain) of unsigned bytes.

    The header's sizes are checked before the data is read: no more is read than the file can
    hold (a gzip stream inflates at most ``_INFLATE_MAX`` times its size).

    Raises:
        NeedleError: for a missing file or a wrong magic number.
        DataError: for a file that is not a regular file, unreadable (a corrupted gzip
            stream), or whose header is truncated or declares negative or impossible sizes.
        ShapeError: for data shorter or longer than the header declares.
    """
    if not os.path.exists(filename):
        raise NeedleError(f"read_idx: file not found, expected an IDX file, got {filename!r}")
    if not os.path.isfile(filename):
        raise DataError(f"read_idx: {filename!r} is not a regular file, expected an IDX file")
    packed = filename.endswith(".gz")
    most = os.path.getsize(filename) * (_INFLATE_MAX if packed else 1)
    try:
        with (gzip.open if packed else open)(filename, "rb") as f:
            return _read_idx_stream(f, filename, magic, most)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(f"read_idx: {filename!r} is unreadable, expected an IDX file, got "
                        f"{type(exc).__name__}: {exc}") from None


def _read_exactly(f, n: int, filename: str, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise DataError(f"read_idx: truncated header in {filename!r}, expected {n} bytes of "
                        f"{what}, got {len(data)}")
    return data


def _read_idx_stream(f, filename: str, magic: int, most: int) -> np.ndarray:
    (found,) = struct.unpack(">i", _read_exactly(f, 4, filename, "magic number"))
    if found != magic:
        raise NeedleError(
            f"read_idx: bad magic number in {filename!r}, expected {magic}, got {found}")
    ndim = found & 0xFF
    dims = struct.unpack(">" + "i" * ndim, _read_exactly(f, 4 * ndim, filename, "dimensions"))
    count = math.prod(dims)
    if min(dims, default=0) < 0 or count > most:
        raise DataError(f"read_idx: {filename!r} declares dimensions {dims} ({count} values), "
                        f"expected non-negative dimensions of at most {most} values (what the "
                        f"file can hold)")
    data = np.frombuffer(f.read(count + 1), dtype=np.uint8)  # one more: a longer file shows
    if data.size != count:
        raise ShapeError(
            f"read_idx: {'truncated' if data.size < count else 'overlong'} file {filename!r}, "
            f"expected {count} values, got {'more than ' if data.size > count else ''}"
            f"{min(data.size, count)}")
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
