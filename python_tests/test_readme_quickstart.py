"""The README's quick starts run as written and print what the README says they print.

Every ``### heading`` under ``## Quick start`` holds one ```bash block. Each block runs under
``bash -eu`` in a fresh folder that holds the repository's ``apps/`` and ``bench/`` (a fresh
clone's layout; outputs land in that folder), with ``.venv/bin/python`` standing for the
interpreter running this suite. ``.venv/bin/pip install`` lines are dropped: the suite's
environment already has every extra except ``cuda``, and the CUDA block only runs where
``cuda()`` is enabled.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

import needle.backend_ndarray as nd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

# What each quick start must print (a fragment of its output) besides exiting 0. A new quick
# start needs an entry here, so that it is checked for more than its exit status.
EXPECTED = {
    "Train the main job": ["held-out accuracy", "wrote runs/quick/summary.json"],
    "The same job on 2 processes: `--nproc 2`": ["wrote runs/ddp/summary.json"],
    "Your own script on the launcher": ["[rank 0] rank 0 of 2: [3. 3. 3. 3.]",
                                        "[rank 1] rank 1 of 2: [3. 3. 3. 3.]"],
    "Memory report of your own script": ["needle memory profile: my_step.py",
                                         "wrote runs/mem/memory.json"],
    "Activation checkpointing experiment": ["measured minimum at K ="],
    "Save and resume": ["wrote runs/resumed/summary.json", "resume certificate: IDENTICAL"],
    "Benchmarks": ["needle/NumPy", "50-op chain"],
    "The CUDA device": ["cuda()", "held-out accuracy"],
}
# The features the README promises a quick start for.
REQUIRED = set(EXPECTED)
PROCESSES = {"The same job on 2 processes: `--nproc 2`", "Your own script on the launcher"}


def quick_starts(text: str) -> dict[str, str]:
    """``{heading: bash block}`` for each ``###`` section of ``## Quick start``."""
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M)
    if section is None:
        return {}
    found = {}
    for part in re.split(r"^### ", section.group(1), flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        blocks = re.findall(r"^```bash\n(.*?)^```", body, re.S | re.M)
        found[heading.strip()] = blocks[0] if len(blocks) == 1 else None
    return found


def _as_run_here(block: str) -> str:
    lines = [line for line in block.splitlines() if not line.startswith(".venv/bin/pip install")]
    return "\n".join(lines).replace(".venv/bin/python", shlex.quote(sys.executable)) + "\n"


with open(README, encoding="utf-8") as _f:
    QUICK_STARTS = quick_starts(_f.read())


def _params():
    for heading in sorted(QUICK_STARTS):
        marks = []
        if heading in PROCESSES:
            marks.append(pytest.mark.mpi)
        if "CUDA" in heading:
            marks += [pytest.mark.cuda,
                      pytest.mark.skipif(not nd.cuda().enabled(), reason="cuda() not available")]
        yield pytest.param(heading, marks=marks, id=heading.split(":")[0].replace(" ", "_"))


def test_readme_has_a_quick_start_per_feature():
    assert set(QUICK_STARTS) == REQUIRED
    for heading, block in QUICK_STARTS.items():
        assert block is not None, f"{heading!r}: expected exactly one ```bash block"
        for line in block.splitlines():
            # copy-pasteable after the README's first command: the venv's tools, not a bare
            # `python` that may be another interpreter
            assert not re.match(r"\s*(python3?|pip3?)\s", line), (heading, line)


def test_readme_first_block_keeps_the_two_commands_ci_reads():
    first = re.search(r"^```\w*\n(.*?)^```", open(README, encoding="utf-8").read(), re.S | re.M)
    lines = [line for line in first.group(1).splitlines() if line.strip()]
    assert len(lines) == 2
    assert lines[1].endswith("-m pytest python_tests -q")


def test_the_extraction_sees_a_planted_section():
    text = ("# x\n## Quick start\nintro\n### One\n```bash\necho 1\n```\nprose\n"
            "### Two\n```bash\necho 2\n```\n```bash\necho 3\n```\n## Layout\n")
    assert quick_starts(text) == {"One": "echo 1\n", "Two": None}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("heading", list(_params()))
def test_quick_start_runs(heading, tmp_path):
    for name in ("apps", "bench"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(["bash", "-euc", _as_run_here(QUICK_STARTS[heading])],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for fragment in EXPECTED[heading]:
        assert fragment in output, f"{heading!r}: {fragment!r} not in output:\n{output[-6000:]}"
