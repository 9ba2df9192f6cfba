"""Models of the course's hw4: ResNet9 (CIFAR-10) and a recurrent LanguageModel.

Example:
    >>> import numpy as np
    >>> np.random.seed(0); model = ResNet9()
    >>> int(sum(np.prod(p.shape) for p in model.parameters()))
    431946
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "python")):  # run from this repo or a course root
    if os.path.isdir(os.path.join(_p, "needle")) and _p not in sys.path:
        sys.path.append(_p)

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402,F401
import needle.data  # noqa: E402,F401 - ndl.data even before needle/__init__ imports it
import needle.nn as nn  # noqa: E402
import needle.optim  # noqa: E402,F401
from needle import NeedleError, ops  # noqa: E402

__all__ = ["ConvBN", "ResNet9", "LanguageModel"]

np.random.seed(0)  # the course file seeds at import; kept for identical goldens


def ConvBN(a, b, k, s, device=None, dtype="float32"):  # noqa: N802 - the course's name
    """Conv(a→b, kernel k, stride s) → BatchNorm2d(b) → ReLU."""
    return nn.Sequential(nn.Conv(a, b, k, stride=s, device=device, dtype=dtype),
                         nn.BatchNorm2d(b, device=device, dtype=dtype), nn.ReLU())


class ResNet9(nn.Module):
    """ResNet9 for 3×32×32 images, 10 classes, 431,946 parameters (built in RNG order)."""

    def __init__(self, device=None, dtype="float32"):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.model = nn.Sequential(
            ConvBN(3, 16, 7, 4, **kw),
            ConvBN(16, 32, 3, 2, **kw),
            nn.Residual(nn.Sequential(ConvBN(32, 32, 3, 1, **kw), ConvBN(32, 32, 3, 1, **kw))),
            ConvBN(32, 64, 3, 2, **kw),
            ConvBN(64, 128, 3, 2, **kw),
            nn.Residual(nn.Sequential(ConvBN(128, 128, 3, 1, **kw),
                                      ConvBN(128, 128, 3, 1, **kw))),
            nn.Flatten(),
            nn.Linear(128, 128, **kw),
            nn.ReLU(),
            nn.Linear(128, 10, **kw),
        )

    def forward(self, x):
        return self.model(x)


class LanguageModel(nn.Module):
    """Embedding → RNN/LSTM → Linear over the vocabulary.

    ``forward(x (T, B) ids, h=None)`` → ``(logits (T·B, output_size), h)``; ``h`` is a Tensor
    for ``seq_model='rnn'`` and an ``(h, c)`` pair for ``'lstm'``.
    """

    def __init__(self, embedding_size, output_size, hidden_size, num_layers=1,
                 seq_model="rnn", seq_len=40, device=None, dtype="float32"):
        super().__init__()
        if seq_model not in ("rnn", "lstm"):
            raise NeedleError(
                f"LanguageModel: unknown seq_model, expected 'rnn' or 'lstm', got {seq_model!r}")
        self.embedding_size, self.output_size = embedding_size, output_size
        self.hidden_size, self.seq_len = hidden_size, seq_len
        self.embedding = nn.Embedding(output_size, embedding_size, device=device, dtype=dtype)
        cls = nn.RNN if seq_model == "rnn" else nn.LSTM
        self.seq_model = cls(embedding_size, hidden_size, num_layers, device=device,
                             dtype=dtype)
        self.linear = nn.Linear(hidden_size, output_size, device=device, dtype=dtype)

    def forward(self, x, h=None):
        seq_len, batch = x.shape
        out, h = self.seq_model(self.embedding(x), h)
        logits = self.linear(ops.reshape(out, (seq_len * batch, self.hidden_size)))
        return logits, h
