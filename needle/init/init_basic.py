"""Basic tensor factories: random (uniform, normal, Bernoulli), constant, one-hot.

Every random factory draws once, with the full shape, through :mod:`needle.random` (whose
host stream is NumPy's global generator, ``np.random.seed`` reproduces it): the course's
golden values depend on that exact sequence of draws.

Example:
    >>> from needle import init
    >>> init.constant(2, 2, c=3.0).numpy().tolist()
    [[3.0, 3.0], [3.0, 3.0]]
"""
from __future__ import annotations

import numpy as np

from .. import random as _random
from .._core.dtypes import canonical_dtype
from .._core.errors import IndexOutOfRange
from ..autograd import Tensor
from ..backend_ndarray import kernel_draws as draws
from ..backend_selection import BACKEND, NDArray, default_device

__all__ = ["rand", "randn", "constant", "ones", "zeros", "randb", "one_hot",
           "zeros_like", "ones_like"]

_ND = BACKEND == "nd"


def _device(device):
    return default_device() if device is None else device


def _draw(device, kind: str, shape: tuple, dtype):
    # One draw through needle.random (so checkpoint verification sees it), then the array the
    # course's device.rand/randn would build: nd devices make it in float32 unless float64 or
    # float16 is asked for; np mode keeps NumPy's float64 and casts when the Tensor is made.
    if not _ND:
        return getattr(_random, kind)(*shape)
    dtype = dtype if dtype in ("float64", "float16", "bfloat16") else "float32"
    if kind == "rand":  # the same numbers, made by the device's kernel where it has one
        return draws.rand(device, shape, dtype, host_stream=True)
    return NDArray(_random.randn(*shape), device=device, dtype=dtype)


def _tensor_of(array, device, dtype, requires_grad: bool) -> Tensor:
    # ``array`` was made here and nobody else holds it: a Tensor around it, not around a copy
    # (``Tensor(ndarray)`` copies, as the course's does) when it has the device and dtype asked
    if _ND and array.device == device and array.dtype == canonical_dtype(dtype):
        return Tensor.make_const(array, requires_grad=requires_grad)
    return Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def rand(*shape, low=0.0, high=1.0, device=None, dtype="float32", requires_grad=False):
    """Uniform samples in [low, high): ``rand(shape) * (high - low) + low``."""
    device = _device(device)
    array = _draw(device, "rand", shape, dtype) * (high - low) + low
    return _tensor_of(array, device, dtype, requires_grad)


def randn(*shape, mean=0.0, std=1.0, device=None, dtype="float32", requires_grad=False):
    """Normal samples: ``randn(shape) * std + mean``."""
    device = _device(device)
    array = _draw(device, "randn", shape, dtype) * std + mean
    return _tensor_of(array, device, dtype, requires_grad)


def constant(*shape, c=1.0, device=None, dtype="float32", requires_grad=False):
    """A tensor filled with ``c`` (no random draw)."""
    device = _device(device)
    array = device.full(shape, c, dtype=dtype)
    return _tensor_of(array, device, dtype, requires_grad)


def ones(*shape, device=None, dtype="float32", requires_grad=False):
    """A tensor of ones."""
    return constant(*shape, c=1.0, device=device, dtype=dtype, requires_grad=requires_grad)


def zeros(*shape, device=None, dtype="float32", requires_grad=False):
    """A tensor of zeros."""
    return constant(*shape, c=0.0, device=device, dtype=dtype, requires_grad=requires_grad)


def randb(*shape, p=0.5, device=None, dtype="bool", requires_grad=False):
    """Bernoulli(p) samples: ``rand(shape) <= p`` (nd mode stores them as float32 0/1)."""
    device = _device(device)
    if _ND:  # the C++ device writes the mask straight from NumPy's generator
        array = draws.rand(device, shape, "float32", p, host_stream=True)
    else:
        array = _draw(device, "rand", shape, "float32") <= p
    return _tensor_of(array, device, dtype, requires_grad)


def one_hot(n, i, device=None, dtype="float32", requires_grad=False):
    """Rows of the n×n identity picked by the integer values of ``i`` (a Tensor or array).

    Built by scattering ones into zeros: O(len(i)·n), never the n×n identity itself (a
    10k-word vocabulary would need 800 MB for ``np.eye``).
    """
    device = _device(device)
    raw = np.asarray(i.numpy() if isinstance(i, Tensor) else i)
    if raw.dtype.kind in "fc" and raw.size:
        whole = raw == np.floor(raw)  # False for NaN too: nothing is truncated silently
        if not whole.all():
            at = int(np.argmin(whole.reshape(-1)))
            raise IndexOutOfRange(f"one_hot: expected integer class ids, got "
                                  f"{float(raw.reshape(-1)[at])} at flat position {at}")
    indices = raw.astype(np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        raise IndexOutOfRange(
            f"one_hot: index out of range, expected values in [0, {n}), got "
            f"[{indices.min()}, {indices.max()}]")
    array = np.zeros(indices.shape + (n,), dtype=np.dtype(dtype) if _is_float(dtype)
                     else np.float32)
    array.reshape(-1, n)[np.arange(indices.size), indices.reshape(-1)] = 1
    return Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def _is_float(dtype) -> bool:
    try:
        return np.issubdtype(np.dtype(dtype), np.floating)
    except TypeError:
        return False


def zeros_like(array, *, device=None, requires_grad=False):
    """Zeros with ``array``'s shape and dtype, on ``device`` (default: ``array``'s)."""
    device = device if device is not None else array.device
    return zeros(*array.shape, dtype=array.dtype, device=device, requires_grad=requires_grad)


def ones_like(array, *, device=None, requires_grad=False):
    """Ones with ``array``'s shape and dtype, on ``device`` (default: ``array``'s)."""
    device = device if device is not None else array.device
    return ones(*array.shape, dtype=array.dtype, device=device, requires_grad=requires_grad)
