"""One OpenMP runtime for both sides of a PyTorch comparison, at PyTorch's own settings.

needle's C++ kernels and PyTorch both use libgomp. The process holds one copy (the same
soname): whichever side loads first, configured from the environment at that moment. needle,
loading first with nothing set, asks for sleeping workers that spin 20-40 us first
(``needle/backend_ndarray/devices.py``); PyTorch runs with libgomp's defaults (idle
workers spin for milliseconds). The benches used to force ``OMP_WAIT_POLICY=passive`` on
both sides: on the project's 2-vCPU VMs waking a sleeping worker cost ~40 us per parallel
region, which took PyTorch's MLPResNet b128 step from ~55k to ~17k examples/s (needle's from
~60k to ~40k) and made every ratio look better than it was. Loading torch first gives the
anchor its out-of-the-box settings; needle's kernels then run under the same ones.

Usage (before anything makes ``cpu()``)::

    import _openmp
    torch = _openmp.load_torch_first()
    print(_openmp.describe())
"""
from __future__ import annotations

import os

_NAMES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def load_torch_first():
    """Import torch (and with it libgomp, configured as the user's environment says)."""
    import torch

    return torch


def _libgomp_copies() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return len({line.split()[-1] for line in maps if "libgomp" in line})
    except OSError:
        return -1


def describe() -> str:
    """One header line: the OpenMP settings both sides run under.

    >>> describe().startswith("OpenMP:")
    True
    """
    given = ", ".join(f"{n}={os.environ[n]}" for n in _NAMES if n in os.environ)
    copies = _libgomp_copies()
    shared = {1: "one libgomp shared by both sides", -1: "libgomp copies unknown"}.get(
        copies, f"{copies} libgomp copies loaded")
    return f"OpenMP: {shared}, {given or 'libgomp defaults (PyTorch out of the box)'}"
