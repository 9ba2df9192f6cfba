"""The launcher's per-rank supervisor: starts the rank's script as its child and records how
that child ended.

``python -m needle.distributed._run_rank script.py args`` (started by ``launch``, directly for
tcp, through mpiexec for mpi). Why a supervisor: under mpiexec the launcher is not the ranks'
parent, and when one rank dies MPICH's Hydra kills the others at once, so nothing else could tell
which rank died first and how (exit code or signal). The supervisor is the rank's parent: it
writes, to ``$NEEDLE_LAUNCH_STATUS_DIR``, ``rank<k>.pid`` when it starts and ``rank<k>.exit``
(exit code, or the signal that killed the child, and the time) the moment the child ends.

It also gives every rank the torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE) under either backend, forwards the signals it receives to the child, and
makes the kernel kill the child if the supervisor itself is killed (PR_SET_PDEATHSIG), so a
SIGKILL from mpiexec or the launcher never leaves an orphaned rank behind.

It imports nothing heavy: it must start fast and must not touch MPI (the child does; it
inherits the PMI connection that mpiexec opened for this process).
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

STATUS_DIR_ENV = "NEEDLE_LAUNCH_STATUS_DIR"
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


def rank_environment(env: dict) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE from whatever started this process
    (needle's tcp launcher sets them; Hydra sets PMI_RANK, PMI_SIZE, MPI_LOCALRANKID and
    MPI_LOCALNRANKS; Open MPI sets OMPI_COMM_WORLD_*)."""
    # An MPI launcher's own variables describe this very process, so they win over RANK &c.
    # inherited from whatever environment mpiexec was started in.
    sources = {
        "RANK": ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK"),
        "WORLD_SIZE": ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"),
        "LOCAL_RANK": ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"),
        "LOCAL_WORLD_SIZE": ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                             "LOCAL_WORLD_SIZE"),
    }
    out = {}
    for name, candidates in sources.items():
        found = next((env[c] for c in candidates if env.get(c)), None)
        if found is not None:
            out[name] = found
    out.setdefault("RANK", "0")
    out.setdefault("WORLD_SIZE", "1")
    out.setdefault("LOCAL_RANK", out["RANK"])
    out.setdefault("LOCAL_WORLD_SIZE", out["WORLD_SIZE"])
    return out


def write_record(status_dir: str | None, name: str, record: dict) -> None:
    """Write ``name`` atomically (the launcher never reads half a file); a status directory
    that does not exist here (a rank on another host) is not an error."""
    if not status_dir:
        return
    path = os.path.join(status_dir, name)
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _die_with_parent() -> None:
    """In the child between fork and exec: be killed when the supervisor dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's process-group kill remains
        pass


def main() -> int:
    env = dict(os.environ)
    env.update(rank_environment(env))
    rank = int(env["RANK"])
    status_dir = env.get(STATUS_DIR_ENV)
    write_record(status_dir, f"rank{rank}.pid", {"pid": os.getpid(), "time": time.time()})
    cmd = [sys.executable, "-u", "-m", "needle.distributed._rank_main", *sys.argv[1:]]
    parent = os.getpid()

    def setup() -> None:
        _die_with_parent()
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os._exit(1)

    # pass_fds: the PMI socket that mpiexec opened for this rank (PMI_FD) must reach the child.
    fds = tuple(int(env[k]) for k in ("PMI_FD",) if env.get(k, "").isdigit())
    child = subprocess.Popen(cmd, env=env, preexec_fn=setup, pass_fds=fds)
    for sig in _FORWARDED:
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    ended = time.time()
    record = {"code": code, "time": ended} if code >= 0 else \
        {"signal": -code, "code": 128 - code, "time": ended}
    write_record(status_dir, f"rank{rank}.exit", record)
    return record["code"]


if __name__ == "__main__":
    sys.exit(main())
