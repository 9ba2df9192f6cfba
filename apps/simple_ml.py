"""The course's simple_ml helpers (hw1 ∪ hw4): MNIST parsing, a two-layer net trained by
hand, and the CIFAR-10 / Penn Treebank training loops.

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> Z = Tensor(np.zeros((2, 3), dtype="float32"))
    >>> y = Tensor(np.eye(3, dtype="float32")[[0, 2]])
    >>> round(float(softmax_loss(Z, y).numpy()), 4) == round(float(np.log(3)), 4)
    True
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "python")):  # run from this repo or a course root
    if os.path.isdir(os.path.join(_p, "needle")) and _p not in sys.path:
        sys.path.append(_p)

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
import needle.data  # noqa: E402,F401
import needle.nn as nn  # noqa: E402
import needle.optim  # noqa: E402,F401
from needle import ops  # noqa: E402
from needle.autograd import Tensor  # noqa: E402
from needle.data import get_batch  # noqa: E402
from needle.data.datasets.mnist_dataset import parse_mnist as _parse_mnist  # noqa: E402

try:
    from apps.models import *  # noqa: E402,F401,F403 - the course's hw4 layout
except ImportError:  # run with apps/ itself on sys.path
    from models import *  # noqa: E402,F401,F403

device = ndl.backend_selection.default_device()

__all__ = ["parse_mnist", "softmax_loss", "nn_epoch", "loss_err", "epoch_general_cifar10",
           "train_cifar10", "evaluate_cifar10", "epoch_general_ptb", "train_ptb",
           "evaluate_ptb", "device"]


def parse_mnist(image_filename, label_filename):
    """MNIST IDX (gzip) → (X float32 (N, 784) in [0, 1], y uint8 (N,))."""
    return _parse_mnist(image_filename, label_filename)


def softmax_loss(Z, y_one_hot):
    """Mean over the batch of ``log Σ exp Z − Σ Z·y`` (Z logits, y one-hot), a scalar Tensor."""
    lse = ops.log(ops.summation(ops.exp(Z), axes=(1,)))
    return (ops.summation(lse) - ops.summation(Z * y_one_hot)) / Z.shape[0]


def _one_hot(y: np.ndarray, k: int, dtype) -> np.ndarray:
    out = np.zeros((y.shape[0], k), dtype=dtype)
    out[np.arange(y.shape[0]), y.astype(np.int64)] = 1
    return out


def nn_epoch(X, y, W1, W2, lr=0.1, batch=100):
    """One SGD epoch of ``relu(X W1) W2`` over in-order minibatches.

    Returns new Tensors ``(W1, W2)`` (``W ← W − lr·∇W`` per batch).
    """
    k = W2.shape[1]
    for start in range(0, X.shape[0], batch):
        Xb = Tensor(X[start:start + batch], device=W1.device, dtype=W1.dtype,
                        requires_grad=False)
        yb = Tensor(_one_hot(y[start:start + batch], k, "float32"), device=W1.device,
                        dtype=W1.dtype, requires_grad=False)
        W1 = Tensor(W1.numpy(), device=W1.device, dtype=W1.dtype, requires_grad=True)
        W2 = Tensor(W2.numpy(), device=W2.device, dtype=W2.dtype, requires_grad=True)
        loss = softmax_loss(ops.relu(Xb @ W1) @ W2, yb)
        loss.backward()
        W1 = Tensor(W1.numpy() - lr * W1.grad.numpy(), device=W1.device, dtype=W1.dtype)
        W2 = Tensor(W2.numpy() - lr * W2.grad.numpy(), device=W2.device, dtype=W2.dtype)
    return W1, W2


def loss_err(h, y):
    """(softmax loss, error rate) of logits ``h`` against integer labels ``y`` (NumPy)."""
    y_one_hot = Tensor(_one_hot(y, h.shape[-1], "float32"), device=h.device,
                           dtype=h.dtype, requires_grad=False)
    return softmax_loss(h, y_one_hot).numpy(), np.mean(h.numpy().argmax(axis=1) != y)


def _accuracy_and_loss(logits, y, loss) -> tuple[float, float, int]:
    labels = y.numpy().astype(np.int64)
    correct = float((logits.numpy().argmax(axis=1) == labels).sum())
    return correct, float(loss.numpy()) * labels.shape[0], labels.shape[0]


def epoch_general_cifar10(dataloader, model, loss_fn=nn.SoftmaxLoss(), opt=None):  # noqa: B008
    """One pass over ``dataloader`` (train iff ``opt``); returns (avg accuracy, avg loss)."""
    np.random.seed(4)
    model.train() if opt is not None else model.eval()
    correct, total_loss, count = 0.0, 0.0, 0
    for X, y in dataloader:
        logits = model(X)
        loss = loss_fn(logits, y)
        if opt is not None:
            opt.reset_grad()
            loss.backward()
            opt.step()
        c, t, n = _accuracy_and_loss(logits, y, loss)
        correct, total_loss, count = correct + c, total_loss + t, count + n
    return correct / count, total_loss / count


def train_cifar10(model, dataloader, n_epochs=1, optimizer=ndl.optim.Adam, lr=0.001,
                  weight_decay=0.001, loss_fn=nn.SoftmaxLoss):
    """Train for ``n_epochs``; returns the last epoch's (avg accuracy, avg loss)."""
    np.random.seed(4)
    opt = optimizer(model.parameters(), lr=lr, weight_decay=weight_decay)
    acc, loss = 0.0, 0.0
    for _ in range(n_epochs):
        acc, loss = epoch_general_cifar10(dataloader, model, loss_fn(), opt)
    return acc, loss


def evaluate_cifar10(model, dataloader, loss_fn=nn.SoftmaxLoss):
    """One evaluation pass; returns (avg accuracy, avg loss)."""
    np.random.seed(4)
    return epoch_general_cifar10(dataloader, model, loss_fn(), None)


def _detach_state(h):
    if h is None:
        return None
    if isinstance(h, (tuple, list)):
        return tuple(x.detach() for x in h)
    return h.detach()


def epoch_general_ptb(data, model, seq_len=40, loss_fn=nn.SoftmaxLoss(), opt=None,  # noqa: B008
                      clip=None, device=None, dtype="float32"):
    """One pass over batchified ``data`` in windows of ``seq_len`` (hidden state carried,
    detached, across windows); returns (avg accuracy, avg loss) per token."""
    np.random.seed(4)
    model.train() if opt is not None else model.eval()
    correct, total_loss, count = 0.0, 0.0, 0
    h = None
    for i in range(0, data.shape[0] - 1, seq_len):
        X, y = get_batch(data, i, seq_len, device=device, dtype=dtype)
        logits, h = model(X, h)
        h = _detach_state(h)
        loss = loss_fn(logits, y)
        if opt is not None:
            opt.reset_grad()
            loss.backward()
            if clip is not None:
                opt.clip_grad_norm(clip)
            opt.step()
        c, t, n = _accuracy_and_loss(logits, y, loss)
        correct, total_loss, count = correct + c, total_loss + t, count + n
    return correct / count, total_loss / count


def train_ptb(model, data, seq_len=40, n_epochs=1, optimizer=ndl.optim.SGD, lr=4.0,
              weight_decay=0.0, loss_fn=nn.SoftmaxLoss, clip=None, device=None,
              dtype="float32"):
    """Train a language model; returns the last epoch's (avg accuracy, avg loss)."""
    np.random.seed(4)
    opt = optimizer(model.parameters(), lr=lr, weight_decay=weight_decay)
    acc, loss = 0.0, 0.0
    for _ in range(n_epochs):
        acc, loss = epoch_general_ptb(data, model, seq_len, loss_fn(), opt, clip, device,
                                      dtype)
    return acc, loss


def evaluate_ptb(model, data, seq_len=40, loss_fn=nn.SoftmaxLoss, device=None,
                 dtype="float32"):
    """One evaluation pass of a language model; returns (avg accuracy, avg loss)."""
    np.random.seed(4)
    return epoch_general_ptb(data, model, seq_len, loss_fn(), None, None, device, dtype)
