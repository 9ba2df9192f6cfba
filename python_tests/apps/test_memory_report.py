"""apps/memory_report.py: the estimate beside the measurement for the built-in models."""
from __future__ import annotations

import os
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


def test_cli_report_rows_are_all_within_their_tolerance(capsys):
    rc = cli.main(["--model", "mlp_resnet", "--batch-size", "32", "--input-dim", "64",
                   "--hidden-dim", "32", "--num-blocks", "2", "--optimizer", "sgd_momentum"])
    out = capsys.readouterr().out
    assert rc == 0 and "OUT OF TOLERANCE" not in out
    table = out[out.index("reconciliation"):]
    rows = [line for line in table.splitlines() if line.split()[:1] and line.split()[0] in
            ("weight", "gradient", "optimizer", "optimizer_temp", "workspace", "other")]
    assert len(rows) == 6 and all(" ok " in line for line in rows)
