"""Penn Treebank language-model data: vocabulary, tokenised corpus, batching helpers.

Example:
    >>> import numpy as np
    >>> from needle.data import batchify
    >>> batchify(list(range(7)), 2, device=None, dtype="float32").tolist()
    [[0, 3], [1, 4], [2, 5]]
"""
from __future__ import annotations

import os

import numpy as np

from ... import backend_ndarray as nd  # noqa: F401 - the course module imports it here too
from ..._core.errors import NeedleError, ShapeError
from ...autograd import Tensor

__all__ = ["Dictionary", "Corpus", "batchify", "get_batch"]

EOS = "<eos>"


class Dictionary:
    """Word ↔ id maps; ids are handed out 0, 1, 2, … in order of first appearance."""

    def __init__(self):
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        """The id of ``word``, adding it first if new."""
        idx = self.word2idx.get(word)
        if idx is None:
            idx = self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return idx

    def __len__(self) -> int:
        return len(self.idx2word)


class Corpus:
    """Token ids of ``base_dir/train.txt`` and ``base_dir/test.txt`` over one dictionary.

    Raises:
        NeedleError: when a file is missing.
    """

    def __init__(self, base_dir: str, max_lines: int | None = None):
        self.dictionary = Dictionary()
        self.train = self.tokenize(os.path.join(base_dir, "train.txt"), max_lines)
        self.test = self.tokenize(os.path.join(base_dir, "test.txt"), max_lines)

    def tokenize(self, path: str, max_lines: int | None = None) -> list[int]:
        """Ids of the words of the first ``max_lines`` lines, each line ending in ``<eos>``."""
        if not os.path.exists(path):
            raise NeedleError(f"Corpus.tokenize: file not found, expected a text file, got "
                              f"{path!r}")
        ids: list[int] = []
        with open(path, encoding="utf-8") as f:
            for count, line in enumerate(f):
                if max_lines is not None and count >= max_lines:
                    break
                ids.extend(self.dictionary.add_word(w) for w in line.split() + [EOS])
        return ids


def batchify(data, batch_size: int, device=None, dtype=None) -> np.ndarray:
    """Cut the id stream into ``batch_size`` contiguous columns: shape (nbatch, batch_size).

    Trailing ids that do not fill a full row are dropped; column j is the j-th chunk.
    """
    data = np.asarray(data)
    nbatch = data.shape[0] // batch_size
    if nbatch == 0:
        raise ShapeError(f"batchify: not enough tokens, expected at least {batch_size}, got "
                         f"{data.shape[0]}")
    return data[:nbatch * batch_size].reshape(batch_size, nbatch).T.copy()


def get_batch(batches: np.ndarray, i: int, bptt: int, device=None, dtype=None):
    """Inputs rows ``i..i+seq`` (seq, bs) and next-token targets flattened to (seq·bs,).

    ``seq = min(bptt, len(batches) - 1 - i)``.
    """
    seq = min(bptt, len(batches) - 1 - i)
    if seq <= 0:
        raise ShapeError(f"get_batch: start row out of range, expected i < {len(batches) - 1}, "
                         f"got {i}")
    data = batches[i:i + seq]
    target = batches[i + 1:i + 1 + seq].reshape(-1)
    return (Tensor(data, device=device, dtype=dtype, requires_grad=False),
            Tensor(target, device=device, dtype=dtype, requires_grad=False))
