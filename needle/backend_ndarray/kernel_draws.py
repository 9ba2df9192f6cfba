"""``rand`` draws on a device: made by the device's kernel where it has one, else by NumPy.

NumPy's ``np.random.rand(128, 100)`` fills a float64 array one indirect call per value; a
Dropout mask then costs a cast to float32 and a comparison on top (three passes and two
temporary arrays, ~0.1 ms per call on the development VM). The C++ backend's
``mt19937_uniform`` makes the same draws from the same generator state straight into a
needle buffer, optionally compared with ``p`` on the way, several times faster. The values are
bitwise NumPy's (``float64`` draws rounded to the array's dtype; the mask compares in that
dtype, as ``rand(...).astype(dtype) <= p`` does) and NumPy's generator ends where
``np.random.rand`` would leave it.

:func:`rand` is what callers use (``device.rand``, ``needle.init``): the kernel's draw when
:func:`uniform` can make it, otherwise the draw through :mod:`needle.random` as before (the
device has no kernel, the dtype is not float32/float64, or
:func:`needle.random.host_mt19937` says the draw must go through NumPy: another stream, a
swapped bit generator, a draw observer such as a checkpoint verification or a compile trace).

Example:
    >>> import numpy as np
    >>> from needle.backend_ndarray import cpu_numpy
    >>> np.random.seed(0); a = rand(cpu_numpy(), (2, 3), "float64")
    >>> np.random.seed(0); bool((a.numpy() == np.random.rand(2, 3)).all())
    True
"""
from __future__ import annotations

from .. import random as _random
from .ndarray import NDArray, _alloc
from .ndarray_checks import scalar_value
from .ndarray_limits import check_alloc, check_dims

__all__ = ["rand", "uniform", "kernel_for"]

_KERNEL_DTYPES = ("float32", "float64")


def kernel_for(mod, dtype: str):
    """Backend module ``mod``'s ``mt19937_uniform`` when it can draw ``dtype``, else None."""
    if dtype not in _KERNEL_DTYPES:
        return None
    return getattr(mod, "mt19937_uniform", None)


def rand(device, shape, dtype: str, p=None, *, host_stream: bool = False) -> NDArray:
    """``np.random.rand(*shape)`` as a ``dtype`` array on ``device`` or, with ``p``, its
    Bernoulli mask ``rand(*shape).astype(dtype) <= p`` as 1/0: by the device's kernel when
    :func:`uniform` can, else drawn through :mod:`needle.random` (the same numbers).

    The draw is the one ``needle.random.rand(*shape, device=device)`` makes, or with
    ``host_stream`` the host stream's (``device=None``), as ``needle.init`` draws.

    Raises:
        ShapeError / SizeLimitError: a malformed shape, or one NumPy could not draw.
        DTypeError: ``p`` that is not a number.
    """
    shape = check_dims("rand", shape)
    check_alloc("rand", shape, 8, "float64")  # what NumPy's draw needs
    drawn = uniform(device, shape, dtype, p, host_stream=host_stream)
    if drawn is not None:
        return drawn
    drawn = NDArray(_random.rand(*shape, device=None if host_stream else device),
                    device=device, dtype=dtype)
    return drawn if p is None else drawn <= p


def uniform(device, shape, dtype: str, p=None, *, host_stream: bool = False) -> NDArray | None:
    """``np.random.rand(*shape)`` as a ``dtype`` array on ``device``, or, with ``p``, its
    Bernoulli mask ``rand(*shape).astype(dtype) <= p`` as 1/0; None when no kernel can make
    the draw (the caller then draws through :mod:`needle.random`).

    The draw is the one ``needle.random.rand(*shape, device=device)`` makes, or with
    ``host_stream`` the host stream's (``device=None``), as ``needle.init`` draws. ``shape``
    is a tuple of non-negative ints that :func:`rand` has checked (it is not checked again).

    Raises:
        DTypeError: ``p`` that is not a number.
    """
    kernel = kernel_for(getattr(device, "mod", None), dtype)
    if kernel is None:
        return None
    generator = _random.host_mt19937(None if host_stream else device)
    if generator is None:
        return None
    threshold = None if p is None else scalar_value(p, "randb")
    out = _alloc(shape, device, dtype, "rand")
    kernel(generator, out._handle, out.size, threshold)
    return out
