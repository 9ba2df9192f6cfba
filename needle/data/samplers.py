"""Samplers: which dataset indices a DataLoader visits, in which order.

``DistributedSampler`` gives each of ``num_replicas`` data-parallel ranks its own share of a
dataset. Every rank must cut the *same* permutation, so the permutation is drawn from the
sampler's own generator, seeded by ``(seed, epoch)`` (NumPy's PCG64 through a SeedSequence):
it never touches ``np.random``'s global stream (which decides weight init, dropout and the
course's goldens) and does not depend on how many numbers each rank drew before.

Example:
    >>> import numpy as np
    >>> from needle.data import DataLoader, DistributedSampler, NDArrayDataset
    >>> ds = NDArrayDataset(np.arange(10.0).reshape(10, 1))
    >>> shards = [list(DistributedSampler(ds, num_replicas=2, rank=r, shuffle=False))
    ...           for r in range(2)]
    >>> shards
    [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    >>> s = DistributedSampler(ds, num_replicas=2, rank=0, seed=3)
    >>> s.set_epoch(1)
    >>> loader = DataLoader(ds, 5, sampler=s)
    >>> sorted(int(v) for v in next(iter(loader))[0].numpy().ravel()) == sorted(s)
    True
"""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from .._core.errors import IndexOutOfRange, NeedleError

__all__ = ["DistributedSampler"]


def _from_env(names: tuple[str, ...], default: int) -> int:
    for name in names:
        if os.environ.get(name, "").lstrip("-").isdigit():
            return int(os.environ[name])
    return default


class DistributedSampler:
    """This rank's share of ``dataset``: every ``num_replicas``-th index of one permutation.

    Args:
        dataset: anything with ``len()``.
        num_replicas: ranks sharing the data; default ``WORLD_SIZE`` from the environment
            (needle's launcher and ``init_process_group`` set it under every backend), else 1.
        rank: this rank; default ``RANK`` from the environment, else 0.
        shuffle: a new permutation each epoch (call :meth:`set_epoch`); else index order.
        seed: seeds the permutation together with the epoch; every rank must pass the same.
        drop_last: drop the tail that does not divide evenly (ranks get ``len // num_replicas``
            each, all distinct); otherwise pad by repeating indices from the start of the
            permutation so that every rank gets ``ceil(len / num_replicas)``.

    Raises:
        NeedleError: ``num_replicas`` below 1 or a negative seed.
        IndexOutOfRange: ``rank`` outside ``[0, num_replicas)``.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if num_replicas is None:
            num_replicas = _from_env(("WORLD_SIZE", "PMI_SIZE"), 1)
        if rank is None:
            rank = _from_env(("RANK", "PMI_RANK"), 0)
        if int(num_replicas) < 1:
            raise NeedleError(f"DistributedSampler: num_replicas must be positive, expected "
                              f">= 1, got {num_replicas}")
        if not 0 <= int(rank) < int(num_replicas):
            raise IndexOutOfRange(f"DistributedSampler: rank out of range, expected 0 <= rank "
                                  f"< {num_replicas}, got {rank}")
        if int(seed) < 0:
            raise NeedleError(f"DistributedSampler: seed must be >= 0, got {seed}")
        self.dataset = dataset
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.epoch = 0
        n = len(dataset)
        self.num_samples = n // self.num_replicas if drop_last else -(-n // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (call it on every rank before each epoch)."""
        self.epoch = int(epoch)

    def permutation(self) -> np.ndarray:
        """The whole epoch's order, padded or cut to ``total_size``, before sharding."""
        n = len(self.dataset)
        if self.shuffle:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
                [self.seed, self.epoch])))
            order = rng.permutation(n)
        else:
            order = np.arange(n)
        if self.total_size <= n:
            return order[:self.total_size]
        return np.resize(order, self.total_size)  # repeats from the start

    def __iter__(self) -> Iterator[int]:
        return iter(self.permutation()[self.rank::self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples
