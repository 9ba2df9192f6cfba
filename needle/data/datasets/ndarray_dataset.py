"""A dataset over in-memory arrays that share their first axis.

Example:
    >>> import numpy as np
    >>> from needle.data import NDArrayDataset
    >>> ds = NDArrayDataset(np.arange(6).reshape(3, 2), np.array([7, 8, 9]))
    >>> [a.tolist() for a in ds[1]]
    [[2, 3], 8]
"""
from __future__ import annotations

import numpy as np

from ..._core.errors import ShapeError
from ..data_basic import Dataset

__all__ = ["NDArrayDataset"]


class NDArrayDataset(Dataset):
    """Item ``i`` is ``tuple(a[i] for a in arrays)``; indices may be ints or index arrays.

    Raises:
        ShapeError: when the arrays disagree on their first dimension.
    """

    def __init__(self, *arrays):
        super().__init__()
        self.arrays = [np.asarray(a) for a in arrays]
        if self.arrays:
            n = self.arrays[0].shape[0]
            for a in self.arrays[1:]:
                if a.shape[0] != n:
                    raise ShapeError(
                        f"NDArrayDataset: arrays must share their first dimension, expected "
                        f"{n}, got {a.shape[0]}")

    def __len__(self) -> int:
        return self.arrays[0].shape[0] if self.arrays else 0

    def __getitem__(self, i) -> tuple:
        return tuple(a[i] for a in self.arrays)
