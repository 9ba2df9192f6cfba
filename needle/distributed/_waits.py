"""What a timed-out rank was waiting for, and the wait-for graph built from every rank's answer.

A rank that times out in a blocking call (``recv``, a collective, ...) writes, before raising,
``rank<k>.wait`` to the launcher's status directory: the operation, the global rank it waited
for, the tag, the call's sequence number on its group and the user's call site (the first frame
outside ``needle/distributed``). Ranks caught in a cycle all time out at about the same time, so
the rank then waits a short grace for the records of the ranks it waits on; the launcher, which
reads every record, does the same. Following each rank to the rank it waits for ends either in
a cycle (a deadlock: every rank in it arrived) or at a rank with no record (it never arrived:
it is not inside any needle call). Without a launcher (no status directory) nothing is written.

Example:
    >>> records = {0: {"op": "recv", "peer": 1, "site": "a.py:3"},
    ...            1: {"op": "recv", "peer": 0, "site": "a.py:5"}}
    >>> explain(records)
    ['deadlock: rank 0 recv from 1 (a.py:3) → rank 1 recv from 0 (a.py:5) → rank 0']
    >>> explain({0: {"op": "all_reduce", "peer": 2, "site": "a.py:9"}}, {2: "a.py:20"})
    ['rank 2 never arrived (it was at a.py:20): rank 0 all_reduce from 2 (a.py:9) → rank 2']
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

from ._launch_report import read_record
from ._run_rank import STATUS_DIR_ENV, write_record

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
GRACE = 2.0  # seconds to wait for the other records of a cycle: they time out together


def call_site(depth: int = 2) -> str:
    """``file:line`` of the innermost frame outside needle.distributed (the user's call)."""
    frame: Any = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _status_dir() -> str | None:
    return os.environ.get(STATUS_DIR_ENV) or None


def record_timeout(rank: int, op: str, peer: int, tag: Any, seq: int, site: str) -> str:
    """Write this rank's wait record (global ranks), wait up to ``GRACE`` s for the records of
    the ranks it waits on, and return the wait-for graph's verdict ("" when unknown)."""
    status = _status_dir()
    if status is None:
        return ""
    write_record(status, f"rank{rank}.wait", {"rank": rank, "op": op, "peer": peer,
                                              "tag": tag, "seq": seq, "site": site,
                                              "time": time.time()})
    end = time.monotonic() + GRACE
    while True:
        records = read_waits(status)
        chain = follow(records, rank)
        if chain[-1] in chain[:-1] or time.monotonic() >= end:
            lines = explain(records, {}, start=rank)
            return lines[0] if lines else ""
        time.sleep(0.05)


def read_waits(status_dir: str, ranks: Any = None) -> dict[int, dict]:
    """Every ``rank<k>.wait`` record in ``status_dir`` (of ``ranks``, default all)."""
    out: dict[int, dict] = {}
    try:
        names = os.listdir(status_dir)
    except OSError:
        return out
    for name in names:
        if name.startswith("rank") and name.endswith(".wait"):
            record = read_record(status_dir, name)
            if record is not None and isinstance(record.get("peer"), int) and (
                    ranks is None or int(record.get("rank", -1)) in ranks):
                out[int(record["rank"])] = record
    return out


def follow(records: dict[int, dict], start: int) -> list[int]:
    """``start``, the rank it waits for, the rank that one waits for... up to the first rank
    seen twice or the first rank without a record."""
    chain = [start]
    while chain[-1] in records:
        nxt = int(records[chain[-1]]["peer"])
        chain.append(nxt)
        if nxt in chain[:-1]:
            break
    return chain


def _hop(rank: int, record: dict) -> str:
    return f"rank {rank} {record.get('op', '?')} from {record['peer']} ({record.get('site', '?')})"


def explain(records: dict[int, dict], last_seen: dict[int, str] | None = None,
            start: int | None = None) -> list[str]:
    """One line per cycle and per rank that never arrived, from the wait records.

    ``last_seen``: rank -> where a rank without a record was (its call site), if known.
    ``start``: explain only the chain that starts at this rank.
    """
    lines: list[str] = []
    done: set[int] = set()
    for first in ([start] if start is not None else sorted(records)):
        chain = follow(records, first)
        end = chain[-1]
        if end in chain[:-1]:  # a cycle: print it from its smallest rank
            loop = chain[chain.index(end):-1]
            if done & set(loop):
                continue
            done |= set(loop)
            i = loop.index(min(loop))
            loop = loop[i:] + loop[:i]
            lines.append("deadlock: " + " → ".join(_hop(r, records[r]) for r in loop) +
                         f" → rank {loop[0]}")
        elif end not in done and len(chain) > 1:
            done.add(end)
            where = (last_seen or {}).get(end)
            seen = f" (it was at {where})" if where else ""
            lines.append(f"rank {end} never arrived{seen}: " +
                         " → ".join(_hop(r, records[r]) for r in chain[:-1]) + f" → rank {end}")
    return lines
