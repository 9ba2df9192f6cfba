"""bench/gpu_check.sh without a GPU: its steps, its time budget and its summary table.

``DRY_RUN=1`` lists the steps with their budgets on a simulated clock (each step takes its
whole budget), so the deadline arithmetic is checked by counts. A fake ``PYTHON`` that
answers like the benches and pytest (``RESULT`` lines, a pytest tally, "no tests ran") runs
the real step machinery in a second and fills the summary table.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
REQUIRED = ("env", "build", "cuda_available", "test_cuda_backend", "compiled_equality",
            "graph_replay", "nccl", "bench_gpu", "cuda_host_time", "gpu_profile",
            "test_suite_cuda")
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def _run(out: Path, **env) -> tuple[int, list[list[str]]]:
    full = {**os.environ, "PYTHON": "python3", **env}
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], env=full, capture_output=True,
                          text=True, timeout=120)
    table = (out / "summary.md").read_text()
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")]
            for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == ["step", "status", "seconds", "limit", "key numbers"], table
    return proc.returncode, rows[1:]


def test_dry_run_lists_every_step_within_eight_minutes(tmp_path):
    rc, rows = _run(tmp_path, DRY_RUN="1")
    assert rc == 0
    assert tuple(r[0] for r in rows) == REQUIRED
    assert {r[1] for r in rows} == {"DRY"}
    budgets = dict(re.findall(r"^step (\w+) (\d+) ", SCRIPT.read_text(), re.MULTILINE))
    assert sum(int(b) for b in budgets.values()) <= 480  # every budget fits the deadline
    assert all(r[3] == budgets[r[0]] for r in rows)  # so none was cut
    commands = {r[0]: r[4] for r in rows}
    for test_file in ("test_cuda_backend.py", "test_cuda_launch.py", "test_cuda_reductions.py"):
        assert test_file in commands["test_cuda_backend"]
    assert "test_graph_replay_device.py" in commands["graph_replay"]
    assert "test_nccl_device.py" in commands["nccl"]
    assert "-k cuda" in commands["test_suite_cuda"]
    assert "bench/gpu_equality.py" in commands["compiled_equality"]
    for bench in ("bench_gpu", "cuda_host_time", "gpu_profile"):
        assert f"bench/{bench}.py" in commands[bench]


def test_the_deadline_cuts_the_step_that_crosses_it_and_skips_the_rest(tmp_path):
    rc, rows = _run(tmp_path, DRY_RUN="1", DEADLINE="200")
    ran = [r for r in rows if r[1] == "DRY"]
    skipped = [r for r in rows if r[1] == "SKIPPED"]
    assert len(ran) + len(skipped) == len(REQUIRED) and skipped
    assert sum(int(r[3]) for r in ran) <= 200
    budgets = {r[0]: int(r[3]) for r in _run(tmp_path / "full", DRY_RUN="1")[1]}
    last = ran[-1]
    assert int(last[3]) < budgets[last[0]]  # cut to what was left
    assert all(int(r[3]) == budgets[r[0]] for r in ran[:-1])
    assert rc == len(skipped)  # each skipped step counts as failed


def test_summary_collects_result_lines_tallies_and_absent_tests(tmp_path):
    fake = tmp_path / "fake_python"
    fake.write_text("""#!/usr/bin/env bash
case "$*" in
  *bench_gpu.py*) echo "noise"; echo "RESULT reduce_sum_last 3500 GB/s 0.830 copy";
                  echo "RESULT resnet9_b128_eager 17000 img/s 0.500 pytorch" ;;
  *gpu_equality.py*) echo "RESULT equal_resnet9_graph 0 bool - eager"; exit 1 ;;
  *test_graph_replay_device*) echo "no tests ran in 0.1s"; exit 5 ;;
  *"-m pytest"*) echo "=== 12 passed, 3 skipped in 1.5s ===" ;;
  *) echo "did $*" ;;
esac
""")
    fake.chmod(0o755)
    rc, rows = _run(tmp_path / "out", PYTHON=str(fake))
    by_step = {r[0]: r for r in rows}
    assert tuple(by_step) == REQUIRED
    bench = by_step["bench_gpu"]
    assert bench[1] == "ok" and bench[4] == ("reduce_sum_last 3500 GB/s (0.830x copy)<br>"
                                             "resnet9_b128_eager 17000 img/s (0.500x pytorch)")
    assert by_step["test_cuda_backend"][1:2] == ["ok"]
    assert by_step["test_cuda_backend"][4] == "12 passed, 3 skipped in 1.5s"
    assert by_step["graph_replay"][1] == "ABSENT"
    assert by_step["compiled_equality"][1] == "FAILED (rc=1)"
    assert by_step["compiled_equality"][4] == "equal_resnet9_graph 0 bool"
    failed = [r[0] for r in rows if r[1] not in ("ok", "ABSENT")]
    assert rc == len(failed)  # env fails too where nvidia-smi is missing
