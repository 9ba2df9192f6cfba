"""Pick the array backend once, at import, from ``NEEDLE_BACKEND`` ("nd" default | "np").

* ``nd``: ``array_api`` is :mod:`needle.backend_ndarray`, ``NDArray`` its strided array.
* ``np``: ``array_api`` is NumPy, ``NDArray`` is ``numpy.ndarray`` (the course's hw1/hw2 mode).

Example:
    >>> from needle.backend_selection import BACKEND
    >>> BACKEND in ("nd", "np")
    True
"""
from __future__ import annotations

import os

from ._core.errors import BackendUnavailable

BACKEND = os.environ.get("NEEDLE_BACKEND", "nd")

if BACKEND == "nd":
    from . import backend_ndarray as array_api
    from .backend_ndarray import BackendDevice as Device
    from .backend_ndarray import all_devices, cpu, cpu_numpy, cuda, default_device

    NDArray = array_api.NDArray
    __all__ = ["BACKEND", "array_api", "NDArray", "Device", "cpu", "cpu_numpy", "cuda",
               "default_device", "all_devices"]
elif BACKEND == "np":
    import numpy as array_api

    from .backend_numpy import Device, all_devices, cpu, cpu_numpy, default_device

    NDArray = array_api.ndarray
    __all__ = ["BACKEND", "array_api", "NDArray", "Device", "cpu", "cpu_numpy",
               "default_device", "all_devices"]
else:
    raise BackendUnavailable(
        f"backend_selection: unknown NEEDLE_BACKEND, expected 'nd' or 'np', got {BACKEND!r}")
