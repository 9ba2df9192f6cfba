"""mypy type-checks the public API packages (autograd, ops, memory, distributed).

The configuration is ``[tool.mypy]`` in pyproject.toml: the packages checked, and per-module
exceptions, each with the reason mypy cannot follow that code.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mypy(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    try:
        import mypy  # noqa: F401
    except ImportError:
        pytest.fail("mypy is not installed; it is part of the [test] extra")
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", os.devnull,
                           "--config-file", os.path.join(ROOT, "pyproject.toml"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_public_packages_type_check():
    result = _mypy()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout


def test_the_configuration_reports_a_type_error(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def size() -> int:\n    return 'four'\n")
    result = _mypy(str(planted), cwd=str(tmp_path))
    assert result.returncode == 1, result.stdout
    assert 'Incompatible return value type (got "str", expected "int")' in result.stdout
