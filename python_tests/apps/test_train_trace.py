"""apps/train.py --trace on real processes (mpi and tcp): the merged trace, read as Perfetto
reads it, has a track per rank, the spans of every step, every bucket's collective on both
ranks and each receive after its send; summary.json's critical_path names the slow rank of
``--slow-worker`` and the heavy stage of an unbalanced pipeline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from python_tests.distributed._trace_reader import by_rank, slices  # noqa: E402

SCRIPT = os.path.join(REPO, "apps", "train.py")
STEPS = 4


def _train(tmp_path, *args, backend: str | None = None) -> tuple[dict, list[dict]]:
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    if backend is not None:
        env["NEEDLE_DIST_BACKEND"] = backend
    trace = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--nproc", "2", "--epochs", "1",
                           "--max-steps", str(STEPS), "--no-progress", "--out", str(tmp_path),
                           "--trace", str(trace), *args],
                          capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((tmp_path / "summary.json").read_text()), slices(str(trace))


def _outside_metrics(track: list[dict]) -> list[dict]:
    """The spans of a rank track that are not the meters' predictions (which run forward,
    backward and pipeline actions on copies of the model, inside ``metrics`` spans)."""
    meters = [(r["ts"], r["ts"] + r["dur"]) for r in track if r["name"] == "metrics"]
    return [r for r in track if r["name"] == "metrics" or not any(
        lo <= r["ts"] and r["ts"] + r["dur"] <= hi for lo, hi in meters)]


def _seconds_by_rank(path: list[dict], phases: set[str]) -> Counter:
    total: Counter = Counter()
    for row in path:
        if row["phase"] in phases:
            total[row["rank"]] += row["seconds"]
    return total


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_ddp_trace_has_every_step_and_bucket_on_both_ranks(tmp_path, backend) -> None:
    summary, rows = _train(tmp_path, "--bucket-cap-mb", "0.05", backend=backend)
    tracks = by_rank(rows)
    assert sorted(tracks) == ["rank 0", "rank 1"]
    buckets = None
    for name, track in tracks.items():
        names = Counter(r["name"] for r in _outside_metrics(track))
        for span in ("step", "forward", "backward", "optimizer", "gradient sync"):
            assert names[span] == STEPS, (name, span, names)
        collectives = [r for r in track if r["name"] == "bucket collective"]
        per_step = len(collectives) // STEPS
        assert per_step >= 2 and len(collectives) == per_step * STEPS  # every bucket, each step
        mine = Counter(r["args"]["bucket"] for r in collectives)
        assert mine == {b: STEPS for b in range(per_step)}
        buckets = mine if buckets is None else buckets
        assert mine == buckets  # the same buckets on both ranks
        ready = defaultdict(list)
        for r in track:
            if r["name"] == "bucket ready":
                ready[r["args"]["bucket"]].append(r["ts"])
        launches = defaultdict(list)
        for r in track:
            if r["name"] == "bucket launch":
                launches[r["args"]["bucket"]].append(r["ts"])
        for b in buckets:  # launched after it was ready, in every step
            assert all(lt >= rt for rt, lt in zip(sorted(ready[b]), sorted(launches[b]),
                                                  strict=True))
        labels = {r["args"].get("label") for r in track if r["name"] == "all_reduce"}
        assert "ddp gradients" in labels
    assert summary["trace"]["missing_ranks"] == []
    assert summary["critical_path"]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.parametrize("slow", [1, 0])
def test_slow_worker_is_named_on_the_critical_path(tmp_path, slow) -> None:
    summary, _ = _train(tmp_path, "--slow-worker", f"{slow}:50")
    path = summary["critical_path"]
    compute = _seconds_by_rank(path, {"slow-worker", "forward", "backward"})
    assert compute[slow] > compute[1 - slow], path
    sleeps = _seconds_by_rank(path, {"slow-worker"})
    assert sleeps[slow] >= 0.05 * (STEPS - 1) and sleeps[1 - slow] == 0, path


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
@pytest.mark.parametrize("layers, heavy", [("1,5", 1), ("5,1", 0)])
def test_pipeline_trace_and_its_heavy_stage(tmp_path, backend, layers, heavy) -> None:
    summary, rows = _train(tmp_path, "--strategy", "pipeline", "--microbatches", "4",
                           "--layers-per-stage", layers, "--hidden", "256", backend=backend)
    tracks = by_rank(rows)
    assert sorted(tracks) == ["rank 0", "rank 1"]
    for name in ("rank 0", "rank 1"):
        actions = Counter((r["name"], r["args"]["microbatch"])
                          for r in _outside_metrics(tracks[name]) if r["cat"] == "pipeline")
        for mb in range(4):  # each step runs F and B of every micro-batch
            assert actions[("F", mb)] == actions[("B", mb)] == STEPS, actions
    key = lambda r: (r["args"]["src"], r["args"]["dst"], r["args"]["tag"], r["args"]["seq"])  # noqa: E731
    sends = {key(r): r for r in rows if r["cat"] == "p2p" and r["name"] == "send"}
    recvs = [r for r in rows if r["cat"] == "p2p" and r["name"] == "recv"]
    assert len(recvs) >= 2 * 4 * STEPS  # activations one way, gradients the other
    # ordered up to the clocks' stated alignment error (two ranks' bounds, in ns)
    slack = 2 * summary["trace"]["clock_error_us"] * 1000
    for r in recvs:
        send = sends[key(r)]
        assert r["ts"] + r["dur"] + slack >= send["ts"], (send, r, slack)
    compute = _seconds_by_rank(summary["critical_path"], {"forward", "backward"})
    assert compute[heavy] > compute[1 - heavy], summary["critical_path"]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(450)
def test_parameter_server_trace_has_pushes_pulls_and_staleness(tmp_path) -> None:
    """Asynchronous parameter server, one server and two workers: each worker's track has a
    pull and a push per step; the server's has one update per gradient it applied, and each
    push it received carries the staleness it was applied with."""
    summary, rows = _train(tmp_path, "--strategy", "ps", "--servers", "1",
                           "--ps-mode", "async", backend="tcp")
    tracks = by_rank(rows)
    server = next(t for name, t in tracks.items() if "server" in name)
    workers = [t for name, t in tracks.items() if "worker" in name]
    assert len(workers) == 2
    for track in workers:
        names = Counter(r["name"] for r in _outside_metrics(track))
        assert names["ps pull"] == STEPS and names["ps push"] == STEPS, names
    updates = [r for r in server if r["name"] == "ps update"]
    received = [r for r in server if r["name"] == "ps push received"]
    assert len(updates) == summary["ps"]["updates_applied"] == 2 * STEPS
    assert len(received) == 2 * STEPS
    histogram = Counter(r["args"]["staleness"] for r in received)
    assert sum(histogram.values()) == 2 * STEPS
    assert {int(k): v for k, v in summary["ps"]["staleness_histogram"].items()} == histogram
