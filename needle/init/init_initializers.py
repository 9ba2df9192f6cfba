"""Xavier (Glorot) and Kaiming (He) initialisers with the course's formulas.

Xavier scales by ``fan_in + fan_out`` and a ``gain`` argument (default 1); Kaiming scales by
``fan_in`` with the gain of ``nonlinearity`` (√2 for ``"relu"``). Each function's docstring
gives its formula; each makes exactly one draw of the full shape.

Example:
    >>> import numpy as np
    >>> from needle import init
    >>> np.random.seed(1); w = init.kaiming_uniform(6, 4).numpy()
    >>> w.shape, bool(np.abs(w).max() <= 1.0)
    ((6, 4), True)
"""
from __future__ import annotations

import math

from .._core.errors import NeedleError
from .init_basic import rand, randn

__all__ = ["xavier_uniform", "xavier_normal", "kaiming_uniform", "kaiming_normal"]

_GAINS = {"relu": math.sqrt(2.0), "linear": 1.0, "tanh": 5.0 / 3.0, "sigmoid": 1.0}


def _gain(nonlinearity: str) -> float:
    if nonlinearity not in _GAINS:
        raise NeedleError(f"kaiming: unknown nonlinearity, expected one of {sorted(_GAINS)}, "
                          f"got {nonlinearity!r}")
    return _GAINS[nonlinearity]


def _shape(fan_in, fan_out, shape) -> tuple:
    return (fan_in, fan_out) if shape is None else tuple(shape)


def xavier_uniform(fan_in, fan_out, gain=1.0, shape=None, **kwargs):
    """U(-a, a) with ``a = gain * sqrt(6 / (fan_in + fan_out))``, shape (fan_in, fan_out)."""
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return rand(*_shape(fan_in, fan_out, shape), low=-a, high=a, **kwargs)


def xavier_normal(fan_in, fan_out, gain=1.0, shape=None, **kwargs):
    """N(0, std²) with ``std = gain * sqrt(2 / (fan_in + fan_out))``."""
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    return randn(*_shape(fan_in, fan_out, shape), mean=0.0, std=std, **kwargs)


def kaiming_uniform(fan_in, fan_out, shape=None, nonlinearity="relu", **kwargs):
    """U(-b, b) with ``b = gain * sqrt(3 / fan_in)`` (gain √2 for relu, so b = √(6/fan_in)).

    ``shape`` overrides the (fan_in, fan_out) shape; ``fan_in`` still sets the bound (a
    convolution passes ``Cin·K·K``).
    """
    bound = _gain(nonlinearity) * math.sqrt(3.0 / fan_in)
    return rand(*_shape(fan_in, fan_out, shape), low=-bound, high=bound, **kwargs)


def kaiming_normal(fan_in, fan_out, nonlinearity="relu", shape=None, **kwargs):
    """N(0, std²) with ``std = gain / sqrt(fan_in)``."""
    std = _gain(nonlinearity) / math.sqrt(fan_in)
    return randn(*_shape(fan_in, fan_out, shape), mean=0.0, std=std, **kwargs)
