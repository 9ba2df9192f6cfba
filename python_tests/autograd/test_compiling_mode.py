"""``compiling()`` and ``replayed()`` live in ``needle.autograd.grad_mode`` beside the other
per-thread modes: the compiler sets them, ``nn`` and ``optim`` read them without importing it."""
from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import numpy as np

import needle as ndl
from needle.autograd import grad_mode
from needle.compiler import effects

ROOT = Path(__file__).resolve().parents[2]


def _import_graph() -> dict:
    spec = importlib.util.spec_from_file_location(
        "_import_cycles", ROOT / "python_tests" / "test_import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.import_graph()


def test_the_compiler_names_the_autograd_state():
    assert effects.compiling is grad_mode.compiling
    assert effects.set_compiling is grad_mode.set_compiling
    assert effects.replayed is grad_mode.replayed
    assert effects.set_listener is grad_mode.set_replay_listener


def test_a_compiled_step_runs_its_python_under_compiling():
    seen = []

    def step(x):
        seen.append(grad_mode.compiling())
        return (x * 2).sum()

    compiled = ndl.compile(step)
    x = ndl.Tensor(np.ones(3, dtype="float32"))
    assert grad_mode.compiling() is False
    for _ in range(3):
        compiled(x)
    assert seen and all(seen)
    assert grad_mode.compiling() is False


def test_compiling_is_per_thread():
    seen = {}

    def other():
        seen["other"] = grad_mode.compiling()

    grad_mode.set_compiling(True)
    try:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert grad_mode.compiling() is True
    finally:
        grad_mode.set_compiling(False)
    assert seen == {"other": False} and grad_mode.compiling() is False


def test_replayed_reports_to_this_threads_listener_only():
    heard = []
    previous = grad_mode.set_replay_listener(lambda fn, owner, value: heard.append(value))
    try:
        assert grad_mode.replayed(lambda: 0.5, None) == 0.5
        t = threading.Thread(target=grad_mode.replayed, args=(lambda: 0.25, None))
        t.start()
        t.join()
    finally:
        assert grad_mode.set_replay_listener(previous) is not None
    assert heard == [0.5]


def test_layers_below_the_compiler_do_not_import_it():
    graph = _import_graph()
    below = [m for m in graph if m.split(".")[:2] in (["needle", "nn"], ["needle", "autograd"])
             or m in ("needle.optim", "needle.amp", "needle.random")
             or m.startswith("needle.backend_ndarray")]
    assert "needle.optim" in below and "needle.nn.nn_basic" in below
    upward = sorted((m, dep) for m in below for dep in graph[m]
                    if dep == "needle.compiler" or dep.startswith("needle.compiler."))
    assert upward == []
