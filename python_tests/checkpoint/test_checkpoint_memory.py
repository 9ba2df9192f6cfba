"""Allocator-measured activation bytes of checkpoint regions and of the experiment (counts only)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import needle.memory as memory
from needle import nn
from needle.autograd import Tensor
from needle.autograd.release import sweep
from needle.backend_ndarray import cpu_numpy
from needle.checkpoint import checkpoint_sequential, release_unsaved

ROOT = Path(__file__).resolve().parents[2]
BATCH, WIDTH = 16, 64
UNIT = BATCH * WIDTH * 4  # one layer output; a multiple of the allocator's 512 B rounding


def _chain(layers):
    np.random.seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(WIDTH, WIDTH, device=cpu_numpy()), nn.ReLU()]
    return nn.Sequential(*mods)


def _input():
    return Tensor(np.random.RandomState(0).randn(BATCH, WIDTH).astype("float32"),
                  device=cpu_numpy(), requires_grad=False)


@pytest.mark.parametrize("segments", [1, 2, 4, 8])
def test_forward_keeps_only_segment_boundaries(segments):
    model, x = _chain(8), _input()
    base = memory.stats(cpu_numpy())["by_category"]["activation"]["current"]
    with memory.category("activation"):
        y = checkpoint_sequential(model, segments, x)
    held = memory.stats(cpu_numpy())["by_category"]["activation"]["current"] - base
    assert held == segments * UNIT  # one output per region, nothing of the inside
    del y


def test_release_unsaved_is_bitwise_and_keeps_one_array_per_layer():
    model, x = _chain(6), _input()
    grads = []
    for lean in (False, True):
        for p in model.parameters():
            p.grad = None
        base = memory.stats(cpu_numpy())["by_category"]["activation"]["current"]
        with memory.category("activation"):
            if lean:
                with release_unsaved():
                    y = model(x)
            else:
                y = model(x)
        held = memory.stats(cpu_numpy())["by_category"]["activation"]["current"] - base
        # lean: the relu outputs only (saved by ReLU and by the next matmul). The plain graph
        # releases unsaved outputs too (needle/autograd/release.py), one op late: the last
        # bias-add output was still named by ReLU.forward when the last op was recorded.
        assert held == (6 if lean else 6 + 1) * UNIT
        if not lean:
            sweep(final=True)  # what backward() does first
            now = memory.stats(cpu_numpy())["by_category"]["activation"]["current"] - base
            assert now == 6 * UNIT
        y.sum().backward()
        del y
        grads.append([p.grad.numpy() for p in model.parameters()])
    for a, b in zip(*grads, strict=False):
        np.testing.assert_array_equal(a, b)


def _experiment():
    spec = importlib.util.spec_from_file_location(
        "checkpoint_experiment", ROOT / "apps" / "checkpoint_experiment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_experiment_table_at_small_size(tmp_path):
    exp = _experiment()
    layers = 16
    rows = exp.run_experiment(layers=layers, width=WIDTH, batch=BATCH, device=cpu_numpy())
    assert [r["config"] for r in rows] == ["plain", "release_unsaved", 1, 2, 4, 8, 16]
    ck = [r for r in rows if r["segments"]]
    for r in ck:
        assert r["model_units"] == layers / r["segments"] + r["segments"]
        # the model plus at most the recomputed layer's two pre-activation temporaries and
        # the scalar loss
        assert 0 <= r["peak_units"] - r["model_units"] <= 3
    assert min(ck, key=lambda r: r["peak_bytes"])["segments"] == 4  # √16
    plain, lean = rows[0], rows[1]
    # the plain graph now releases unsaved outputs itself: as lean as release_unsaved()
    assert layers <= plain["peak_units"] <= layers + 3 and lean["peak_units"] <= layers + 3
    text = exp.format_table(rows, UNIT)
    assert len(text.splitlines()) == 2 + len(rows)
    exp.plot(rows, str(tmp_path / "plot.png"), "test")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_boundaries_go_with_the_graph_while_the_caller_keeps_the_output():
    """A region's saved boundary is freed by backward (no retain_graph) like any saved tensor,
    even though the caller still holds the region's output (its node)."""
    model, x = _chain(6), _input()
    base = memory.stats(cpu_numpy())["by_category"]["activation"]["current"]
    with memory.category("activation"):
        y = checkpoint_sequential(model, 3, x)
    y.backward(Tensor(np.ones(y.shape, "float32"), device=cpu_numpy(), requires_grad=False))
    held = memory.stats(cpu_numpy())["by_category"]["activation"]["current"] - base
    assert held == UNIT  # y itself: the last region's input (segment 1's output) is gone
    with pytest.raises(Exception, match="freed"):
        y.backward(Tensor(np.ones(y.shape, "float32"), device=cpu_numpy()))
    del y
