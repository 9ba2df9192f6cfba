"""apps/memory_report.py: the estimate beside the measurement for the built-in models."""
from __future__ import annotations

import memory_report as cli


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


def test_cli_report_rows_are_all_within_their_tolerance(capsys):
    rc = cli.main(["--model", "mlp_resnet", "--batch-size", "32", "--input-dim", "64",
                   "--hidden-dim", "32", "--num-blocks", "2", "--optimizer", "sgd_momentum"])
    out = capsys.readouterr().out
    assert rc == 0 and "OUT OF TOLERANCE" not in out
    table = out[out.index("reconciliation"):]
    rows = [line for line in table.splitlines() if line.split()[:1] and line.split()[0] in
            ("weight", "gradient", "optimizer", "optimizer_temp", "workspace", "other")]
    assert len(rows) == 6 and all(" ok " in line for line in rows)
