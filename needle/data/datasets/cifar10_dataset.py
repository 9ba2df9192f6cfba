"""CIFAR-10 from the python pickles (``data_batch_1..5`` and ``test_batch``).

Example (needs the files, hence skipped by doctest):
    >>> ds = CIFAR10Dataset("data/cifar-10-batches-py", train=False)  # doctest: +SKIP
    >>> ds[0][0].shape  # doctest: +SKIP
    (3, 32, 32)
"""
from __future__ import annotations

import os

import numpy as np

from ..._core.errors import NeedleError
from ..data_basic import Dataset
from .safe_pickle import load_cifar_batch

__all__ = ["CIFAR10Dataset"]

_TRAIN_FILES = [f"data_batch_{k}" for k in range(1, 6)]
_TEST_FILES = ["test_batch"]


class CIFAR10Dataset(Dataset):
    """CIFAR-10 images as float32 (N, 3, 32, 32) in [0, 1] and uint8 labels.

    Args:
        base_folder: folder holding the pickles.
        train: the five training batches (True) or the test batch.
        p: kept for the course signature (unused).
        transforms: applied per image on its H×W×C view.

    Raises:
        NeedleError: when a pickle is missing.
        DataError: when a file is not a plain CIFAR-10 batch (it is never executed).
    """

    def __init__(self, base_folder: str, train: bool, p: float = 0.5, transforms=None):
        super().__init__(transforms)
        self.p = p
        names = _TRAIN_FILES if train else _TEST_FILES
        missing = [n for n in names if not os.path.exists(os.path.join(base_folder, n))]
        if missing:
            raise NeedleError(
                f"CIFAR10Dataset: missing pickle files in {base_folder!r}, expected {names}, "
                f"got none for {missing}")
        # Never pickle.load: a crafted batch would run code (safe_pickle.py).
        parts = [load_cifar_batch(os.path.join(base_folder, n)) for n in names]
        data = np.concatenate([d for d, _ in parts])
        self.X = data.reshape(-1, 3, 32, 32).astype(np.float32) / np.float32(255.0)
        self.y = np.concatenate([lab for _, lab in parts])

    def __len__(self) -> int:
        return self.X.shape[0]

    def _transform(self, img: np.ndarray) -> np.ndarray:
        hwc = self.apply_transforms(img.transpose(1, 2, 0))
        return np.ascontiguousarray(hwc.transpose(2, 0, 1))

    def __getitem__(self, index) -> tuple:
        X, y = self.X[index], self.y[index]
        if self.transforms:
            X = self._transform(X) if X.ndim == 3 else np.stack([self._transform(x) for x in X])
        return X, y
