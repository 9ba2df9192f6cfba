"""apps/train.py's debugging tools on real processes (mpi and tcp): ``--check-replicas``
catches a replica whose weight had one bit flipped, ``--detect-anomaly`` names the rank, the
step, the op and the source line of a planted ``log(0)``; bad combinations are usage errors."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "apps", "train.py")
COMMON = ("--nproc", "2", "--model", "mlp", "--epochs", "1", "--max-steps", "10",
          "--no-progress", "--seed", "1")


def _run(*args, backend: str | None = None, timeout: int = 240):
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    if backend is not None:
        env["NEEDLE_DIST_BACKEND"] = backend
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    return proc, proc.stdout + proc.stderr


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
@pytest.mark.parametrize("strategy, every", [("ddp", 3), ("zero", 1)])
def test_a_flipped_bit_on_rank_1_stops_the_job(tmp_path, backend, strategy, every):
    proc, out = _run(*COMMON, "--strategy", strategy, "--flip-bit", "1@5", "--check-replicas",
                     str(every), "--out", str(tmp_path), backend=backend)
    assert proc.returncode == 4, out[-3000:]
    assert "--flip-bit 1@5: flipped bit 22 of modules.0.weight[0]" in out
    found = re.search(r"replicas diverged at step (\d+): rank 1 differs from rank 0 in "
                      r"(\S+) ", out)
    assert found, out[-3000:]
    assert 5 <= int(found.group(1)) <= 5 + every
    assert found.group(2) == "modules.0.weight"
    assert out.count("replicas diverged") == 1  # one report for the job, not one per rank
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_equal_replicas_pass_and_the_summary_reports_the_cost(tmp_path):
    proc, out = _run(*COMMON, "--check-replicas", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, out[-3000:]
    block = json.loads((tmp_path / "summary.json").read_text())["replica_checks"]
    assert block["every"] == 2 and block["checks"] == 5
    assert block["seconds_per_check"] > 0 and block["bytes_digested"] > 0
    assert block["compared"] == ["parameters", "optimizer state", "loss scaler"]
    assert block["not_compared"] is None


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_detect_anomaly_names_rank_step_op_and_line_once(tmp_path, backend):
    proc, out = _run(*COMMON, "--nan-at", "1@7", "--detect-anomaly", "--out", str(tmp_path),
                     backend=backend)
    assert proc.returncode == 5, out[-3000:]
    reports = re.findall(r"non-finite value on rank (\d+) at step (\d+): (\w+) produced (\S+) "
                         r"in (\w+), from finite inputs, at (\S+):(\d+): (.*)", out)
    assert len(reports) == 1, out[-3000:]  # once for the job: rank 0 never saw a NaN
    rank, step, op, values, phase, path, line, source = reports[0]
    assert (rank, step, op, values, phase) == ("1", "7", "Log", "-inf", "forward")
    assert path.endswith("faults.py") and "return out + ndl.log(zeros)" in source
    assert int(line) > 0
    assert "launch: rank 1 failed first" in out


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_detect_anomaly_the_nan_spreads_to_every_replica(tmp_path):
    """What the flag prevents: rank 1's NaN is all-reduced into rank 0's gradients, and the
    run ends 'successfully' with a NaN loss."""
    proc, out = _run(*COMMON, "--nan-at", "1@7", "--out", str(tmp_path))
    assert proc.returncode == 0, out[-3000:]
    losses = json.loads((tmp_path / "summary.json").read_text())["losses"]
    assert all(v == v for v in losses[:6]) and all(v != v for v in losses[7:])


@pytest.mark.parametrize("args, message", [
    (["--check-replicas", "2"], "--check-replicas compares data-parallel replicas"),
    (["--nproc", "2", "--check-replicas", "0"], "--check-replicas must be positive"),
    (["--nproc", "2", "--strategy", "zero", "--zero-stage", "3", "--check-replicas", "2"],
     "--zero-stage 3 shards all of it"),
    (["--nproc", "2", "--strategy", "pipeline", "--flip-bit", "1@2"],
     "--flip-bit, --nan-at and --skip-layer apply to"),
    (["--nproc", "2", "--flip-bit", "2@2"], "--flip-bit: RANK must be in [0, 2)"),
    (["--nan-at", "0"], "--nan-at expects RANK@STEP"),
])
def test_bad_debugging_options(args, message):
    sys.path.insert(0, os.path.join(REPO, "apps"))
    import train
    from training.faults import parse_faults

    with pytest.raises(train.UsageError, match=re.escape(message)):
        cfg = train.parse_args(args)
        parse_faults(cfg, cfg.nproc)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
@pytest.mark.parametrize("strategy", ["ddp", "zero"])
def test_a_rank_that_skipped_a_layer_is_named_on_every_rank(tmp_path, backend, strategy):
    """Rank 1's backward of step 4 gives no gradient for the first layer: both ranks stop
    with the same error naming rank 1's missing parameters (not rank 0 blaming rank 1 for
    never arriving at a collective)."""
    proc, out = _run(*COMMON, "--strategy", strategy, "--skip-layer", "1@4",
                     "--out", str(tmp_path), backend=backend)
    assert proc.returncode == 2, out[-3000:]
    named = (r"rank 1 produced no gradient for 'modules\.0\.weight' \(shape \(64, 100\)\), "
             r"'modules\.0\.bias' \(shape \(1, 100\)\); rank 0 did")
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] train\.py: error: \w+: the ranks' backwards "
                         rf"produced gradients for different parameters.*{named}", out), \
            out[-3000:]
    assert "call check" not in out


def _doc_blocks() -> list[list[str]]:
    """The lines of each console block of docs/debugging.md."""
    with open(os.path.join(REPO, "docs", "debugging.md")) as f:
        return [b.splitlines() for b in re.findall(r"```console\n(.*?)```", f.read(), re.S)]


def _check_launcher_block(lines: list[str], args: list[str]) -> None:
    """A launcher command of the guide: its exit status and its first ``launch:`` line, as
    the guide prints them."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True,
                          timeout=240, env=env, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == int(lines[lines.index("$ echo $?") + 1]), out[-3000:]
    want = next(line for line in lines if line.startswith("launch: "))
    got = next(line for line in out.splitlines() if line.startswith("launch: "))
    assert got == want, (got, want)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_walk_through_in_docs_debugging_runs_as_written(tmp_path):
    """Every console block of the guide, run as written (its output folder moved into the
    test's): the training command's exit status (``$ echo $?``, else 0) and error line, and a
    ``python -c`` that prints the critical path prints first the rank and phase the guide
    shows."""
    blocks = _doc_blocks()
    assert len(blocks) == 7
    for i, lines in enumerate(blocks):
        command = lines[0][2:]
        args = command.split()
        if args[:3] == ["python", "-m", "needle.distributed.launch"]:
            _check_launcher_block(lines, args)
            continue
        assert args[:2] == ["python", "apps/train.py"], command
        folder = args[args.index("--out") + 1]
        moved = str(tmp_path / str(i))
        args = [a.replace(folder, moved) for a in args]
        proc, out = _run(*args[2:])
        status = int(lines[lines.index("$ echo $?") + 1]) if "$ echo $?" in lines else 0
        assert proc.returncode == status, (command, out[-3000:])
        errors = [line.split("train.py: error: ", 1)[1].split("(")[0].split("...")[0]
                  for line in lines if "train.py: error: " in line]
        assert not errors or errors[0] in out, (command, errors, out[-3000:])
        for k, line in enumerate(lines):
            if not line.startswith("$ python -c"):
                continue
            code = line[len("$ python -c "):].strip("\"'").replace(folder, moved)
            got = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                 text=True, timeout=60, cwd=REPO)
            want = re.search(r"'rank': (\d+), 'phase': '([^']+)'", lines[k + 1])
            first = re.search(r"'rank': (\d+), 'phase': '([^']+)'", got.stdout)
            assert want and first and first.groups() == want.groups(), (line, got.stdout)
