"""Progress output under the launcher: bars on rank 0 only, plain lines elsewhere."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from needle.distributed.progress import PlainProgress, progress_bar, rank_from_env

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


def test_other_ranks_log_plain_lines() -> None:
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
    assert rank_from_env() == 2
    out = io.StringIO()
    bar = progress_bar(range(4), desc="eval", lines=2, file=out)
    assert list(bar) == [0, 1, 2, 3]
    assert out.getvalue() == "eval: 2/4 (50%)\neval: 4/4 (100%)\n"


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_under_the_launcher_only_rank_zero_draws(backend: str) -> None:
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", "2", "--backend", backend,
           "--timeout", "120", str(SCRIPTS / "progress_demo.py")]
    out = subprocess.run(cmd, capture_output=True, timeout=150, cwd=ROOT)
    text = out.stdout.decode()
    assert out.returncode == 0, text[-3000:] + out.stderr.decode()[-2000:]
    pieces = text.replace("\r", "\n").splitlines()
    rank0 = [p for p in pieces if p.startswith("[rank 0]")]
    rank1 = [p for p in pieces if p.startswith("[rank 1]")]
    assert "\r[rank 0] " in text  # the bar redraws in place, each piece prefixed
    assert any("%|" in p for p in rank0)  # a tqdm bar
    assert not any("%|" in p for p in rank1)  # rank 1 draws no bar
    assert "[rank 1] steps: 8/8 (100%) loss=0.12" in rank1
    assert "[rank 0] epoch summary: loss 0.12" in rank0
    assert not any("summary" in p for p in rank1)
