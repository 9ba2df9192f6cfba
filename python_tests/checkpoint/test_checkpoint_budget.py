"""Budget plans hold when run: the measured activation peak equals the predicted one, <= budget.

The issue this guards: plans from plain per-layer output sizes promised 12/16/24 units and took
14/18/26 (temporaries of the recomputed layer), and 30/44/70 for activations small enough that
autograd keeps every intermediate. With measured :class:`LayerCost` the model sees both.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import needle as ndl
import needle.memory as memory
from needle import nn
from needle._core.errors import MemoryPlanError
from needle.autograd import Tensor, release
from needle.checkpoint import checkpoint_sequential, measure_layer_costs, plan_checkpoints

DEVICES = [ndl.cpu_numpy()] + ([ndl.cpu()] if ndl.cpu().enabled() else [])
LAYERS = 12


def _chain(kind, width, device):
    np.random.seed(0)
    if kind == "blocks":  # a layer = Linear + ReLU
        return [nn.Sequential(nn.Linear(width, width, device=device), nn.ReLU())
                for _ in range(LAYERS)]
    return [m for _ in range(LAYERS // 2)  # a layer = one module
            for m in (nn.Linear(width, width, device=device), nn.ReLU())]


def _measured_peak(layers, plan, x):
    """Activation peak of forward + backward of the plan, above what existed before."""
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    with memory.category("other"):
        seed = Tensor(np.ones(x.shape, "float32"), device=x.device, requires_grad=False)
    gc.collect()
    memory.reset_peak(x.device)
    base = memory.stats(x.device)["by_category"]["activation"]["current"]
    y = checkpoint_sequential(layers, plan, x)
    y.backward(seed)
    del y
    return memory.stats(x.device)["by_category"]["activation"]["peak"] - base


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("kind", ["blocks", "modules"])
@pytest.mark.parametrize("batch, width, threshold", [(64, 512, 16384), (16, 64, 16384)],
                         ids=["large", "small"])  # small: under autograd's release threshold
def test_measured_peak_of_budget_plans_is_the_predicted_one(device, kind, batch, width,
                                                            threshold, monkeypatch):
    monkeypatch.setattr(release, "RELEASE_MIN_ELEMENTS", threshold)  # the library default
    layers = _chain(kind, width, device)
    x = Tensor(np.random.RandomState(1).randn(batch, width).astype("float32"), device=device,
               requires_grad=False)
    costs = measure_layer_costs(layers, x)
    top = plan_checkpoints(costs, memory_budget=10**12).predicted_peak_bytes  # no recompute
    unit = costs[0].output
    plans = []
    for k in range(0, 4 * LAYERS):  # budgets one layer output apart, down to the least peak
        budget = top - k * unit // 2
        try:
            plan = plan_checkpoints(costs, memory_budget=budget)
        except MemoryPlanError:
            break
        measured = _measured_peak(layers, plan, x)
        assert measured <= budget, (budget, plan)
        assert measured == plan.predicted_peak_bytes, (budget, plan)
        plans.append(plan)
    assert len(plans) >= 3 and sum(any(p.checkpointed) for p in plans) >= 2


def test_plain_output_sizes_do_not_see_the_temporaries():
    """Why the costs are measured: the lecture's proxy (output bytes only) underestimates."""
    layers = _chain("blocks", 512, ndl.cpu_numpy())
    x = Tensor(np.ones((64, 512), "float32"), device=ndl.cpu_numpy(), requires_grad=False)
    unit = 64 * 512 * 4
    proxy = plan_checkpoints([unit] * LAYERS, memory_budget=8 * unit)
    assert _measured_peak(layers, proxy, x) > proxy.predicted_peak_bytes
    measured = plan_checkpoints(measure_layer_costs(layers, x), memory_budget=8 * unit)
    assert _measured_peak(layers, measured, x) <= 8 * unit


def test_measured_costs_of_a_linear_relu_block():
    d = ndl.cpu_numpy()
    layers = _chain("blocks", 512, d)
    x = Tensor(np.ones((64, 512), "float32"), device=d, requires_grad=False)
    unit = 64 * 512 * 4
    c = measure_layer_costs(layers, x)
    # keeps its ReLU output (saved by ReLU and by the next layer); while running, one more
    # unit: x@W + b (+b added into x@W from the bias row) beside the ReLU output (released
    # as the next layer's first op starts, before it allocates)
    assert [(k.output, k.kept, k.working, k.keeps_output) for k in c[1:-1]] == \
        [(unit, unit, 2 * unit, True)] * (LAYERS - 2)
