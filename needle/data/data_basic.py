"""Dataset and DataLoader, as the course's framework defines them.

The DataLoader draws exactly one ``np.random.permutation(len(dataset))`` per pass, when the
pass starts (``iter()``), and nothing else: the course's goldens depend on that. With a
``sampler`` (e.g. :class:`~needle.data.DistributedSampler`) the pass visits the sampler's
indices instead and draws nothing from ``np.random``. Its ``state_dict()`` records the current
pass's order and position so that a run can stop mid-epoch and resume with the very same
remaining batches.

Example:
    >>> import numpy as np
    >>> from needle.data import DataLoader, NDArrayDataset
    >>> loader = DataLoader(NDArrayDataset(np.arange(10.0).reshape(5, 2)), batch_size=2)
    >>> [b[0].shape for b in loader]
    [(2, 2), (2, 2), (1, 2)]
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from .. import random as _random
from .._core.errors import NeedleError, ShapeError
from ..autograd import Tensor
from .workers import WorkerPool, fetch

__all__ = ["Dataset", "DataLoader"]


class Dataset:
    """Abstract dataset: subclasses implement ``__getitem__`` and ``__len__``.

    Args:
        transforms: optional list of callables applied in order by :meth:`apply_transforms`.
    """

    def __init__(self, transforms: list | None = None):
        self.transforms = transforms

    def __getitem__(self, index) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def apply_transforms(self, x):
        if self.transforms is not None:
            for transform in self.transforms:
                x = transform(x)
        return x


def _split_batches(order: np.ndarray, batch_size: int) -> list[np.ndarray]:
    return np.array_split(order, range(batch_size, len(order), batch_size))


class DataLoader:
    """Iterate over a dataset in minibatches of Tensors.

    Args:
        dataset: a :class:`Dataset` whose ``__getitem__`` accepts an index array and returns a
            tuple of arrays with a leading batch axis (every needle dataset does; others are
            fetched item by item and stacked).
        batch_size: examples per batch; the last batch may be shorter unless ``drop_last``.
        shuffle: draw a new random order (one ``np.random.permutation``) at each pass.
        sampler: instead of ``shuffle``, an iterable of dataset indices with ``len()``, read
            anew at each pass (e.g. a DistributedSampler: call its ``set_epoch`` per epoch).
        drop_last: skip a final short batch.
        device, dtype: where the batch Tensors are created (default: the default device and
            the course's dtype coercion).
        num_workers: processes that fetch batches ahead (0: fetch in this process). The
            batches and their order are those of ``num_workers=0``, and so is the resume
            position (see :mod:`needle.data.workers`); the dataset must pickle. Call
            :meth:`close` (or let the loader go) to stop them.
        collate_fn: ``collate_fn(list of dataset[i]) -> array or tuple of arrays`` makes
            each batch from its items, as PyTorch's does (default: ``dataset[indices]``).

    Raises:
        NeedleError: for a batch size below 1, a negative ``num_workers``, or
            ``shuffle=True`` together with a sampler.
    """

    def __init__(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = False, *,
                 sampler=None, drop_last: bool = False, device=None, dtype=None,
                 num_workers: int = 0, collate_fn=None):
        if int(batch_size) < 1:
            raise NeedleError(
                f"DataLoader: batch_size must be positive, expected >= 1, got {batch_size}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise NeedleError(f"DataLoader: num_workers must be an int >= 0, got "
                              f"{num_workers!r}")
        self.num_workers, self.collate_fn = num_workers, collate_fn
        self._pool: WorkerPool | None = None
        self._passes = 0  # passes started: seeds the workers' random transforms
        if sampler is not None and shuffle:
            raise NeedleError("DataLoader: shuffle and sampler exclude each other, expected "
                              "shuffle=False with a sampler (the sampler decides the order), "
                              "got shuffle=True")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.sampler = sampler
        self.drop_last = drop_last
        self.device = device
        self.dtype = dtype
        self.ordering: list[np.ndarray] = _split_batches(self._pass_order(), self.batch_size)
        self._batch_index = 0
        self._started = False
        self._resume_pending = False

    def _num_indices(self) -> int:
        return len(self.sampler) if self.sampler is not None else len(self.dataset)

    def _pass_order(self) -> np.ndarray:
        """Index order of a new pass (the one permutation is drawn by ``__iter__`` itself)."""
        if self.sampler is not None:
            return np.asarray(list(self.sampler), dtype=np.int64)
        return np.arange(len(self.dataset))

    def __len__(self) -> int:
        n = self._num_indices()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple]:
        if self._resume_pending:
            # Continue the pass recorded by load_state_dict: no new permutation is drawn.
            self._resume_pending = False
            return self
        if self.shuffle:
            order = _random.permutation(len(self.dataset))
        else:
            order = self._pass_order()
        self.ordering = _split_batches(order, self.batch_size)
        self._batch_index = 0
        self._started = True
        self._passes += 1
        return self

    def __next__(self) -> tuple:
        if self._batch_index >= len(self.ordering):
            raise StopIteration
        indices = self.ordering[self._batch_index]
        if self.drop_last and len(indices) < self.batch_size:
            self._batch_index = len(self.ordering)
            raise StopIteration
        if self.num_workers:
            if self._pool is None:
                self._pool = WorkerPool(self.dataset, self.collate_fn, self.num_workers)
            batch = self._pool.get(self.ordering, self._batch_index, self._passes)
        else:
            batch = fetch(self.dataset, self.collate_fn, indices)
        self._batch_index += 1
        return tuple(Tensor(a, device=self.device, dtype=self.dtype, requires_grad=False)
                     for a in batch)

    def close(self) -> None:
        """Stop the worker processes (a later batch starts them again)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the processes end with it
            pass

    # ---- resumable position ------------------------------------------------------------
    def state_dict(self) -> dict:
        """The current pass's index order and the number of batches already served.

        Example:
            >>> import numpy as np
            >>> from needle.data import DataLoader, NDArrayDataset
            >>> dl = DataLoader(NDArrayDataset(np.zeros((6, 1))), 2, shuffle=True)
            >>> it = iter(dl); _ = next(it); dl.state_dict()["batch_index"]
            1
        """
        order = np.concatenate(self.ordering) if self.ordering else np.zeros(0, np.int64)
        return {"order": order.astype(np.int64), "batch_index": self._batch_index,
                "batch_size": self.batch_size, "in_pass": self._started,
                "passes": self._passes}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position: the next ``iter()`` continues that pass where it stopped.

        Raises:
            ShapeError: when the saved order does not cover this dataset.
        """
        order = np.asarray(state["order"], dtype=np.int64)
        if order.shape != (self._num_indices(),):
            raise ShapeError(
                f"DataLoader.load_state_dict: order must cover the dataset (or the sampler), "
                f"expected shape ({self._num_indices()},), got {order.shape}")
        self.batch_size = int(state.get("batch_size", self.batch_size))
        self.ordering = _split_batches(order, self.batch_size)
        self._batch_index = int(state["batch_index"])
        self._started = bool(state.get("in_pass", True))
        self._resume_pending = self._started
        self._passes = int(state.get("passes", self._passes))
        if self._pool is not None:
            self._pool.restart_at(self._batch_index)
