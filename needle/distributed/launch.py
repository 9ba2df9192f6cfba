"""Start N ranks of a script: ``python -m needle.distributed.launch -n 4 [--backend mpi|tcp]
[--timeout S] script.py args``.

mpi runs ``mpiexec`` (the one installed next to this Python by the ``mpich`` wheel, else the
one on PATH); tcp starts N Python processes with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
Output lines are prefixed ``[rank k]``. When a rank fails, the others are stopped and the
launcher exits with that rank's code, naming it; ``--timeout`` bounds the whole job (exit 124).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def find_mpiexec() -> str:
    """mpiexec next to sys.executable (the mpich wheel in this venv), else on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("launch: mpiexec not found, expected it next to "
                                f"{sys.executable} (pip install mpich) or on PATH, got neither")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(prefix + line.decode(errors="replace"))
        sys.stdout.flush()


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each rank's process group, then SIGKILL what is still alive after 3 s."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 0.0)):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.05)


def _rank_command(script: str, args: list[str]) -> list[str]:
    return [sys.executable, "-u", "-m", "needle.distributed._run_rank", script, *args]


def _start(nproc: int, backend: str, script: str, args: list[str], status_dir: str,
           ) -> tuple[list[subprocess.Popen], list[threading.Thread]]:
    env = dict(os.environ, NEEDLE_LAUNCH_STATUS_DIR=status_dir, PYTHONUNBUFFERED="1")
    # Ranks import needle from where the launcher did, installed or not.
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    procs, pumps = [], []
    if backend == "mpi":
        env.update(NEEDLE_DIST_BACKEND="mpi", NEEDLE_LAUNCH_PREFIX="1")
        cmd = [find_mpiexec(), "-n", str(nproc), *_rank_command(script, args)]
        procs.append(subprocess.Popen(cmd, env=env, **kw))
        pumps.append(threading.Thread(target=_pump, args=(procs[0].stdout, ""), daemon=True))
    else:
        env.update(NEEDLE_DIST_BACKEND="tcp", WORLD_SIZE=str(nproc),
                   MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(free_port()))
        for rank in range(nproc):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen(_rank_command(script, args), env=rank_env, **kw))
            pumps.append(threading.Thread(target=_pump, args=(procs[-1].stdout, f"[rank {rank}] "),
                                          daemon=True))
    for t in pumps:
        t.start()
    return procs, pumps


def _failed_rank(status_dir: str) -> tuple[int, int] | None:
    for name in sorted(os.listdir(status_dir)):
        code = int(Path(status_dir, name).read_text() or 1)
        if code != 0:
            return int(name[4:]), code
    return None


def _final_code(codes: list[int], status_dir: str, nproc: int, backend: str) -> int:
    """Exit code once every process ended; a rank that never reported (killed, os._exit,
    crashed) under mpiexec counts as a failure even when mpiexec itself exits with 0."""
    reported = {int(n[4:]) for n in os.listdir(status_dir)}
    # tcp ranks are our own children with real exit codes; under mpiexec only the status files
    # tell whether each rank finished.
    silent = [r for r in range(nproc) if r not in reported] if backend == "mpi" else []
    code = max((abs(c) for c in codes), default=0)
    if silent:
        print(f"launch: ranks {silent} ended without reporting an exit status (killed or "
              f"crashed; {backend} exit code {code})", file=sys.stderr)
        return code or 1
    if code:
        print(f"launch: {backend} job exited with code {code}", file=sys.stderr)
    return code


def run(nproc: int, script: str, args: list[str] | None = None, backend: str = "mpi",
        timeout: float | None = None) -> int:
    """Run ``script`` on ``nproc`` ranks and return the job's exit code (0 when all succeed).

    Example (not run here: it starts processes):
        code = run(2, "train.py", ["--epochs", "1"], backend="tcp", timeout=600)
    """
    if backend not in ("mpi", "tcp"):
        raise ValueError(f"launch: unknown backend, expected 'mpi' or 'tcp', got {backend!r}")
    status_dir = tempfile.mkdtemp(prefix="needle-launch-")
    procs, pumps = _start(nproc, backend, script, list(args or []), status_dir)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            failed = _failed_rank(status_dir)
            codes = [p.poll() for p in procs]
            if failed is None and backend == "tcp":
                failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                print(f"launch: rank {failed[0]} failed with exit code {failed[1]}; "
                      "stopping the other ranks", file=sys.stderr)
                _stop(procs)
                return failed[1] or 1
            if all(c is not None for c in codes):
                return _final_code(codes, status_dir, nproc, backend)
            if deadline is not None and time.monotonic() > deadline:
                _stop(procs)
                done = {int(n[4:]) for n in os.listdir(status_dir)}
                running = [r for r in range(nproc) if r not in done]
                print(f"launch: timed out after {timeout:g} s; ranks {running} were still "
                      "running and have been stopped", file=sys.stderr)
                return 124
            time.sleep(0.05)
    finally:
        for t in pumps:
            t.join(timeout=2.0)
        shutil.rmtree(status_dir, ignore_errors=True)


def relaunch(nproc: int, backend: str | None = None, timeout: float | None = None) -> None:
    """For scripts with an ``--nproc N`` flag: when called in the user's own process with
    ``nproc > 1``, re-run this same command line on ``nproc`` ranks and exit with the job's code.
    Inside a rank (or with nproc == 1) it returns and the script carries on.

    Example (top of a training script, before any work):
        >>> relaunch(1)  # nproc == 1: nothing to do
    """
    if nproc <= 1 or "NEEDLE_LAUNCH_RANK" in os.environ or "PMI_RANK" in os.environ:
        return
    backend = backend or os.environ.get("NEEDLE_DIST_BACKEND", "mpi")
    sys.exit(run(nproc, sys.argv[0], sys.argv[1:], backend, timeout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m needle.distributed.launch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    parser.add_argument("--backend", choices=["mpi", "tcp"], default="mpi")
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the whole job")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    if opts.nproc < 1:
        parser.error(f"-n must be at least 1, got {opts.nproc}")
    return run(opts.nproc, opts.script, opts.args, opts.backend, opts.timeout)


if __name__ == "__main__":
    sys.exit(main())
