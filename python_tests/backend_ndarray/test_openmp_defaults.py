"""The OpenMP settings needle chooses for its C++ kernels when it loads them.

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it is loaded, and prints what it
uses under ``OMP_DISPLAY_ENV=VERBOSE``: each case starts a fresh interpreter, makes ``cpu()``
and reads that report. A process on its own gets sleeping workers that spin briefly first; a
distributed rank gets no spin; whatever the user set stands; the variables needle chose do not
stay in ``os.environ`` (child processes choose for themselves). If libgomp is already loaded
(PyTorch imported first), needle sets nothing. Small matrix products use both threads only
when the workers spin long enough to be awake for them (the kernels' flop threshold).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from needle._core.job_env import RANK_VARS

CHILD = ("import os, needle\n"
         "needle.cpu()\n"
         "print('left:', os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))\n")

# The same after loading libgomp first, as `import torch` does (its wheel ships the soname).
PRELOADED = "import ctypes, os\nctypes.CDLL('libgomp.so.1', mode=os.RTLD_GLOBAL)\n" + CHILD

THRESHOLD = ("from needle.backend_ndarray import ndarray_backend_cpu as b\n"
             "print('min flops:', b._parallel_min_flops())\n")


def _run(extra: dict, child: str = CHILD) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NEEDLE_DIST_BACKEND", *RANK_VARS)}
    env.update(extra, OMP_DISPLAY_ENV="VERBOSE")
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    shown = dict(re.findall(r"^\s*(OMP_WAIT_POLICY|GOMP_SPINCOUNT) = '([^']*)'", proc.stderr,
                            re.MULTILINE))
    if "OMP_WAIT_POLICY" not in shown:
        pytest.skip("the C++ backend's OpenMP runtime is not libgomp (or cpu() is not built)")
    return shown, proc.stdout


@pytest.mark.parametrize("extra, policy, spin", [
    ({}, "PASSIVE", "1000"),
    ({"NEEDLE_DIST_BACKEND": "tcp"}, "PASSIVE", "0"),
    ({"PMI_RANK": "1"}, "PASSIVE", "0"),
    ({"RANK": "0"}, "PASSIVE", "0"),
    ({"GOMP_SPINCOUNT": "7"}, None, "7"),
])
def test_needle_chooses_only_what_the_user_left_unset(extra, policy, spin):
    shown, out = _run(extra)
    assert shown["GOMP_SPINCOUNT"] == spin
    if policy is not None:
        assert shown["OMP_WAIT_POLICY"] == policy
    # what needle chose is gone again; what the user set is still there
    assert out.strip() == f"left: None {extra.get('GOMP_SPINCOUNT')}"


def test_a_user_wait_policy_keeps_its_own_spin():
    shown, out = _run({"OMP_WAIT_POLICY": "active"})
    assert shown["OMP_WAIT_POLICY"] == "ACTIVE"
    assert shown["GOMP_SPINCOUNT"] not in ("0", "1000")
    assert out.strip() == "left: active None"


@pytest.mark.parametrize("extra, child, min_flops", [
    ({}, CHILD, 2e6),  # needle's short spin: a sleeping worker costs more than it gives
    ({}, PRELOADED, 5e5),  # libgomp's default spin (300000 iterations)
    ({"OMP_WAIT_POLICY": "ACTIVE"}, CHILD, 5e5),
    ({"OMP_WAIT_POLICY": "passive"}, CHILD, 2e6),
    ({"GOMP_SPINCOUNT": "20k"}, CHILD, 5e5),
    ({"GOMP_SPINCOUNT": "9999"}, CHILD, 2e6),
    ({"GOMP_SPINCOUNT": "infinite"}, CHILD, 5e5),
    ({"NEEDLE_DIST_BACKEND": "tcp"}, CHILD, 2e6),
])
def test_small_products_use_threads_only_for_spinning_workers(extra, child, min_flops):
    shown, out = _run(extra, child + THRESHOLD)
    assert out.strip().splitlines()[-1] == f"min flops: {min_flops}", shown
