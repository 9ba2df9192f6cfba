"""Progress output under the launcher: bars on rank 0 only, plain lines elsewhere."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from needle.distributed.progress import (
    PlainProgress,
    ProgressSettingError,
    progress_bar,
    rank_from_env,
)

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]


def _run(rank: int, enabled: bool) -> tuple[object, str]:
    out = io.StringIO()
    bar = progress_bar(total=20, desc="train", enabled=enabled, rank=rank, file=out)
    for step in range(20):
        bar.set_postfix(loss=f"{1.0 / (step + 1):.3f}")
        bar.update(1)
    bar.write("epoch 0: loss 0.050")
    bar.close()
    return bar, out.getvalue()


def test_rank_zero_draws_a_bar() -> None:
    bar, text = _run(0, True)
    assert not isinstance(bar, PlainProgress)
    assert "\r" in text and "train: 100%" in text and "20/20" in text
    assert "epoch 0: loss 0.050\n" in text


def test_other_ranks_are_quiet_by_default() -> None:
    bar, text = _run(1, True)
    assert isinstance(bar, PlainProgress) and text == ""


def test_a_bad_progress_ranks_setting_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("NEEDLE_PROGRESS_RANKS", "first")
    with pytest.raises(ProgressSettingError, match="expected 'all' or ranks like '0,1', got "
                                                    "'first'"):
        progress_bar(total=2, rank=1)


def test_other_ranks_log_plain_lines_when_asked(monkeypatch) -> None:
    monkeypatch.setenv("NEEDLE_PROGRESS_RANKS", "0,1")
    bar, text = _run(1, True)
    assert isinstance(bar, PlainProgress) and "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "train: 2/20 (10%) loss=0.500"  # after step 2 (loss 1/2)
    assert lines[-1] == "train: 20/20 (100%) loss=0.050"
    assert len(lines) == 10  # ten checkpoints over the run, and no summary (rank 0 prints it)


def test_without_progress_only_summaries_print() -> None:
    assert _run(0, False)[1] == "epoch 0: loss 0.050\n"
    assert _run(1, False)[1] == ""
    out = io.StringIO()
    progress_bar(total=2, enabled=False, rank=1, file=out).write("rank 1 says", all_ranks=True)
    assert out.getvalue() == "rank 1 says\n"


def test_wraps_an_iterable_and_reads_the_rank_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("NEEDLE_PROGRESS_RANKS", "all")
    assert rank_from_env() == 2
    out = io.StringIO()
    bar = progress_bar(range(4), desc="eval", lines=2, file=out)
    assert list(bar) == [0, 1, 2, 3]
    assert out.getvalue() == "eval: 2/4 (50%)\neval: 4/4 (100%)\n"


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_under_the_launcher_only_rank_zero_draws(backend: str) -> None:
    """To a pipe: the bar's last frame only, one line; rank 1's lines with --progress-ranks
    (tcp), none without (mpi). The terminal's side: test_launch_output.py."""
    shown = ["--progress-ranks", "all"] if backend == "tcp" else []
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", "2", "--backend", backend,
           *shown, "--timeout", "120", str(SCRIPTS / "progress_demo.py")]
    out = subprocess.run(cmd, capture_output=True, timeout=150, cwd=ROOT)
    text = out.stdout.decode()
    assert out.returncode == 0, text[-3000:] + out.stderr.decode()[-2000:]
    assert "\r" not in text
    pieces = text.splitlines()
    rank0 = [p for p in pieces if p.startswith("[rank 0]")]
    rank1 = [p for p in pieces if p.startswith("[rank 1]")]
    assert len(rank0) == 2 and "[rank 0] epoch summary: loss 0.12" in rank0
    assert "100%|" in rank0[1 - rank0.index("[rank 0] epoch summary: loss 0.12")]
    assert not any("%|" in p for p in rank1)  # rank 1 draws no bar
    if shown:
        assert rank1 == ["[rank 1] steps: 2/8 (25%) loss=0.50", "[rank 1] steps: 4/8 (50%) "
                         "loss=0.25", "[rank 1] steps: 6/8 (75%) loss=0.17",
                         "[rank 1] steps: 8/8 (100%) loss=0.12"]
    else:
        assert rank1 == []


def test_under_the_launcher_the_bar_shares_stdout_with_the_lines(monkeypatch, capsys) -> None:
    """mpiexec forwards stdout and stderr apart: a bar on stderr could land after the line
    printed once it closed."""
    monkeypatch.setenv("NEEDLE_LAUNCH_RANK", "0")
    bar = progress_bar(total=2, desc="steps", rank=0)
    bar.update(2)
    bar.close()
    print("epoch 1")
    out, err = capsys.readouterr()
    assert err == "" and "steps: 100%" in out and out.endswith("\nepoch 1\n")
