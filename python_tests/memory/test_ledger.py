"""The ledger reproduces the published worked examples, and compare() explains differences."""
from __future__ import annotations

import math

import numpy as np
import pytest

from needle._core.errors import NeedleError
from needle.memory.caching_allocator import CachingAllocator
from needle.memory.categories import CATEGORIES, category
from needle.memory.ledger import compare, estimate

EXAMPLE = dict(batch_shape=(2, 128), width=64, num_layers=4, activation_arrays_per_layer=10)


def test_one_million_parameters_mixed_adam():
    led = estimate(num_params=1_000_000, margin=0)
    assert [(r.term, r.bytes) for r in led.rows[:4]] == [
        ("working weights", 2_000_000), ("gradients", 2_000_000),
        ("master weights", 4_000_000), ("optimizer moments", 8_000_000)]
    assert led.model_state_bytes == 16_000_000


def test_activations_and_margin_of_the_worked_example():
    led = estimate(num_params=1_000_000, **EXAMPLE)
    assert led.activation_bytes == 1_310_720 == 2 * 128 * 64 * 4 * 10 * 2
    assert led.subtotal_bytes == 17_310_720
    assert led["margin"] == 17_310_720 // 4
    assert led.total_bytes == 21_638_400


def test_optimizer_state_sharding_over_four_workers():
    led = estimate(num_params=1_000_000, zero_stage=1, dp=4, **EXAMPLE)
    assert led.model_state_bytes == 7_000_000
    assert led.subtotal_bytes == 8_310_720
    # Gradients sharded too: 2 + 14/4 = 5.5 MB; everything sharded: 16/4 = 4 MB.
    assert estimate(num_params=1_000_000, zero_stage=2, dp=4).model_state_bytes == 5_500_000
    assert estimate(num_params=1_000_000, zero_stage=3, dp=4).model_state_bytes == 4_000_000


def test_zero_stage_2_keeps_weights_whole_and_shards_gradients_by_category():
    # Weights and gradients differ in bytes here, so a ledger that swapped their categories
    # (or their rows) is caught: 4 B x 1000 weights whole, 4 B x 1000 / 4 gradients.
    led = estimate(num_params=1000, precision="fp32", optimizer="sgd", zero_stage=2, dp=4,
                   margin=0)
    assert [(r.term, r.bytes, r.category) for r in led.rows] == [
        ("working weights", 4000, "weight"), ("gradients", 1000, "gradient"),
        ("master weights", 0, "master"), ("optimizer moments", 0, "optimizer"),
        ("activations", 0, "activation"), ("margin", 0, None)]
    cats = led.by_category()
    assert (cats["weight"], cats["gradient"], cats["optimizer"], cats["activation"]) == \
        (4000, 1000, 0, 0)
    assert sum(cats.values()) == led.total_bytes == 5000


def test_seventy_billion_parameters():
    assert estimate(num_params=70_000_000_000).model_state_bytes == 1_120_000_000_000  # 1.12 TB
    led = estimate(num_params=70_000_000_000, zero_stage=3, dp=64)
    assert led.model_state_bytes == 17_500_000_000  # 17.5 GB per GPU


def test_exercises_of_the_chapters():
    # ZeRO-1, 7 B parameters on 8 GPUs: 4 bytes full + 12/8 bytes sharded = 38.5 GB.
    assert estimate(num_params=7_000_000_000, zero_stage=1, dp=8).model_state_bytes == \
        38_500_000_000
    # Doubling the micro-batch doubles activations: 2,621,440; with state 18,621,440.
    led = estimate(num_params=1_000_000, **{**EXAMPLE, "batch_shape": (4, 128)})
    assert (led.activation_bytes, led.subtotal_bytes) == (2_621_440, 18_621_440)
    # Checkpointing keeps 4 arrays per layer: 524,288.
    led = estimate(num_params=1_000_000, **{**EXAMPLE, "activation_arrays_per_layer": 4})
    assert led.activation_bytes == 524_288


def test_fp32_and_optimizers_bytes_per_parameter():
    n = 1000
    per_param = {("fp32", "adam"): 4 + 4 + 0 + 8, ("fp32", "sgd"): 8,
                 ("fp32", "sgd_momentum"): 12, ("mixed", "sgd"): 2 + 2 + 4}
    for (precision, opt), b in per_param.items():
        led = estimate(num_params=n, precision=precision, optimizer=opt, margin=0)
        assert led.model_state_bytes == b * n, (precision, opt)
    led = estimate(num_params=n, precision="fp32", **EXAMPLE)
    assert led.activation_bytes == 2 * 128 * 64 * 4 * 10 * 4


def test_tensor_and_pipeline_parallel_divide_state_and_layers():
    n = 70_000_000_000
    led = estimate(num_params=n, tp=8, pp=4, dp=32, zero_stage=1, batch_shape=(1, 4096),
                   width=8192, num_layers=80, activation_arrays_per_layer=10, margin=0)
    per_gpu = n / 32  # parameters on one tensor/pipeline shard
    assert led.model_state_bytes == math.ceil(4 * per_gpu + 12 * per_gpu / 32)
    assert led.activation_bytes == 4096 * 8192 * (80 // 4) * 10 * 2


def test_uneven_shards_round_up():
    led = estimate(num_params=10, zero_stage=3, dp=3, margin=0)
    assert led["working weights"] == math.ceil(20 / 3)
    assert led["optimizer moments"] == math.ceil(80 / 3)


class _Param:
    def __init__(self, shape):
        self.shape = shape


class _Model:
    def parameters(self):
        return [_Param((784, 100)), _Param((100,)), _Param((100, 10)), _Param((10,))]


def test_model_parameters_are_counted():
    expected = sum(np.prod(s) for s in [(784, 100), (100,), (100, 10), (10,)])
    led = estimate(_Model(), precision="fp32", optimizer="sgd", margin=0)
    assert led.num_params == expected
    assert led.model_state_bytes == 8 * expected


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of model and num_params"),
    (dict(num_params=1, precision="fp8"), "precision"),
    (dict(num_params=1, optimizer="lion"), "optimizer"),
    (dict(num_params=1, zero_stage=4), "zero_stage"),
    (dict(num_params=1, dp=0), "dp"),
    (dict(num_params=1, margin=-0.1), "margin"),
    (dict(num_params=1, batch_shape=(2, 3)), "width"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(NeedleError, match=match):
        estimate(**kwargs)


def test_model_without_parameters_raises():
    with pytest.raises(NeedleError, match="parameters"):
        estimate(object())


def _measure_fp32_sgd_step(alloc, n_params, act_bytes):
    """Allocate what an fp32 momentum-SGD step holds, with per-category requested bytes."""
    with category("weight"):
        w = alloc.allocate(4 * n_params)
    with category("activation"):
        acts = [alloc.allocate(act_bytes // 2) for _ in range(2)]
    with category("gradient"):
        g = alloc.allocate(4 * n_params)
    with category("workspace"):
        alloc.allocate(3000).release()
    for a in acts:
        a.release()
    with category("optimizer"):
        u = alloc.allocate(4 * n_params)
    return [w, g, u]


def test_compare_with_measured_allocator():
    n_params, act_bytes = 1000, 10_000
    alloc = CachingAllocator("cmp")
    live = _measure_fp32_sgd_step(alloc, n_params, act_bytes)
    led = estimate(num_params=n_params, precision="fp32", optimizer="sgd_momentum",
                   activation_bytes=act_bytes)
    cmp = compare(led, alloc.stats())
    block = max(512, -(-4 * n_params // 512) * 512)
    w = cmp.row("weight")
    assert (w.estimated, w.measured_peak, w.rounding, w.residual) == (4000, block, block - 4000, 0)
    assert w.explanation == "allocator rounding to 512 B blocks"
    act = cmp.row("activation")
    assert act.measured_peak == 2 * max(512, -(-5000 // 512) * 512) and act.residual == 0
    ws = cmp.row("workspace")
    assert (ws.estimated, ws.measured_peak, ws.rounding, ws.residual) == (0, 3072, 72, 3000)
    assert ws.explanation.startswith("not estimated")
    peak = cmp.row("peak (all at once)")
    assert peak.measured_peak == alloc.stats()["peak_bytes"]
    summed = cmp.row("sum of category peaks")
    assert summed.measured_peak == sum(cmp.row(c).measured_peak for c in CATEGORIES)
    assert cmp.row("estimate with margin").explanation == "within the margin"
    assert "allocator rounding" in str(cmp)
    for b in live:
        b.release()


def test_compare_residual_signs():
    led = estimate(num_params=100, precision="fp32", optimizer="sgd", margin=0)
    stats = {"peak_bytes": 0, "peak_requested_bytes": 0, "by_category": {
        c: {"current": 0, "peak": 0, "current_requested": 0, "peak_requested": 0}
        for c in CATEGORIES}}
    stats["by_category"]["weight"].update(peak=1024, peak_requested=600)   # more than 400
    stats["by_category"]["gradient"].update(peak=512, peak_requested=200)  # less than 400
    cmp = compare(led, stats)
    assert cmp.row("weight").residual == 200
    assert cmp.row("weight").explanation.startswith("temporaries")
    assert cmp.row("gradient").residual == -200
    assert cmp.row("gradient").explanation.startswith("estimated bytes never live")
    assert cmp.row("optimizer").explanation == "exact"
