"""Repository-wide checks: the layer contract (import-linter) and lint (ruff)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name: str) -> str:
    path = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; it is part of the [test] extra")
    return path


def test_layers_contract_kept():
    """DESIGN.md's layers: a module imports only from its own layer or below."""
    result = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_clean():
    result = subprocess.run([_tool("ruff"), "check", "needle", "apps", "bench", "python_tests"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
