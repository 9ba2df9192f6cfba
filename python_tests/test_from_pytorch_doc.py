"""docs/from_pytorch.md runs as written: its ```python blocks, in order, in one namespace,
in a fresh folder (the files it saves land there)."""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "from_pytorch.md")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_the_guide_has_examples():
    with open(DOC, encoding="utf-8") as f:
        assert len(python_blocks(f.read())) >= 6


def test_every_example_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("safetensors")
    monkeypatch.chdir(tmp_path)
    with open(DOC, encoding="utf-8") as f:
        blocks = python_blocks(f.read())
    namespace: dict = {"__name__": "from_pytorch_md"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC} block {i}", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "save its weights" not in out  # the Module refusal is the needle format's message
    assert "state_dict()" in out and (tmp_path / "checkpoint.ndl").is_file()


def test_a_broken_example_fails():
    with pytest.raises(AssertionError):
        exec(compile("\n".join(python_blocks("```python\nassert 1 == 2\n```\n")), "x", "exec"))
