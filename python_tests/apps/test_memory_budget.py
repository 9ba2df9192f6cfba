"""``train.py --memory-budget BYTES``: the planner chooses the cheapest configuration (by its
step-time model) whose predicted peak fits, the run's measured peak stays within the budget,
an impossible budget stops with the smallest predicted peak, and a planner that ignores the
activations is caught by the measurement.

The budgets are set from the planner's own numbers (the generous choice's peak, the smallest
peak an impossible budget reports), so the tests hold whatever kernel workspace this machine
needs; what they pin is the order of choices on the default model (MLPResNet with BatchNorm
and Dropout, batch 64)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APPS = os.path.join(REPO, "apps")
SCRIPT = os.path.join(APPS, "train.py")
GENEROUS = 50_000_000


def _proc(tmp_path, *args, script=SCRIPT, timeout=600):
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, script, *args, "--max-steps", "3", "--no-progress",
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _plan(tmp_path, *args, **kw) -> dict:
    proc = _proc(tmp_path, *args, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads((tmp_path / "summary.json").read_text())["plan"]
    assert plan["within_budget"] and plan["measured_peak"] <= plan["budget"], plan
    assert plan["measured_peak"] == plan["predicted_peak"], plan  # exact, so it certifies
    assert all(r["predicted_peak"] > plan["budget"] for r in plan["rejected"])
    return plan


def _smallest(tmp_path, *args) -> tuple[int, dict]:
    """The smallest predicted peak and its options, from an impossible budget's error."""
    proc = _proc(tmp_path, *args, "--memory-budget", "1")
    assert proc.returncode != 0
    found = re.search(r"no configuration fits; the smallest predicted peak is ([\d,]+) bytes "
                      r"per rank \(([^)]*)\) among (\d+) candidates", proc.stdout + proc.stderr)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    words = found.group(2).split()
    return int(found.group(1).replace(",", "")), dict(zip(words[::2], words[1::2],
                                                          strict=True))


def _same(chosen: dict, options: dict) -> bool:
    return {k: str(v) for k, v in chosen.items() if v is not None} == options


def _check_three_budgets(tmp_path, args, tight_choice: dict) -> None:
    generous = _plan(tmp_path / "generous", *args, "--memory-budget", str(GENEROUS))
    assert generous["rejected"] == [] and generous["chosen"]["--accumulate"] == 1
    assert generous["chosen"]["--activation-checkpoints"] is None
    tight = _plan(tmp_path / "tight", *args, "--memory-budget",
                  str(generous["predicted_peak"] - 1))
    assert [r["config"] for r in tight["rejected"]][:1] == [generous["chosen"]]
    assert tight["chosen"] == {**generous["chosen"], **tight_choice}, tight
    least, options = _smallest(tmp_path / "impossible", *args)
    needs = _plan(tmp_path / "needs", *args, "--memory-budget", str(least))
    assert _same(needs["chosen"], options) and needs["predicted_peak"] == least
    assert needs["chosen"]["--activation-checkpoints"] is not None  # fits only recomputing
    assert all(r["config"]["--activation-checkpoints"] is not None
               or r["predicted_peak"] > least for r in needs["rejected"])


# ---- one rank --------------------------------------------------------------------------
def test_one_rank_three_budgets(tmp_path):
    """Generous: the plain step. Tight (one byte under it): the cheapest plan that recomputes
    less than it saves, the first two layers recomputed. The smallest peak of all needs
    recomputation (eight micro-batches alone do not reach it)."""
    _check_three_budgets(tmp_path, (), {"--activation-checkpoints": "2c,4"})


def test_a_planner_that_ignores_activations_is_caught(tmp_path):
    """Planted: the predictor sees no activation or gradient in flight. The planner then
    keeps the plain step under a budget one byte below its peak; the measured peak exceeds
    the budget and the run fails with that error after writing the summary."""
    generous = _plan(tmp_path / "generous", "--memory-budget", str(GENEROUS))
    script = tmp_path / "planted_train.py"
    script.write_text(f"import sys\nsys.path.insert(0, {APPS!r})\nimport train\n"
                      "from training import peak\n"
                      "peak.trace_backward = lambda *args, **kwargs: []\n"
                      "sys.exit(train.main())\n")
    budget = generous["predicted_peak"] - 1
    proc = _proc(tmp_path / "planted", "--memory-budget", str(budget), script=str(script))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert f"--memory-budget {budget}: a step's measured peak" in proc.stderr
    assert "exceeds the budget" in proc.stderr
    plan = json.loads((tmp_path / "planted" / "summary.json").read_text())["plan"]
    assert plan["chosen"] == generous["chosen"] and not plan["within_budget"]
    assert plan["predicted_peak"] < budget < plan["measured_peak"]


def test_the_plan_block(tmp_path):
    plan = _plan(tmp_path, "--memory-budget", str(GENEROUS), "--model", "mlp")
    assert set(plan) >= {"chosen", "predicted_peak", "measured_peak", "predicted_step_s",
                         "measured_step_s", "rejected", "time_model", "budget"}
    assert plan["measured_step_s"] > 0 and plan["predicted_step_s"] > 0
    assert "not calibrated" in plan["time_model"]


@pytest.mark.parametrize("args, message", [
    (["--memory-budget", "0"], "--memory-budget must be a positive number of bytes"),
    (["--memory-budget", "1e6"], "invalid int value"),
    (["--memory-budget", "1000000", "--strategy", "tp", "--nproc", "2"],
     "--memory-budget plans for --strategy single, ddp, zero, pipeline"),
    (["--memory-budget", "1000000", "--precision", "fp16-mixed"], "predicts the fp32 step"),
    (["--calibration", "cal.json"], "--calibration sets the planner's step times"),
    (["--memory-budget", "1000000", "--activation-checkpoints", "2c,4"],
     "leave out --activation-checkpoints"),
    (["--activation-checkpoints", "2x,4"], "expected segment lengths such as 2c,2,2c"),
    (["--activation-checkpoints", "3c", "--strategy", "tp", "--nproc", "2"],
     "applies to the single, ddp and zero strategies"),
    (["--layers-per-stage", "3", "--strategy", "pipeline", "--nproc", "2"],
     "needs one count per stage (2)"),
])
def test_usage_errors(args, message):
    with pytest.raises(train.UsageError, match=re.escape(message)):
        train.parse_args(args)


def test_checkpoint_plans_that_do_not_cover_the_model_are_refused():
    with pytest.raises(train.UsageError, match="covers 5 layers, expected the 6 layers"):
        train.train(train.parse_args(["--activation-checkpoints", "2c,3", "--max-steps", "1",
                                      "--no-progress"]))


# ---- two ranks ---------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.slow
def test_two_ranks_three_budgets(tmp_path):
    """ddp on 2 ranks (32 examples each): the same order of choices as one rank's."""
    _check_three_budgets(tmp_path, ("--nproc", "2"), {"--activation-checkpoints": "2c,4"})


@pytest.mark.mpi
@pytest.mark.slow
def test_zero_picks_the_stage(tmp_path):
    """--strategy zero: stages 1 and 2 send the same bytes, so the generous choice is stage 1
    and one byte less takes stage 2 (gradients sharded), before any recomputation."""
    generous = _plan(tmp_path / "generous", "--nproc", "2", "--strategy", "zero",
                     "--memory-budget", str(GENEROUS))
    assert generous["chosen"] == {"--accumulate": 1, "--activation-checkpoints": None,
                                  "--zero-stage": 1}
    tight = _plan(tmp_path / "tight", "--nproc", "2", "--strategy", "zero",
                  "--memory-budget", str(generous["predicted_peak"] - 1))
    assert tight["chosen"] == {**generous["chosen"], "--zero-stage": 2}


@pytest.mark.mpi
@pytest.mark.slow
def test_pipeline_picks_micro_batches_and_split(tmp_path):
    generous = _plan(tmp_path / "generous", "--nproc", "2", "--strategy", "pipeline",
                     "--memory-budget", str(GENEROUS))
    tight = _plan(tmp_path / "tight", "--nproc", "2", "--strategy", "pipeline",
                  "--memory-budget", str(generous["predicted_peak"] - 1))
    assert tight["chosen"] != generous["chosen"]
    summary = json.loads((tmp_path / "tight" / "summary.json").read_text())
    counts = [int(c) for c in tight["chosen"]["--layers-per-stage"].split(",")]
    assert summary["mesh"]["layers_per_stage"] == counts


# ---- a calibrated time model ----------------------------------------------------------------
def _calibration(path, **device) -> str:
    from needle.distributed.calibrate import Link
    from needle.plan.calibration import Calibration
    from needle.plan.model import Device

    return Calibration(Link(alpha=1e-5, beta=1e-9), Device(**device),
                       machine={"cpu": "test", "date": "today"}).save(str(path))


def test_the_calibration_decides_between_micro_batches_and_recomputation(tmp_path):
    """One byte under the plain step's peak, two candidates fit: two micro-batches (the same
    FLOPs, every op twice) or one with two layers recomputed (a few more FLOPs and ops). A
    machine whose cost is all FLOPs takes the micro-batches; one whose cost is all per-op
    dispatch recomputes. A planner that ignored the file would choose the same for both."""
    generous = _plan(tmp_path / "generous", "--memory-budget", str(GENEROUS))
    budget = str(generous["predicted_peak"] - 1)
    flop_bound = _calibration(tmp_path / "flops.json", flops=1e9, op_time=0.0,
                              backward_ratio=2.0)
    by_flops = _plan(tmp_path / "by_flops", "--memory-budget", budget,
                     "--calibration", flop_bound)
    assert by_flops["chosen"] == {"--accumulate": 2, "--activation-checkpoints": None}
    assert by_flops["time_model"].startswith(f"calibrated: {flop_bound}")
    op_bound = _calibration(tmp_path / "ops.json", flops=1e30, op_time=1e-3,
                            backward_ratio=1.0)
    by_ops = _plan(tmp_path / "by_ops", "--memory-budget", budget, "--calibration", op_bound)
    assert by_ops["chosen"]["--accumulate"] == 1
    assert by_ops["chosen"]["--activation-checkpoints"] is not None
    # there every op and backward node costs 1 ms and nothing else costs: whole milliseconds
    ops = by_ops["predicted_step_s"] / 1e-3
    assert ops == pytest.approx(round(ops)) and ops > 20
