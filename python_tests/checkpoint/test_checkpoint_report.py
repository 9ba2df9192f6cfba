"""checkpoint_report / python -m needle.memory checkpoint-report: one table per policy."""
from __future__ import annotations

import json

import numpy as np
import pytest

import needle as ndl
from needle import nn
from needle.autograd import Tensor
from needle.checkpoint import checkpoint_report, measure_layer_costs, plan_checkpoints
from needle.memory import cli

B, W, N = 32, 128, 10


def _layers(device, dropout=0.0):
    np.random.seed(0)
    out = []
    for _ in range(N):
        mods = [nn.Linear(W, W, device=device), nn.ReLU()]
        if dropout:
            mods.append(nn.Dropout(dropout))
        out.append(nn.Sequential(*mods))
    return out


@pytest.mark.parametrize("device", [ndl.cpu_numpy()] + ([ndl.cpu()] if ndl.cpu().enabled()
                                                        else []), ids=str)
def test_report_rows_predicted_equals_measured_and_counts_the_recomputation(device):
    layers = _layers(device)
    x = Tensor(np.random.RandomState(0).randn(B, W).astype("float32"), device=device,
               requires_grad=False)
    costs = measure_layer_costs(layers, x)
    top = plan_checkpoints(costs, memory_budget=10**12).predicted_peak_bytes
    plan = plan_checkpoints(costs, memory_budget=top - 2 * costs[0].output)
    rep = checkpoint_report(layers, x, [2, N, plan])
    plain, two, every = rep.rows[:3]
    for row in rep.rows:  # the documented agreement: exact, in allocator blocks
        assert row.predicted_peak == row.measured_peak, row
    assert plain.recomputed == plain.extra_flops == plain.draws_replayed == 0
    assert plain.saved == N and plain.bytes_saved == 0  # one ReLU output per layer
    assert two.saved == 2 and every.saved == N  # the boundaries each region keeps
    assert two.bytes_saved == (N - 2) * costs[0].output
    # everything is recomputed: per layer a matmul (2BW^2), the bias add and the ReLU (BW each)
    per_layer = 2 * B * W * W + 2 * B * W
    assert two.extra_flops == every.extra_flops == N * per_layer
    # x@W (+b added into it straight from the bias row) and the relu of every layer, again
    assert two.recomputed == 2 * N
    assert rep.rows[3].policy.startswith("plan ") and rep.rows[3].recomputed < two.recomputed


def test_dropout_draws_are_replayed_once_per_recomputed_layer():
    d = ndl.cpu_numpy()
    layers = _layers(d, dropout=0.25)
    x = Tensor(np.ones((B, W), "float32"), device=d, requires_grad=False)
    rep = checkpoint_report(layers, x, [3])
    assert rep.rows[0].draws_replayed == 0 and rep.rows[1].draws_replayed == N
    assert rep.rows[1].predicted_peak == rep.rows[1].measured_peak


def test_cli_checkpoint_report_writes_its_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = cli.main(["checkpoint-report", "--layers", "4", "--width", "64", "--batch", "16",
                   "--segments", "2", "--budget", "0.05", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "pred. MiB" in text and "meas. MiB" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows][:2] == ["plain", "2 segments"]
    assert all(r["predicted_peak"] == r["measured_peak"] for r in rows)
    assert cli.main(["checkpoint-report", "--layers", "4", "--budget", "0.0001"]) == 2
    assert "no segmentation fits the budget" in capsys.readouterr().err
