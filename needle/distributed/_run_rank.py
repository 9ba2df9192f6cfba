"""The launcher's per-rank supervisor: starts the rank's script as its child and records how
that child ended.

``python -m needle.distributed._run_rank script.py args`` (started by ``launch``, directly for
tcp, through mpiexec for mpi). Why a supervisor: under mpiexec the launcher is not the ranks'
parent, and when one rank dies MPICH's Hydra kills the others at once, so nothing else could tell
which rank died first and how (exit code or signal). The supervisor is the rank's parent: it
writes, to ``$NEEDLE_LAUNCH_STATUS_DIR``, ``rank<k>.pid`` when it starts and ``rank<k>.exit``
(exit code, or the signal that killed the child, and the time) the moment the child ends.

It also gives every rank the torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE) under either backend and forwards the signals it receives to the child. No
rank outlives its job: the kernel kills the child if the supervisor is killed, and terminates
the supervisor (which then stops the child, SIGKILL after a grace) if the supervisor's parent,
the launcher or mpiexec's proxy, dies (PR_SET_PDEATHSIG). ``--exec`` starts mpiexec the same
way, so even a SIGKILL of the launcher leaves nothing running.

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
_ORPHAN_GRACE = 5.0  # seconds an orphaned rank gets between SIGTERM and SIGKILL


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
    from needle.serialization import atomic_write_bytes  # a random, exclusive temporary

    try:
        atomic_write_bytes(os.path.join(status_dir, name), json.dumps(record).encode())
    except OSError:
        pass


def declare_expendable(rank: int) -> None:
    """Tell the launcher (if any) that this rank may be killed without failing the job."""
    write_record(os.environ.get(STATUS_DIR_ENV), f"rank{rank}.expendable", {"rank": rank})


def die_with_parent(sig: int) -> bool:
    """Ask the kernel to send ``sig`` when our parent dies (Linux; kept across exec). False
    when the parent is already gone."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux: the launcher's process-group kill remains
        pass
    return os.getppid() == parent and parent != 1


def _wait(child: subprocess.Popen, parent: int) -> int:
    """Wait for the child; once our own parent is gone (launcher or mpiexec killed), give the
    child the grace a stopping launcher would give, then SIGKILL it."""
    orphaned = None
    while True:
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if os.getppid() == parent:
                continue
            orphaned = orphaned or time.monotonic()
            if time.monotonic() - orphaned > _ORPHAN_GRACE:
                child.kill()


def exec_with_parent_death(argv: list[str]) -> None:
    """``_run_rank.py --exec prog args``: become ``prog``, terminated with our parent (the
    launcher starts mpiexec this way, so that mpiexec never outlives it)."""
    if die_with_parent(signal.SIGTERM):
        os.execv(argv[0], argv)
    sys.exit(1)


def main() -> int:
    if sys.argv[1:2] == ["--exec"]:
        exec_with_parent_death(sys.argv[2:])
    parent = os.getppid()
    if not die_with_parent(signal.SIGTERM):  # forwarded to the child, like any SIGTERM
        return 1
    env = dict(os.environ)
    env.update(rank_environment(env))
    rank = int(env["RANK"])
    status_dir = env.get(STATUS_DIR_ENV)
    write_record(status_dir, f"rank{rank}.pid", {"pid": os.getpid(), "time": time.time()})
    cmd = [sys.executable, "-u", "-m", "needle.distributed._rank_main", *sys.argv[1:]]
    me = os.getpid()

    def setup() -> None:  # in the child, between fork and exec: die with the supervisor
        if not die_with_parent(signal.SIGKILL) or os.getppid() != me:
            os._exit(1)

    # pass_fds: the PMI socket that mpiexec opened for this rank (PMI_FD) must reach the child.
    fds = tuple(int(env[k]) for k in ("PMI_FD",) if env.get(k, "").isdigit())
    child = subprocess.Popen(cmd, env=env, preexec_fn=setup, pass_fds=fds)
    for sig in _FORWARDED:
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = _wait(child, parent)
    ended = time.time()
    record = {"code": code, "time": ended} if code >= 0 else \
        {"signal": -code, "code": 128 - code, "time": ended}
    write_record(status_dir, f"rank{rank}.exit", record)
    return record["code"]


if __name__ == "__main__":
    sys.exit(main())
