"""Packaging: the core needs NumPy and ml_dtypes only; `import needle` works without the
optional packages."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONAL = ("mpi4py", "mpich", "zmq", "matplotlib", "tqdm", "sklearn", "torch", "safetensors")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _names(requirements) -> set:
    return {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in requirements}


def test_core_depends_on_numpy_and_ml_dtypes_only_and_extras_carry_the_rest():
    project = _pyproject()
    extras = project["optional-dependencies"]
    assert _names(project["dependencies"]) == {"numpy", "ml_dtypes"}  # bfloat16
    assert _names(extras["distributed"]) == {"mpi4py", "mpich", "pyzmq"}
    assert _names(extras["apps"]) == {"matplotlib", "tqdm", "scikit-learn"}
    assert "needle[distributed,apps]" in extras["test"]
    assert _names(extras["safetensors"]) == {"safetensors"}
    assert "needle[safetensors]" in extras["test"]


BLOCKER = f"""
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            raise ImportError("blocked for the test: " + name)

sys.meta_path.insert(0, Block())
import numpy as np
import needle as ndl
from needle import nn, optim
import needle.memory, needle.checkpoint, needle.random
np.random.seed(0)
net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
x = ndl.Tensor(np.ones((2, 4), dtype="float32"), requires_grad=False)
ndl.checkpoint_sequential(net, 2, x).sum().backward()
optim.SGD(net.parameters(), lr=0.1).step()
assert issubclass(ndl.ShapeError, ndl.NeedleError)
try:
    import needle.distributed
except ImportError:
    pass  # needs the distributed extra: a plain ImportError is what a user should see
print("ok")
"""


def test_needle_imports_and_trains_without_the_optional_packages():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", BLOCKER], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
