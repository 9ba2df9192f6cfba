"""Repository-wide checks: the layer contract (import-linter), lint (ruff), no references to
outside design documents, and no development narration in product files."""
from __future__ import annotations

import os
import re
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


# Product files (README, the changelog, docs, code, benches) say what needle does and what was
# measured when, never how its development went: no numbered sessions, work periods or waves,
# no issue numbers. "Session" in its operating-system sense (setsid, start_new_session, ranks in
# their own sessions) stays allowed: only development phrasing is matched.
_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
             r"|\w+teenth|twentieth|\d+(?:st|nd|rd|th)")
_NARRATION = re.compile(
    r"\b(?:" + _ORDINALS + r"|this|that|the\s+same|previous|next|earlier|later|last|prior"
    r"|current|past|future|work|working|development|coding)[\s-]+sessions?\b"
    r"|\bsessions?\s+#?\d+\b"
    r"|\bsession's\s+(?:start|end|first|last|code|runs?|work|measurements?)\b"
    r"|\b(?:start|end)\s+of\s+(?:the|this|a|each)\s+session\b"
    r"|\bissue\s+#?\d+\b|\bissues\s+#\d+|\bissues\s+#?\d+\s*(?:,|and|&)\s*#?\d+|\(#\d+\b"
    r"|\bPR\s*#?\d+\b|\bpull\s+request\s+#?\d+\b"
    r"|\bwaves?\s+#?\d+\b"
    r"|\bwork(?:ing)?[\s-]+periods?\b|\bperiods?\s+#?\d+\b"
    r"|\b(?:development|review|work)\s+rounds?\s+#?\d+\b|\bround\s+\d+\s+of\s+(?:development|work"
    r"|review)\b",
    re.IGNORECASE)
_PRODUCT_PATHS = ("README.md", "CHANGELOG.md", "docs", "needle", "apps", "bench", "src")


def development_narration(text: str) -> list[tuple[int, str]]:
    """(line, phrase) of every place ``text`` narrates development instead of the product."""
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(0).split()))
            for m in _NARRATION.finditer(text)]


def _narration_hits(root: str) -> list[str]:
    files = []
    for top in _PRODUCT_PATHS:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            files.append(path)
        for folder, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            files += [os.path.join(folder, n) for n in names if n.endswith(_TEXT_SUFFIXES)]
    hits = []
    for path in sorted(files):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line, phrase in development_narration(f.read()):
                hits.append(f"{os.path.relpath(path, root)}:{line}: {phrase}")
    return hits


@pytest.mark.parametrize("text", [
    "Measured in the tenth session on Zen 4.",
    "what earlier sessions measured",
    "at this\nsession's last code change",     # wrapped across lines
    "the session's start against its end",
    "the sixteenth-session table",
    "Session 4 added the kernels.",
    "end of the first session",
    "every target of issue 18 is met",
    "the allocator (issue #5)",
    "issues 3 and 4",
    "parameter server (#14), server snapshots (#17 part)",
    "merged in PR #31",
    "wave 2 of the rewrite",
    "in work period 3",
    "over several working periods",
    "period 7 closed the gap",
    "after review round 2",
])
def test_narration_check_catches_development_phrasing(text):
    assert development_narration(text) != []


@pytest.mark.parametrize("text", [
    "ranks live in their own sessions, so the launcher signals each process group",
    "each our child in its own session; Hydra puts every rank in a session of its own",
    "subprocess.Popen(cmd, start_new_session=True)",
    "a session leader (setsid) receives SIGHUP",
    "the server applies round 3 of pushes",
    "the launcher issues 4 launches per step",
    "a checkpoint period of 10 steps; the wave of restarts",
    "Measured 2026-12-05 on an AMD EPYC (family 25 model 17), AVX-512.",
])
def test_narration_check_leaves_product_prose_alone(text):
    assert development_narration(text) == []


def test_narration_scan_reports_file_and_line(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\nMeasured in the ninth\nsession.\n")
    (tmp_path / "needle").mkdir()
    (tmp_path / "needle" / "mod.py").write_text('"""Ranks run in their own sessions."""\n')
    (tmp_path / "README.md").write_text("See issue 7.\n")
    assert _narration_hits(str(tmp_path)) == ["README.md:1: issue 7",
                                              "docs/guide.md:3: ninth session"]


def test_product_files_do_not_narrate_development():
    assert _narration_hits(ROOT) == []
