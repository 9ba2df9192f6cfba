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
    """The layers of pyproject.toml: a module imports only from its own layer or below."""
    result = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_clean():
    result = subprocess.run([_tool("ruff"), "check", "needle", "apps", "bench", "python_tests"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]


# Design documents that live outside the repository: users never have them, so code, comments,
# docs and tests must say what the reader needs instead of pointing there.
# The words are assembled from pieces so that this file does not match itself.
_OUTSIDE_DOCS = tuple(a + b for a, b in [("NEEDLE", "_API"), ("DESIGN", ".md"), ("PERF", "_NOTES"),
                                         ("STYLE", ".md"), ("../sha", "red"), ("/work/sha", "red")])
_SKIP_DIRS = {".git", ".venv", "build", "runs", "__pycache__", ".pytest_cache", ".mypy_cache",
              ".ruff_cache", ".hypothesis"}
_TEXT_SUFFIXES = (".py", ".md", ".toml", ".cfg", ".txt", ".h", ".cc", ".cpp", ".cu", ".cuh",
                  ".sh", ".yml", ".yaml", "Makefile", "CMakeLists.txt", "run")


def _outside_doc_references(root: str) -> list[str]:
    hits = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            if not name.endswith(_TEXT_SUFFIXES):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    for word in _OUTSIDE_DOCS:
                        if word in line:
                            hits.append(f"{os.path.relpath(path, root)}:{number}: {word}")
    return hits


def test_no_reference_to_design_documents_outside_the_repo():
    assert _outside_doc_references(ROOT) == []


def test_outside_reference_scan_finds_a_planted_reference(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text('"""See PERF' + '_NOTES for the numbers."""\n')
    (tmp_path / "guide.md").write_text("clean\n")
    assert _outside_doc_references(str(tmp_path)) == ["pkg/mod.py:1: PERF" + "_NOTES"]
