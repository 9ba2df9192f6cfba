"""Devices of the course's ``np`` mode, where ``array_api`` is NumPy itself.

In this mode every array is a plain ``numpy.ndarray`` on the single CPU device, so a device
only knows how to create arrays. Random draws go through :mod:`needle.random`, whose host
stream is NumPy's global RNG (the course's golden values rely on it).

Example:
    >>> dev = cpu()
    >>> dev.zeros(2, 3, dtype="float32").shape, repr(dev)
    ((2, 3), 'needle.cpu()')
"""
from __future__ import annotations

import numpy

from . import random as _random

__all__ = ["Device", "CPUDevice", "cpu", "cpu_numpy", "default_device", "all_devices"]


class Device:
    """Base class of np-mode devices."""


class CPUDevice(Device):
    """The one CPU device of np mode; all instances compare equal."""

    def __repr__(self) -> str:
        return "needle.cpu()"

    def __hash__(self) -> int:
        return self.__repr__().__hash__()

    def __eq__(self, other) -> bool:
        return isinstance(other, CPUDevice)

    def enabled(self) -> bool:
        return True

    def zeros(self, *shape, dtype="float32"):
        return numpy.zeros(shape, dtype=dtype)

    def ones(self, *shape, dtype="float32"):
        return numpy.ones(shape, dtype=dtype)

    def randn(self, *shape):
        # through needle.random (its observers see the draw): NumPy's global RNG, float64,
        # one draw of the full shape; the course's golden values depend on these exact draws
        return _random.randn(*shape)

    def rand(self, *shape):
        return _random.rand(*shape)

    def one_hot(self, n, i, dtype="float32"):
        return numpy.eye(n, dtype=dtype)[i]

    def empty(self, shape, dtype="float32"):
        return numpy.empty(shape, dtype=dtype)

    def full(self, shape, fill_value, dtype="float32"):
        return numpy.full(shape, fill_value, dtype=dtype)


_CPU = CPUDevice()


def cpu() -> CPUDevice:
    """The CPU device (a singleton)."""
    return _CPU


def cpu_numpy() -> CPUDevice:
    """Alias of :func:`cpu` so that code written for nd mode's ``cpu_numpy()`` still runs."""
    return _CPU


def default_device() -> CPUDevice:
    return _CPU


def all_devices() -> list[CPUDevice]:
    """Every device of np mode: just the CPU."""
    return [_CPU]
