"""The course's hw2 MLP-ResNet on MNIST.

Example:
    >>> import numpy as np
    >>> np.random.seed(0); model = MLPResNet(64, hidden_dim=32, num_blocks=2)
    >>> len(model.parameters())
    20
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
import needle.data  # noqa: E402,F401 - ndl.data even before needle/__init__ imports it
import needle.nn as nn  # noqa: E402
import needle.optim  # noqa: E402,F401

__all__ = ["ResidualBlock", "MLPResNet", "epoch", "train_mnist"]


def _placement(device, dtype):
    """Keyword arguments that put a layer on ``device`` in ``dtype``; none when both are unset,
    so the course's calls build exactly the layers they always did."""
    kw = {}
    if device is not None:
        kw["device"] = device
    if dtype is not None:
        kw["dtype"] = dtype
    return kw


def ResidualBlock(dim, hidden_dim, norm=nn.BatchNorm1d, drop_prob=0.1, *,  # noqa: N802
                  device=None, dtype=None):
    """Residual(Linear → norm → ReLU → Dropout → Linear → norm) → ReLU.

    ``device`` and ``dtype`` (optional) go to every Linear and norm layer; ``norm`` must then
    accept them as keywords, as needle's BatchNorm1d and LayerNorm1d do.
    """
    kw = _placement(device, dtype)
    return nn.Sequential(
        nn.Residual(nn.Sequential(nn.Linear(dim, hidden_dim, **kw), norm(hidden_dim, **kw),
                                  nn.ReLU(), nn.Dropout(drop_prob),
                                  nn.Linear(hidden_dim, dim, **kw), norm(dim, **kw))),
        nn.ReLU())


def MLPResNet(dim, hidden_dim=100, num_blocks=3, num_classes=10, norm=nn.BatchNorm1d,  # noqa: N802
              drop_prob=0.1, *, device=None, dtype=None):
    """Linear → ReLU → ``num_blocks`` residual blocks (hidden//2 inside) → Linear.

    The one MLP-ResNet builder of the repository: apps/training (``--model mlp_resnet``),
    apps/memory_report.py and the tests build theirs here. Parameters are created in the
    course's order (stem, each block's two Linear and norm layers, head), so a seed gives the
    same initial values whichever caller builds it. ``device`` / ``dtype``: see ResidualBlock.
    """
    kw = _placement(device, dtype)
    return nn.Sequential(
        nn.Linear(dim, hidden_dim, **kw), nn.ReLU(),
        *[ResidualBlock(hidden_dim, hidden_dim // 2, norm, drop_prob, device=device, dtype=dtype)
          for _ in range(num_blocks)],
        nn.Linear(hidden_dim, num_classes, **kw))


def epoch(dataloader, model, opt=None):
    """One pass: train when ``opt`` is given, else evaluate.

    Returns:
        (error rate over the dataset, mean loss weighted by batch size)
    """
    np.random.seed(4)
    model.train() if opt is not None else model.eval()
    loss_fn = nn.SoftmaxLoss()
    errors, total_loss, count = 0.0, 0.0, 0
    for X, y in dataloader:
        logits = model(X)
        loss = loss_fn(logits, y)
        if opt is not None:
            opt.reset_grad()
            loss.backward()
            opt.step()
        labels = y.numpy()
        errors += float((logits.numpy().argmax(axis=1) != labels).sum())
        total_loss += float(loss.numpy()) * labels.shape[0]
        count += labels.shape[0]
    return errors / count, total_loss / count


def train_mnist(batch_size=100, epochs=10, optimizer=ndl.optim.Adam, lr=0.001,
                weight_decay=0.001, hidden_dim=100, data_dir="data"):
    """Train on MNIST train, then evaluate once on t10k.

    Returns:
        (train error, train loss, test error, test loss) of the last epochs.
    """
    np.random.seed(4)
    train_set = ndl.data.MNISTDataset(os.path.join(data_dir, "train-images-idx3-ubyte.gz"),
                                      os.path.join(data_dir, "train-labels-idx1-ubyte.gz"))
    test_set = ndl.data.MNISTDataset(os.path.join(data_dir, "t10k-images-idx3-ubyte.gz"),
                                     os.path.join(data_dir, "t10k-labels-idx1-ubyte.gz"))
    train_loader = ndl.data.DataLoader(train_set, batch_size, shuffle=True)
    test_loader = ndl.data.DataLoader(test_set, batch_size)
    model = MLPResNet(784, hidden_dim)
    opt = optimizer(model.parameters(), lr=lr, weight_decay=weight_decay)
    train_err, train_loss = 0.0, 0.0
    for _ in range(epochs):
        train_err, train_loss = epoch(train_loader, model, opt)
    test_err, test_loss = epoch(test_loader, model)
    return train_err, train_loss, test_err, test_loss
