"""``--trace FILE``: one merged Chrome trace of the job and its critical path.

Every rank records into ``needle.distributed.tracing``'s buffer from set-up to the end of
training; rank 0 merges the ranks' parts into FILE and adds to ``summary.json`` the
``critical_path`` (``needle.distributed.critical_path``: which rank and phase bounded the
steps, for how many seconds) and a ``trace`` block (the file, its event count, the largest
clock-alignment error). See ``docs/debugging.md``, "A slow job".
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext

from needle.distributed import tracing

# whether this run records: a single-process run without --trace makes no call into
# needle.distributed at all (its steps never depend on the distributed layer)
_ON = False
_NULL = nullcontext({})


def span(name: str, cat: str, **args):
    """``tracing.span`` while this run records, else a no-op context (no call made)."""
    return tracing.span(name, cat, **args) if _ON else _NULL


def start(cfg, strategy) -> bool:
    """Start recording when ``--trace`` asks (collective: the ranks align their clocks)."""
    path = getattr(cfg, "trace", None)
    if not path:
        return False
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    role = None
    if cfg.strategy == "ps":
        role = "server" if strategy.serving else "worker"
    global _ON
    tracing.start(os.path.abspath(path), role=role)
    _ON = True
    return True


def finish(summary: dict | None, cfg) -> None:
    """Stop recording; on rank 0 write the merged trace and add ``critical_path`` and
    ``trace`` to ``summary``."""
    global _ON
    if not _ON:
        return
    _ON = False
    merged = tracing.stop()
    if merged is None or summary is None:
        return
    from needle.distributed.critical_path import critical_path

    meta = merged["metadata"]
    summary["critical_path"] = critical_path(merged) if cfg.strategy != "ps" else None
    summary["trace"] = {
        "path": os.path.abspath(cfg.trace),
        "events": sum(1 for e in merged["traceEvents"] if e["ph"] != "M"),
        "clock_error_us": max((r["clock_error_us"] for r in meta["ranks"]), default=0.0),
        "missing_ranks": meta["missing_ranks"],
    }


def fault_delay(faults, rank: int, began: float) -> None:
    """The sleep of ``--slow-worker`` on its rank, as a span: it stands for slow compute."""
    if _ON and faults.slow_rank == rank and faults.slow_ms > 0:
        tracing.complete("slow-worker", "compute", began, time.perf_counter(),
                         ms=faults.slow_ms)


def step_done(began: float, step: int) -> None:
    """Step ``step`` of the loop ran from ``began`` (``time.perf_counter``) to now."""
    if _ON:
        tracing.complete("step", "step", began, time.perf_counter(), step=step)
