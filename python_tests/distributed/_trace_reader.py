"""Read a merged needle trace the way Perfetto does, for the tests.

With a trace processor binary at hand (``PERFETTO_BIN`` names it, or the ``perfetto``
package's cache holds one), the trace is loaded by ``perfetto.trace_processor.TraceProcessor``
and its slices read with SQL. The package fetches that binary from the network the first time,
which machines without network access cannot do: there the same rows are built from the JSON
by the rules of Perfetto's JSON importer that the tests rely on (``X`` events are slices of
duration ``dur``, ``i`` events slices of duration 0, on the thread track of (pid, tid); the
process and thread names from the ``M`` metadata events; times in nanoseconds).
"""
from __future__ import annotations

import json
import os

_SQL = """
select s.name as name, s.ts as ts, s.dur as dur, s.category as cat, t.tid as tid,
       t.name as thread, p.pid as pid, p.name as process, s.arg_set_id as arg_set_id
from slice s join thread_track tt on s.track_id = tt.id join thread t using (utid)
left join process p using (upid)
"""


def _with_trace_processor(path: str) -> list[dict] | None:
    try:
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig
    except ImportError:
        return None
    binary = os.environ.get("PERFETTO_BIN")
    if binary is None:
        return None  # the package would download one: not on an offline machine
    tp = TraceProcessor(trace=path, config=TraceProcessorConfig(bin_path=binary))
    try:
        rows = []
        for r in tp.query(_SQL):
            args = {a.key.removeprefix("args."): a.display_value for a in tp.query(
                f"select key, display_value from args where arg_set_id = {r.arg_set_id}")} \
                if r.arg_set_id is not None else {}
            rows.append({"name": r.name, "ts": r.ts, "dur": r.dur, "cat": r.cat, "pid": r.pid,
                         "tid": r.tid, "thread": r.thread, "process": r.process,
                         "args": {k: _number(v) for k, v in args.items()}})
        return rows
    finally:
        tp.close()


def _number(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return v


def _from_json(path: str) -> list[dict]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    return [{"name": e["name"], "ts": round(e["ts"] * 1000), "dur":
             round(e.get("dur", 0) * 1000), "cat": e.get("cat"), "pid": e["pid"],
             "tid": e["tid"], "thread": threads.get((e["pid"], e["tid"])),
             "process": processes.get(e["pid"]), "args": e.get("args", {})}
            for e in events if e["ph"] in ("X", "i")]


def slices(path: str) -> list[dict]:
    """Every slice of the trace: name, ts and dur (ns), cat, pid, tid, thread, process, args."""
    rows = _with_trace_processor(path)
    return _from_json(path) if rows is None else rows


def by_rank(rows: list[dict]) -> dict[str, list[dict]]:
    """The slices per process track name ("rank 0", "rank 1 (worker)", ...)."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["process"], []).append(r)
    return out
