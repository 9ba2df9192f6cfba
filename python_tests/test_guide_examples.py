"""Every guide in ``docs/`` opens with an example that runs as pasted.

The convention: a fenced ```python block directly after a line ``<!-- runs -->`` is complete
(imports, data, model) and runs on its own. Each one runs here in a fresh interpreter, in a
fresh folder, in a process group of its own; it passes when it exits 0 and leaves no process
of that group behind. Every guide's first fenced block must be such a block. Blocks without
the marker are fragments and are not run.
"""
from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
MARKER = "<!-- runs -->"
TIMEOUT_S = 60


def runnable_blocks(text: str) -> list[str]:
    """The ```python blocks that directly follow a ``<!-- runs -->`` line, in order."""
    return re.findall(r"^<!-- runs -->\n```python\n(.*?)^```", text, re.S | re.M)


def first_block_is_runnable(text: str) -> bool:
    first = re.search(r"^```", text, re.M)
    return first is not None and text[:first.start()].endswith(MARKER + "\n") and \
        text[first.start():].startswith("```python\n")


def run_block(block: str, cwd) -> tuple[int, str]:
    """Run ``block`` in a fresh interpreter; ``(exit status, output)``. Fails the test if a
    process the block started outlives it (and ends that process)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    # output to a file, not a pipe: a process left behind would hold a pipe open
    log = os.path.join(cwd, "output.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", block], cwd=cwd, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"expected the block to finish within {TIMEOUT_S} s, got:\n"
                        f"{_read(log)[-4000:]}")
    output = _read(log)
    deadline = time.monotonic() + 2.0  # a child that is exiting gets a moment to go
    while True:
        try:
            os.killpg(proc.pid, 0)  # the block's process group: anyone left?
        except ProcessLookupError:
            return proc.returncode, output
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"expected no process left behind, got survivors in group {proc.pid}")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _params():
    for path in GUIDES:
        for i, _ in enumerate(runnable_blocks(_read(path))):
            yield pytest.param(path, i, id=f"{os.path.basename(path)}-{i}")


def test_the_marker_finds_only_marked_python_blocks():
    text = ("# g\n<!-- runs -->\n```python\nprint(1)\n```\n```python\nundefined\n```\n"
            "<!-- runs -->\n```bash\necho 2\n```\n<!-- runs -->\n\n```python\nno\n```\n")
    assert runnable_blocks(text) == ["print(1)\n"]
    assert first_block_is_runnable(text)
    assert not first_block_is_runnable("# g\n```python\nx\n```\n<!-- runs -->\n```python\ny\n```\n")


@pytest.mark.parametrize("path", GUIDES, ids=os.path.basename)
def test_every_guide_opens_with_a_runnable_example(path):
    text = _read(path)
    assert first_block_is_runnable(text), (
        f"{os.path.basename(path)}: expected the first fenced block to be a ```python block "
        f"directly after a {MARKER!r} line")
    # a marker must mark something runnable
    assert text.count(MARKER) == len(runnable_blocks(text)), (
        f"{os.path.basename(path)}: expected every {MARKER!r} to precede a ```python block")


@pytest.mark.parametrize("path,index", list(_params()))
def test_marked_block_runs(path, index, tmp_path):
    block = runnable_blocks(_read(path))[index]
    status, output = run_block(block, tmp_path)
    assert status == 0, f"{os.path.basename(path)} block {index}, exit {status}:\n{output[-6000:]}"


def test_a_broken_block_fails(tmp_path):
    status, output = run_block("import needle as ndl\nprint(model)\n", tmp_path)
    assert status != 0 and "NameError" in output


def test_a_block_that_leaves_a_process_behind_fails(tmp_path):
    block = ("import subprocess, sys\n"
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n")
    with pytest.raises(pytest.fail.Exception, match="no process left behind"):
        run_block(block, tmp_path)
