"""Datasets: MNIST on the shared t10k files, synthetic CIFAR-10 pickles, a tiny PTB corpus."""
from __future__ import annotations

import gzip
import os
import pickle

import numpy as np
import pytest

from needle._core.errors import NeedleError, ShapeError
from needle.data import (
    CIFAR10Dataset,
    Corpus,
    Dictionary,
    MNISTDataset,
    NDArrayDataset,
    RandomFlipHorizontal,
    batchify,
    get_batch,
)
from needle.data.datasets.mnist_dataset import parse_mnist

MNIST_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "mnist")
IMAGES = os.path.join(MNIST_DIR, "t10k-images-idx3-ubyte.gz")
LABELS = os.path.join(MNIST_DIR, "t10k-labels-idx1-ubyte.gz")
needs_mnist = pytest.mark.skipif(not os.path.exists(IMAGES), reason="MNIST t10k files absent")


def _reference_mnist():
    # Independent decoding: header fields at fixed offsets, payload after 16 / 8 bytes.
    with gzip.open(IMAGES, "rb") as f:
        raw = f.read()
    n, rows, cols = (int.from_bytes(raw[k:k + 4], "big") for k in (4, 8, 12))
    X = np.frombuffer(raw[16:], dtype=np.uint8).reshape(n, rows * cols)
    with gzip.open(LABELS, "rb") as f:
        y = np.frombuffer(f.read()[8:], dtype=np.uint8)
    return X, y


@needs_mnist
def test_mnist_t10k_parsing():
    X_ref, y_ref = _reference_mnist()
    ds = MNISTDataset(IMAGES, LABELS)
    assert len(ds) == 10000 and ds.X.shape == (10000, 784)
    assert ds.X.dtype == np.float32 and ds.y.dtype == np.uint8
    assert 0.0 <= ds.X.min() and ds.X.max() <= 1.0 and ds.X.max() == 1.0
    np.testing.assert_allclose(ds.X, X_ref / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(np.bincount(ds.y, minlength=10),
                                  np.bincount(y_ref, minlength=10))
    assert np.bincount(ds.y).sum() == 10000 and set(np.unique(ds.y)) == set(range(10))
    X, y = ds[np.array([3, 1, 4])]
    np.testing.assert_array_equal(y, y_ref[[3, 1, 4]])
    assert X.shape == (3, 784)


@needs_mnist
def test_mnist_transforms_apply_per_image():
    ds = MNISTDataset(IMAGES, LABELS, transforms=[RandomFlipHorizontal(p=1.0)])
    plain = MNISTDataset(IMAGES, LABELS)
    x, _ = ds[5]
    np.testing.assert_array_equal(x, plain.X[5].reshape(28, 28)[:, ::-1].reshape(-1))
    xs, _ = ds[np.array([0, 5])]
    np.testing.assert_array_equal(xs[1], x)


def test_mnist_bad_magic_and_missing(tmp_path):
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wb") as f:
        f.write((1234).to_bytes(4, "big") + b"\0" * 8)
    with pytest.raises(NeedleError, match="magic"):
        parse_mnist(str(bad), str(bad))
    with pytest.raises(NeedleError, match="not found"):
        parse_mnist(str(tmp_path / "none.gz"), str(bad))


def test_ndarray_dataset():
    a, b = np.arange(12).reshape(6, 2), np.arange(6) * 10
    ds = NDArrayDataset(a, b)
    assert len(ds) == 6
    xa, xb = ds[np.array([5, 0])]
    np.testing.assert_array_equal(xa, a[[5, 0]])
    np.testing.assert_array_equal(xb, [50, 0])
    with pytest.raises(ShapeError):
        NDArrayDataset(a, np.arange(5))


def _write_cifar(folder, names, rng):
    truth = {}
    for name in names:
        data = rng.integers(0, 256, size=(7, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=7)]  # Python ints, as the real files
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels}, f)
        truth[name] = (data, labels)
    return truth


def test_cifar10_synthetic(tmp_path):
    rng = np.random.default_rng(0)
    names = [f"data_batch_{k}" for k in range(1, 6)]
    truth = _write_cifar(tmp_path, names + ["test_batch"], rng)
    train = CIFAR10Dataset(str(tmp_path), train=True)
    test = CIFAR10Dataset(str(tmp_path), train=False)
    assert len(train) == 35 and len(test) == 7
    x, y = train[8]  # second image of data_batch_2
    data, labels = truth["data_batch_2"]
    assert x.shape == (3, 32, 32) and x.dtype == np.float32
    # Channel c of pixel (r, col) sits at c*1024 + r*32 + col in the flat CIFAR row.
    assert x[2, 5, 7] == pytest.approx(data[1, 2 * 1024 + 5 * 32 + 7] / 255.0)
    assert y == labels[1]
    flipped = CIFAR10Dataset(str(tmp_path), train=False,
                             transforms=[RandomFlipHorizontal(p=1.0)])
    np.testing.assert_array_equal(flipped[0][0], test[0][0][:, :, ::-1])


def test_cifar10_missing_files(tmp_path):
    with pytest.raises(NeedleError, match="missing"):
        CIFAR10Dataset(str(tmp_path), train=True)


def test_ptb_dictionary_corpus_batchify(tmp_path):
    (tmp_path / "train.txt").write_text("the cat sat\nthe dog ran far\nlast line\n")
    (tmp_path / "test.txt").write_text("a cat ran\n")
    d = Dictionary()
    assert [d.add_word(w) for w in ["x", "y", "x"]] == [0, 1, 0] and len(d) == 2
    corpus = Corpus(str(tmp_path), max_lines=2)
    words = "the cat sat <eos> the dog ran far <eos>".split()
    assert [corpus.dictionary.idx2word[i] for i in corpus.train] == words
    assert [corpus.dictionary.idx2word[i] for i in corpus.test] == "a cat ran <eos>".split()
    assert len(corpus.dictionary) == len(set(words + ["a"]))
    data = np.arange(23)
    b = batchify(data, 4, device=None, dtype="float32")
    assert b.shape == (5, 4)
    for j in range(4):  # column j is the j-th contiguous chunk of 5 tokens
        np.testing.assert_array_equal(b[:, j], data[j * 5:(j + 1) * 5])


def test_ptb_get_batch():
    batches = np.arange(30).reshape(10, 3)
    X, y = get_batch(batches, 2, 4)
    np.testing.assert_array_equal(X.numpy(), batches[2:6])
    np.testing.assert_array_equal(y.numpy(), batches[3:7].reshape(-1))
    X, y = get_batch(batches, 7, 4)  # near the end: seq = min(bptt, len - 1 - i) = 2
    assert X.shape == (2, 3) and y.shape == (6,)
    np.testing.assert_array_equal(y.numpy(), batches[8:10].reshape(-1))
