"""The memory reports' text: every op, line and shape is named (no "None"), columns line up;
the profile plot's x axis counts events or seconds."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle.memory import cli
from needle.memory._errors import MemoryArgumentError
from needle.memory._text import columns
from needle.memory.explain import explain
from needle.memory.profile_report import build_report, plot_report, save_report
from needle.memory.profiler import profile


def _step(device):
    kept = ndl.Tensor(np.ones((16, 8), dtype=np.float32), device=device)  # before the profile

    def step():
        fresh = ndl.Tensor(np.ones((16, 8), dtype=np.float32), device=device)  # outside ops
        (kept * fresh + 1).sum().backward()

    return step


def _table(lines: list[str], header_start: str) -> list[str]:
    """The header starting with ``header_start`` and the rows under it (same indent)."""
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith(header_start))
    indent = len(lines[at]) - len(lines[at].lstrip())
    rows = [lines[at]]
    for ln in lines[at + 1:]:
        if len(ln) - len(ln.lstrip()) < indent or not ln.strip() or ln.strip().endswith(":"):
            break
        rows.append(ln)
    return rows


def _assert_aligned(rows: list[str], names: list[str]) -> None:
    """Each named column (left-aligned) starts at its header's offset on every row."""
    header = rows[0]
    for name in names:
        start = header.index("  " + name) + 2
        for row in rows[1:]:
            assert row[start - 2:start] == "  " and row[start] != " ", (name, rows)
    assert len(rows) > 1


def test_the_profile_summary_names_everything_and_aligns_its_columns():
    device = ndl.cpu_numpy()
    step = _step(device)
    with profile(device) as prof:
        step()
    text = cli._profile_summary(prof.report())
    assert "None" not in text
    assert "(outside any op)" in text and "(before the profile)" in text
    lines = text.splitlines()
    _assert_aligned(_table(lines, "bytes"), ["category", "shape", "op", "line"])
    _assert_aligned(_table(lines, "phase"), ["op", "line"])
    _assert_aligned(_table(lines, "category"), [])


def test_explain_names_everything_and_aligns_its_columns():
    device = ndl.cpu_numpy()
    text = str(explain(_step(device), device=device))
    assert "None" not in text and "(before the profile)" in text
    lines = text.splitlines()
    _assert_aligned(_table(lines, "requested"), ["category", "shape", "op", "line",
                                                  "lifetime", "freed by"])
    figures = [ln for ln in lines[1:] if ln.endswith(" B") and ln.startswith("  ") and
               not ln.startswith("    ")]
    assert len(figures) == 9 and len({len(ln) for ln in figures}) == 1  # right-aligned bytes


def test_columns_pads_every_cell_to_its_column():
    assert columns([["op", "bytes"], ["EWiseAdd", "512"], ["(outside any op)", "4"]],
                   right=[1]) == ["op                bytes",
                                  "EWiseAdd            512",
                                  "(outside any op)      4"]


def _drawn(monkeypatch, report_device: dict, x_axis: str, tmp_path) -> tuple[str, tuple]:
    """The x label and x limits of the plot as it is saved."""
    import matplotlib.figure

    seen = {}
    original = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        ax = fig.axes[0]
        seen.update(label=ax.get_xlabel(), xlim=ax.get_xlim())
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plot_report(report_device, tmp_path / f"{x_axis}.png", x_axis=x_axis)
    assert (tmp_path / f"{x_axis}.png").stat().st_size > 0
    return seen["label"], seen["xlim"]


def test_the_profile_plot_has_an_event_or_a_time_axis(monkeypatch, tmp_path):
    device = ndl.cpu_numpy()
    with profile(device) as prof:
        _step(device)()
    dev = build_report(prof)["devices"]["cpu_numpy"]
    label, xlim = _drawn(monkeypatch, dev, "event", tmp_path)
    assert label.startswith("allocator event") and xlim[1] == dev["timeline"]["x"][-1]
    label, xlim = _drawn(monkeypatch, dev, "time", tmp_path)
    assert label == "seconds since the profile opened"
    assert xlim[1] == pytest.approx(dev["timeline"]["time_s"][-1])
    with pytest.raises(MemoryArgumentError, match="expected one of event, time, got 'steps'"):
        save_report(prof, tmp_path / "bad", x_axis="steps")


def test_the_command_line_takes_the_plot_axis():
    args = cli.parse(["profile", "--plot-x", "time", "script.py"])
    assert args.plot_x == "time" and cli.parse(["profile", "script.py"]).plot_x == "event"
    with pytest.raises(SystemExit):
        cli.parse(["profile", "--plot-x", "steps", "script.py"])
