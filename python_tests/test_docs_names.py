"""Every dotted needle name the README and docs/ mention exists.

A name such as ``ndl.memory.stats`` or ``needle.distributed.pipeline.make_plan`` is resolved
attribute by attribute (importing submodules where an attribute is missing), so a guide never
sends a reader to a name that raises ``AttributeError``.
"""
from __future__ import annotations

import glob
import importlib
import os
import re

import needle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NAME = re.compile(r"\b(ndl|needle|dist)((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
_ROOTS = {"ndl": "needle", "needle": "needle", "dist": "needle.distributed"}
_FILE_SUFFIXES = {"py", "md", "so", "json", "png", "html"}  # `needle.x` in prose, file names
_PROSE = {"needle.x"}  # "any `import needle.x`" in docs/autograd.md


def unresolved(text: str) -> list[str]:
    missing = []
    for match in _NAME.finditer(text):
        if match.group(0) in _PROSE:
            continue
        module = _ROOTS[match.group(1)]
        obj = importlib.import_module(module)
        for part in match.group(2).strip(".").split("."):
            if part in _FILE_SUFFIXES:
                break
            if hasattr(obj, part):
                obj = getattr(obj, part)
                module = f"{module}.{part}"
                continue
            try:
                module = f"{module}.{part}"
                obj = importlib.import_module(module)
            except ImportError:
                missing.append(match.group(0))
                break
    return missing


def test_every_needle_name_in_the_guides_exists():
    assert needle.__name__ == "needle"
    missing = {}
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        with open(path, encoding="utf-8") as f:
            names = unresolved(f.read())
        if names:
            missing[os.path.relpath(path, ROOT)] = sorted(set(names))
    assert missing == {}


def test_a_name_that_does_not_exist_is_reported():
    text = ("`ndl.memory.stats(ndl.cpu())`, `needle.distributed.pipeline.make_plan`, "
            "`ndl.checkpoint.measure_layer_costs(model, x)`, `ndl.nn.NoSuchLayer`")
    assert unresolved(text) == ["ndl.checkpoint.measure_layer_costs", "ndl.nn.NoSuchLayer"]


def test_the_readme_links_every_guide():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    guides = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert guides and [g for g in guides if f"(docs/{g})" not in readme] == []
