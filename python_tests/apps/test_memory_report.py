"""apps/memory_report.py: the estimate beside the measurement for the built-in models."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import memory_report as cli
import pytest


def test_cli_report_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    png = tmp_path / "step.png"
    rc = cli.main(["--model", "mlp_resnet", "--batch-size", "16", "--input-dim", "32",
                   "--hidden-dim", "16", "--num-blocks", "1", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("weight", "gradient", "optimizer_temp", "activation (end of forward)",
                 "reconciliation"):
        assert word in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_report_on_the_cpp_allocator(capsys):
    """The C++ allocator reports the same table, with its own event log merged in."""
    rc = cli.main(["--model", "mlp", "--device", "cpu", "--batch-size", "4",
                   "--input-dim", "8", "--hidden-dim", "8", "--num-layers", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("weight", "gradient", "optimizer_temp", "activation (end of forward)",
                 "reconciliation"):
        assert word in out
    assert "timeline: 0 events" not in out


def test_model_state_report_single_process_mixed_and_accumulating(capsys):
    rc = cli.main(["--model", "mlp", "--device", "cpu", "--batch-size", "12", "--input-dim",
                   "8", "--hidden-dim", "8", "--num-layers", "1", "--precision", "fp16-mixed",
                   "--accumulate", "3", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out  # 0 only when every measured category equals the prediction
    n = 8 * 8 + 8 + 8 * 10 + 10
    assert f"{n:,} parameters, single on 1 rank(s), fp16-mixed" in out
    for cat, per_param in (("weight", 2), ("gradient", 2), ("master", 4), ("optimizer", 8)):
        row = next(line for line in out.splitlines() if f"  {cat} " in line)
        assert row.split()[2].replace(",", "") == str(per_param * n), row
        assert "differs" not in row


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_model_state_report_for_zero_ranks_through_the_memory_cli():
    """``python -m needle.memory report apps/memory_report.py --strategy zero ...`` starts the
    ranks and rank 0 prints every rank's predicted and measured bytes."""
    root = os.path.dirname(cli.__file__)
    cmd = [sys.executable, "-m", "needle.memory", "report", os.path.join(root,
           "memory_report.py"), "--model", "linear", "--input-dim", "40", "--hidden-dim", "10",
           "--strategy", "zero", "--zero-stage", "3", "--nproc", "2", "--precision",
           "fp16-mixed", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200,
                          cwd=os.path.dirname(root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if " total " in line]
    assert len(rows) == 2  # one per rank: 400 parameters, 2 + 2 + 4 + 8 bytes each, / 2
    for line in rows:
        predicted, measured = line.split()[4:6]
        assert predicted == measured == "3,200", line


ROWS = ("weight", "gradient", "optimizer", "optimizer_temp", "activation (end of forward)",
        "activation (peak)", "workspace", "other")


ROW = re.compile(r"^(.{30})\s*(\S+)\s+(\S+)\s+(\S+)\s+(exact|none|\+-\S+|<= \S+)\s+"
                 r"(ok|OUT OF TOLERANCE|not predicted)\s+=")


def table_rows(out: str) -> dict:
    """name -> (predicted, measured, gap, status) of the reconciliation table."""
    rows = {}
    for line in out[out.index("reconciliation"):].splitlines():
        match = ROW.match(line)
        if match and match.group(1).strip() in ROWS:
            name, predicted, measured, gap, _, status = match.groups()
            rows[name.strip()] = (predicted, int(measured.replace(",", "")), gap, status)
    return rows


def test_cli_report_rows_are_all_within_their_tolerance(capsys):
    rc = cli.main(["--model", "mlp_resnet", "--batch-size", "32", "--input-dim", "64",
                   "--hidden-dim", "32", "--num-blocks", "2", "--optimizer", "sgd_momentum"])
    out = capsys.readouterr().out
    assert rc == 0 and "OUT OF TOLERANCE" not in out
    rows = table_rows(out)
    assert sorted(rows) == sorted(ROWS)
    for name, (predicted, measured, gap, status) in rows.items():
        assert (gap, status) == ("0", "ok"), (name, out)  # cpu_numpy: every row exact
        assert int(predicted.replace(",", "")) == measured
    assert "shape-only trace of the step on cpu_numpy (no kernel ran)" in out


@pytest.mark.parametrize("model,optimizer", [("mlp_resnet", "adam"), ("mlp", "sgd"),
                                             ("linear", "sgd_momentum")])
@pytest.mark.parametrize("device", ["cpu", "cpu_numpy"])
def test_every_model_is_predicted_exactly_in_a_fresh_process(model, optimizer, device):
    """The command the docs give, as a user runs it: activations and the C++ kernels'
    scratch predicted before the step and equal to the measurement, byte for byte."""
    import needle as ndl

    if device == "cpu" and not ndl.cpu().enabled():
        pytest.skip("needs the compiled cpu() backend")
    root = os.path.dirname(os.path.dirname(cli.__file__))
    proc = subprocess.run([sys.executable, os.path.join(root, "apps", "memory_report.py"),
                           "--model", model, "--optimizer", optimizer, "--device", device],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = table_rows(proc.stdout)
    assert sorted(rows) == sorted(ROWS)
    for name, (_, _, gap, status) in rows.items():
        assert (gap, status) == ("0", "ok"), (name, proc.stdout)
    workspace = rows["workspace"][1]
    assert workspace > 0 if device == "cpu" else workspace == 0
