"""Every docstring example in the ``needle`` package runs, and prints what it shows.

The suite's command (``python -m pytest python_tests -q``, the README's) collects only
``python_tests``, so this file runs :mod:`doctest` over every module of ``needle`` itself: one
test per module, with pytest's default ``ELLIPSIS`` flag. An example that cannot run here
(it needs data files, a GPU or other processes) says so in its text and carries
``# doctest: +SKIP``.
"""
from __future__ import annotations

import doctest
import importlib
import io
import pkgutil
import types

import pytest

import needle


def _module_names() -> list[str]:
    names = ["needle"]
    for info in pkgutil.walk_packages(needle.__path__, "needle."):
        if info.name.rsplit(".", 1)[-1].startswith("ndarray_backend_cpu"):
            continue  # the compiled extension: pybind11 signatures, no examples
        names.append(info.name)
    return sorted(names)


MODULES = _module_names()


def run_examples(module: types.ModuleType) -> tuple[int, int, str]:
    """(examples run, failures, doctest's report) for the examples defined in ``module``."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    for test in finder.find(module, module.__name__):
        runner.run(test, out=report.write)
    result = runner.summarize(verbose=False)
    return result.attempted, result.failed, report.getvalue()


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    attempted, failed, report = run_examples(importlib.import_module(name))
    assert failed == 0, f"{failed} of {attempted} examples of {name} failed:\n{report[-6000:]}"


def test_examples_are_found_across_the_package():
    # A discovery that silently finds nothing would make every test above pass.
    with_examples = 0
    examples = 0
    for name in MODULES:
        attempted, _, _ = run_examples(importlib.import_module(name))
        with_examples += attempted > 0
        examples += attempted
    assert with_examples >= 100, with_examples
    assert examples >= 500, examples


def test_a_wrong_example_is_reported():
    module = types.ModuleType("planted")
    module.__doc__ = """Planted.

    >>> 1 + 1
    3
    >>> 2 + 2
    4
    """
    attempted, failed, report = run_examples(module)
    assert (attempted, failed) == (2, 1)
    assert "Expected:\n    3\nGot:\n    2" in report
