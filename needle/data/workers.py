"""Worker processes that fetch a DataLoader's batches (``num_workers > 0``).

The loader keeps every decision in its own process: the pass's order (its one permutation),
which batch comes next, and the resume position. Workers only run ``dataset[indices]`` (or
``collate_fn`` over the items) for index arrays the loader hands them, and their results are
served strictly in submission order, so the batches and their order are those of
``num_workers=0``, and ``state_dict()`` counts the batches *served*, never those fetched
ahead.

Random transforms in a worker draw from NumPy's generator of that worker, seeded per batch
from (pass, batch index): the same numbers on every run and after a resume, though not the
draws the main process would have made (which would have moved its own generator).

Workers are started with ``spawn`` (a fresh interpreter: safe beside the backend's threads),
receive the dataset once, and live until :meth:`WorkerPool.close` or the loader's end.
"""
from __future__ import annotations

import collections
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import numpy as np

__all__ = ["WorkerPool", "fetch"]

_DATASET = None
_COLLATE = None


def fetch(dataset, collate_fn, indices: np.ndarray) -> tuple:
    """One batch: ``collate_fn([dataset[i] for i in indices])``, else ``dataset[indices]``
    (item by item and stacked for a dataset that takes integer indices only); a tuple."""
    if collate_fn is not None:
        batch = collate_fn([dataset[int(i)] for i in indices])
        return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    try:
        batch = dataset[indices]
    except (TypeError, IndexError, ValueError):
        items = [dataset[int(i)] for i in indices]
        items = [it if isinstance(it, tuple) else (it,) for it in items]
        return tuple(np.stack([np.asarray(it[k]) for it in items])
                     for k in range(len(items[0])))
    return batch if isinstance(batch, tuple) else (batch,)


def _start(dataset, collate_fn) -> None:
    global _DATASET, _COLLATE
    _DATASET, _COLLATE = dataset, collate_fn


def _fetch_in_worker(indices: np.ndarray, seed: tuple) -> tuple:
    np.random.seed(np.random.SeedSequence(seed).generate_state(1)[0])
    return tuple(np.asarray(a) for a in fetch(_DATASET, _COLLATE, indices))


class WorkerPool:
    """``num_workers`` processes fetching batches ahead, ``2 * num_workers`` in flight."""

    def __init__(self, dataset, collate_fn, num_workers: int):
        self.ahead = 2 * num_workers
        self.pool = ProcessPoolExecutor(num_workers, multiprocessing.get_context("spawn"),
                                        initializer=_start, initargs=(dataset, collate_fn))
        self.pending: collections.deque = collections.deque()
        self.next_submit = 0  # index of the next batch to hand to a worker

    def restart_at(self, batch_index: int) -> None:
        """Forget batches fetched ahead (a new pass, a loaded position)."""
        for future in self.pending:
            future.cancel()
        self.pending.clear()
        self.next_submit = batch_index

    def get(self, ordering: list, batch_index: int, passes: int) -> tuple:
        """Batch ``batch_index`` of ``ordering``, after topping up the batches in flight."""
        if self.next_submit != batch_index + len(self.pending):
            self.restart_at(batch_index)
        while len(self.pending) < self.ahead and self.next_submit < len(ordering):
            self.pending.append(self.pool.submit(_fetch_in_worker, ordering[self.next_submit],
                                                 (passes, self.next_submit)))
            self.next_submit += 1
        return self.pending.popleft().result()

    def close(self) -> None:
        self.restart_at(0)
        self.pool.shutdown(wait=True, cancel_futures=True)
