"""The main job's data: the embedded digits, MNIST from IDX files, and the batch order.

The order of examples is a pure function of ``(seed, epoch)``: it is the permutation of
``needle.data.DistributedSampler`` (its own generator, so it does not move with dropout or
initialisation draws, and every rank computes the same one). The loop cuts it into global
batches of ``--batch-size`` examples, and each data-parallel replica keeps the examples at
positions ``index, index + replicas, ...`` of each global batch: the sampler's own way of
dealing examples out in turn, applied per step and without padding, so that one replica sees
exactly the batches a single process would and the replicas of a step together hold that
step's global batch, whatever the batch size.
"""
from __future__ import annotations

import os

import numpy as np

from .config import UsageError


def _holdout(X, y, fraction: float, seed: int):
    order = np.random.RandomState(seed).permutation(X.shape[0])  # own stream: leaves init alone
    n_test = int(round(X.shape[0] * fraction))
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]


def load_digits_split(seed: int = 0, fraction: float = 0.2):
    """scikit-learn's digits as float32 in [0, 1] (64 features) with a seeded hold-out."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    return _holdout(X, digits.target.astype(np.uint8), fraction, seed)


def load_mnist_split(data_dir: str, seed: int = 0):
    """MNIST train/t10k from ``data_dir``; with only the t10k files, 20% of t10k is held out."""
    from needle.data import parse_mnist

    path = {(part, kind): os.path.join(data_dir, f"{part}-{kind}-idx{n}-ubyte.gz")
            for part in ("train", "t10k") for kind, n in (("images", 3), ("labels", 1))}
    have = {part: all(os.path.exists(path[(part, k)]) for k in ("images", "labels"))
            for part in ("train", "t10k")}
    if have["train"] and have["t10k"]:
        X, y = parse_mnist(path[("train", "images")], path[("train", "labels")])
        Xt, yt = parse_mnist(path[("t10k", "images")], path[("t10k", "labels")])
        return X, y, Xt, yt
    if have["t10k"]:
        X, y = parse_mnist(path[("t10k", "images")], path[("t10k", "labels")])
        return _holdout(X, y, 0.2, seed)
    raise UsageError(f"no MNIST files in {data_dir}: expected t10k-images-idx3-ubyte.gz and "
                     f"t10k-labels-idx1-ubyte.gz (and the train-* pair)")


def load_data(cfg):
    """(X, y, X_test, y_test) as NumPy arrays for ``cfg.data``."""
    if cfg.data == "digits":
        return load_digits_split(cfg.seed)
    return load_mnist_split(cfg.data_dir, cfg.seed)


class _Indices:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of ``n`` training examples used in ``epoch`` (1-based) of a run."""
    from needle.data import DistributedSampler

    sampler = DistributedSampler(_Indices(n), num_replicas=1, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return sampler.permutation()


def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The index arrays of every optimizer step of ``epoch`` (the last may be shorter)."""
    order = epoch_order(n, seed, epoch)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def replica_share(indices: np.ndarray, replicas: int, index: int) -> np.ndarray:
    """The examples of one global batch that replica ``index`` of ``replicas`` computes."""
    return indices[index::replicas]


def steps_per_epoch(n: int, batch_size: int) -> int:
    return -(-n // batch_size)
