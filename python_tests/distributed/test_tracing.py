"""needle.distributed.tracing: one merged trace of every rank, its clocks aligned (real
processes on mpi and tcp, read back as Perfetto reads it), and the critical path as a pure
function of hand-made traces."""
from __future__ import annotations

import json

import pytest

from needle.distributed import tracing
from needle.distributed.critical_path import critical_path

from ._trace_reader import by_rank, slices
from .test_multiprocess import launch


def _matched(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(send, receive) pairs: same source, destination, tag and sequence number."""
    key = lambda r: (r["args"]["src"], r["args"]["dst"], r["args"]["tag"], r["args"]["seq"])  # noqa: E731
    sends = {key(r): r for r in rows if r["name"] == "send" and r["cat"] == "p2p"}
    recvs = [r for r in rows if r["name"] == "recv" and r["cat"] == "p2p"]
    return [(sends[key(r)], r) for r in recvs]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_ranks_with_skewed_clocks_merge_into_one_ordered_trace(tmp_path, backend) -> None:
    path = tmp_path / "trace.json"
    out = launch(3, backend, "trace_skew.py", str(path), timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    rows = slices(str(path))
    tracks = by_rank(rows)
    assert sorted(tracks) == ["rank 0", "rank 1", "rank 2"]
    pairs = _matched(rows)
    assert len(pairs) == 12  # 3 rounds x 2 peers x (request, answer)
    meta = json.loads(path.read_text())["metadata"]["ranks"]
    slack = 2 * max(m["clock_error_us"] for m in meta) * 1000  # ns: the stated bounds
    for send, recv in pairs:  # without alignment rank r's events sit r * 1000 s later
        assert recv["ts"] + recv["dur"] + slack >= send["ts"], (send, recv, slack)
        assert recv["args"]["bytes"] == send["args"]["bytes"] == 1024
    for rank in range(3):
        reduces = [r for r in tracks[f"rank {rank}"] if r["name"] == "all_reduce"]
        assert len(reduces) == 1 and reduces[0]["args"]["bytes"] == 1024
    for m in meta:  # the offset found undoes the skew, within the error bound it states
        assert abs(m["clock_offset_us"] + 1e9 * m["rank"]) <= m["clock_error_us"] + 1e5
    assert not list(tmp_path.glob("trace.json.rank*"))  # the parts are merged and gone


def test_tracing_off_records_nothing_and_on_records_into_a_bounded_buffer(tmp_path) -> None:
    assert not tracing.enabled()
    assert tracing.span("x", "c") is tracing.span("y", "c")  # the shared no-op
    path = tmp_path / "t.json"
    tracing.start(str(path), capacity=5)
    for i in range(20):
        tracing.instant("tick", "mark", i=i)
    merged = tracing.stop()
    ticks = [e["args"]["i"] for e in merged["traceEvents"] if e["name"] == "tick"]
    assert ticks == [15, 16, 17, 18, 19]  # the newest kept
    assert not tracing.enabled()


def _x(rank, name, ts, dur, cat="compute", **args):
    return {"ph": "X", "pid": rank + 1, "tid": 1, "name": name, "cat": cat, "ts": ts,
            "dur": dur, "args": args}


def test_data_parallel_path_follows_the_rank_that_arrives_last_at_each_sync_point() -> None:
    events = []
    for step, (slow, start) in enumerate([(1, 0), (0, 200)], start=1):
        for rank in (0, 1):
            delay = 60 if rank == slow else 0
            events += [_x(rank, "step", start, 150, cat="step", step=step),
                       _x(rank, "forward", start + delay, 10),
                       _x(rank, "backward", start + delay + 10, 20),
                       _x(rank, "gradient sync", start + delay + 30, 100 - delay,
                          cat="communication"),
                       _x(rank, "optimizer", start + 130, 5)]
    path = {(r["rank"], r["phase"]): r["seconds"] for r in critical_path({"traceEvents":
                                                                          events})}
    # each step's slow rank: its compute and its own (short) gradient sync; not the waiting
    assert path[(1, "backward")] == path[(0, "backward")] == pytest.approx(20e-6)
    assert path[(1, "gradient sync")] == pytest.approx(40e-6)
    assert path[(1, "other")] == pytest.approx(60e-6)  # its delay before the forward
    # the steps end together: the tail after the sync counts once, for the lower rank
    assert path[(0, "optimizer")] == pytest.approx(10e-6) and (1, "optimizer") not in path


def test_pipeline_path_jumps_from_a_waiting_receive_to_its_send() -> None:
    p2p = dict(tag=7, seq=1, bytes=4)
    events = [_x(0, "step", 0, 100, cat="step", step=1), _x(1, "step", 0, 100, cat="step", step=1),
              _x(0, "F", 0, 50, cat="pipeline"), _x(0, "SEND_F", 50, 2, cat="pipeline"),
              _x(0, "send", 50, 1, cat="p2p", src=0, dst=1, **p2p),
              _x(1, "RECV_F", 1, 52, cat="pipeline"),
              _x(1, "recv", 1, 52, cat="p2p", src=0, dst=1, **p2p),
              _x(1, "F", 53, 10, cat="pipeline")]
    path = {(r["rank"], r["phase"]): r["seconds"] for r in critical_path({"traceEvents":
                                                                          events})}
    assert path == {(1, "forward"): pytest.approx(10e-6), (1, "transfer"): pytest.approx(3e-6),
                    (0, "forward"): pytest.approx(50e-6)}
