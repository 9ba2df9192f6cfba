"""How each rank of a launched job ended, and which rank to blame: pure functions on the
records that ``_run_rank`` (the supervisor) and ``_rank_main`` (the script's process) write.

Records in the status directory, per rank k:

* ``rank<k>.pid``  — the supervisor started (its pid);
* ``rank<k>.json`` — the script ended: exit code, or exception (type, message, traceback) and,
  for a ``PeerError``, the peer it blames and why;
* ``rank<k>.exit`` — the script's process ended: exit code, or the signal that killed it.

Blame: a rank that failed on its own (exception, non-zero exit, signal, vanished) is preferred
over one that failed because of a peer (a PeerError); among those, the earliest. Ranks stopped by
the launcher, or by mpiexec after another rank failed, are consequences, never the cause.

Example:
    >>> ranks = {0: Outcome(0, "peer", 1, 10.5, "PeerError: rank 1 is gone", peer=1,
    ...                     reason="gone"),
    ...          1: Outcome(1, "signal", 137, 10.0, "SIGKILL")}
    >>> code, lines = verdict(ranks)
    >>> code, lines[0]
    (137, 'launch: rank 1 failed first: killed by signal 9 (SIGKILL)')
    >>> lines[-1]
    'launch: rank 0 failed because peer rank 1 is gone: PeerError: rank 1 is gone'
"""
from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass

from ._errors import PEER_REASONS

OWN = ("exception", "exit", "signal", "vanished", "unstarted")  # failures of the rank itself


@dataclass
class Outcome:
    """How one rank ended. ``kind``: ok | exit | exception | signal | vanished | unstarted |
    peer | stopped.
    ``code``: the exit status to propagate; ``at``: wall time of the end (or of its notice)."""

    rank: int
    kind: str
    code: int
    at: float
    detail: str = ""
    peer: int | None = None
    reason: str | None = None
    traceback: str = ""


def read_record(status_dir: str, name: str) -> dict | None:
    try:
        with open(os.path.join(status_dir, name)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def outcome_from_records(rank: int, script: dict | None, process: dict | None) -> Outcome | None:
    """The outcome told by the script's and the process's records (None: nothing known yet)."""
    if script is not None:
        code = int(script.get("code", 1))
        at = float(script.get("time", 0.0))
        if script.get("kind") == "exception":
            kind = "peer" if script.get("peer") is not None else "exception"
            return Outcome(rank, kind, code or 1, at, str(script.get("error", "")),
                           script.get("peer"), script.get("reason"),
                           str(script.get("traceback", "")))
        return Outcome(rank, "ok" if code == 0 else "exit", code, at)
    if process is not None:
        at = float(process.get("time", 0.0))
        if "signal" in process:
            number = int(process["signal"])
            return Outcome(rank, "signal", 128 + number, at, _signal_name(number))
        code = int(process.get("code", 1))
        return Outcome(rank, "vanished", code or 1, at, f"process exit code {code}")
    return None


def describe(o: Outcome) -> str:
    """How a rank failed, in words."""
    if o.kind == "exit":
        return f"exited with code {o.code}"
    if o.kind == "exception":
        return f"raised {o.detail}"
    if o.kind == "signal":
        return f"killed by signal {o.code - 128} ({o.detail})"
    if o.kind == "vanished":
        return ("ended without reporting an exit status (os._exit(), a crash, or its process "
                f"was killed; {o.detail})")
    if o.kind == "unstarted":
        return f"never started ({o.detail})"
    if o.kind == "peer":
        phrase = PEER_REASONS.get(o.reason or "", "failed")
        return f"failed because peer rank {o.peer} {phrase}: {o.detail}"
    if o.kind == "stopped":
        return o.detail or "was stopped by the launcher"
    if o.kind == "lost":
        return (f"was lost ({o.detail}); it was expendable (a parameter-server worker), so "
                "the job went on without it")
    return "succeeded"


def verdict(outcomes: dict[int, Outcome]) -> tuple[int, list[str]]:
    """(exit code of the job, lines for the launcher to print). 0 only when every rank is ok."""
    lost = [f"launch: rank {o.rank} {describe(o)}" for o in sorted(
        outcomes.values(), key=lambda o: o.rank) if o.kind == "lost"]
    failed = [o for o in outcomes.values() if o.kind not in ("ok", "stopped", "lost")]
    if not failed:
        return 0, lost
    own = [o for o in failed if o.kind in OWN]
    first = min(own or failed, key=lambda o: (o.at, o.rank))
    if first.kind == "peer":
        lines = [f"launch: rank {first.rank} {describe(first)}"]
    else:
        lines = [f"launch: rank {first.rank} failed first: {describe(first)}"]
    if first.traceback:
        lines += ["launch: traceback of rank %d:" % first.rank]
        lines += ["    " + line for line in first.traceback.rstrip().splitlines()]
    for o in sorted(outcomes.values(), key=lambda o: o.rank):
        if o is first or o.kind in ("ok", "lost"):
            continue
        if o.kind == "vanished" and o.at >= first.at:
            lines.append(f"launch: rank {o.rank} ended without reporting after rank "
                         f"{first.rank} failed (mpiexec stops the other ranks)")
        elif o.kind == "peer" or o.kind == "stopped":
            lines.append(f"launch: rank {o.rank} {describe(o)}")
        else:
            lines.append(f"launch: rank {o.rank} also failed: {describe(o)}")
    return first.code or 1, lines + lost
