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


# ---- recompute overhead R/(F+B): the lecture's uniform chain ---------------------------------
def _course_chain(n=16, width=32, batch=8):
    """n bias-free Linear layers (one matmul each: backward is two, dX and dW, so B = 2F),
    on an input that needs a gradient (the chain is a piece of a network)."""
    d = ndl.cpu_numpy()
    np.random.seed(0)
    layers = [nn.Linear(width, width, bias=False, device=d) for _ in range(n)]
    x = Tensor(np.random.RandomState(1).randn(batch, width).astype("float32"), device=d,
               requires_grad=True)
    return layers, x


def check_course_overheads(rows) -> None:
    """Plain 0; every layer and sqrt(N) recompute one forward: R/(F+B) = 1/3, R/(F+B+R) =
    1/4; sqrt(N) with the last of its 4 segments stored recomputes 3/4 of it: 1/4 and 1/5."""
    from fractions import Fraction as Q

    want = {"plain": (0, 0), "every layer": (Q(1, 3), Q(1, 4)),
            "sqrt: 4 segments": (Q(1, 3), Q(1, 4)),
            "sqrt: 4 segments, last stored": (Q(1, 4), Q(1, 5))}
    assert [r.policy for r in rows] == list(want)
    f = rows[0].forward_flops
    for r in rows:
        assert r.forward_flops == f and r.backward_flops == 2 * f, r  # B = 2F in every row
        got = (Q(r.extra_flops, f + r.backward_flops),
               Q(r.extra_flops, f + r.backward_flops + r.extra_flops))
        assert got == want[r.policy], (r.policy, got)
        assert r.overhead == pytest.approx(float(got[0]))
        assert r.recompute_share == pytest.approx(float(got[1]))


def test_course_chain_recompute_overhead_is_one_third_and_its_share_one_quarter():
    layers, x = _course_chain()
    rep = checkpoint_report(layers, x, ["every-layer", "sqrt", "sqrt-last-stored"], repeats=1)
    check_course_overheads(rep.rows)
    # 2·8·32·32 FLOPs per matmul, 16 layers
    assert rep.rows[0].forward_flops == 16 * 2 * 8 * 32 * 32
    # measured (wall time): printed, asserted only to exist where something is recomputed
    assert rep.rows[0].measured_overhead == 0.0
    assert all(r.recompute_s > 0 and r.measured_overhead > 0 for r in rep.rows[1:])
    text = str(rep)
    assert "R/(F+B)" in text and "=1/3" in text and "=1/4" in text and "=1/5" in text


def test_planted_backward_counted_as_one_forward_fails_the_course_numbers(monkeypatch):
    from needle.checkpoint import report

    real = report.grad_flops

    def planted(name, input_shapes, needs, output_shape):  # the mistake: B = 1x F
        return real(name, input_shapes, [any(needs)] + [False] * (len(needs) - 1),
                    output_shape)

    monkeypatch.setattr(report, "grad_flops", planted)
    layers, x = _course_chain()
    rows = checkpoint_report(layers, x, ["every-layer", "sqrt", "sqrt-last-stored"],
                             repeats=0).rows
    with pytest.raises(AssertionError):
        check_course_overheads(rows)


def test_planted_last_segment_recomputed_fails_the_course_numbers(monkeypatch):
    from needle.checkpoint import report

    real = report._policy

    def planted(policy, n):  # the mistake: the stored last segment recomputed anyway
        name, segments, flags = real(policy, n)
        if policy == "sqrt-last-stored":
            flags = (True,) * len(flags)
        return name, segments, flags

    monkeypatch.setattr(report, "_policy", planted)
    layers, x = _course_chain()
    rows = checkpoint_report(layers, x, ["every-layer", "sqrt", "sqrt-last-stored"],
                             repeats=0).rows
    with pytest.raises(AssertionError):
        check_course_overheads(rows)


def test_backward_flop_rules():
    from needle.checkpoint.report import grad_flops

    m, k, n = 8, 16, 4
    assert grad_flops("MatMul", [(m, k), (k, n)], [True, True], (m, n)) == 2 * 2 * m * k * n
    assert grad_flops("MatMul", [(m, k), (k, n)], [False, True], (m, n)) == 2 * m * k * n
    # a linear layer on an input without gradient: dW and the bias's sum over the rows
    assert grad_flops("FusedLinear", [(m, k), (k, n), (n,)], [False, True, True],
                      (m, n)) == 2 * m * k * n + m * n
    assert grad_flops("ReLU", [(m, n)], [True], (m, n)) == m * n
    assert grad_flops("EWiseMul", [(m, n), (m, n)], [True, True], (m, n)) == 2 * m * n
    assert grad_flops("BroadcastTo", [(1, n)], [True], (m, n)) == m * n
    assert grad_flops("Reshape", [(m, n)], [True], (n, m)) == 0
    assert grad_flops("Summation", [(m, n)], [True], (n,)) == 0
    assert grad_flops("ReLU", [(m, n)], [False], (m, n)) == 0


def test_cli_course_prints_one_third_and_one_quarter(capsys):
    rc = cli.main(["checkpoint-report", "--course", "--layers", "16", "--width", "16",
                   "--batch", "4", "--repeats", "1"])
    assert rc == 0
    text = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in text.splitlines()
             if "GFLOP" not in line}
    assert "0.3333 =1/3" in lines["every layer"] and "0.2500 =1/4" in lines["every layer"]
    assert "0.2500 =1/4" in lines["sqrt: 4 segments, last stored"]
