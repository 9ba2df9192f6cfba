"""Start the ranks of a script: ``python -m needle.distributed.launch -n 4 [--backend mpi|tcp|nccl]
[--timeout S] script.py args`` (or ``-m module args``: each rank runs the module as
``python -m`` does).

mpi runs ``mpiexec`` (the one installed next to this Python by the ``mpich`` wheel, else the
one on PATH), with ``--hostfile FILE`` handed to it for many machines; tcp starts the ranks as
Python processes, torchrun-style: ``--nnodes N --node-rank R --master-addr A --master-port P``
starts this node's ``-n`` ranks of an N-node job; nccl starts them as tcp does (or as
``$NEEDLE_DIST_NCCL_HOST`` says) and their ``init_process_group()`` makes NCCL groups for
``cuda()`` tensors. Every rank sees RANK, LOCAL_RANK, WORLD_SIZE
and LOCAL_WORLD_SIZE. Output lines are prefixed ``[rank k]``. A progress bar (text redrawn
after carriage returns) redraws in place when the launcher's stdout is a terminal; in a file or
a pipe only each bar's last frame is kept. Progress prints on rank 0 only, unless
``--progress-ranks all`` (or a list such as ``0,1``; ``$NEEDLE_PROGRESS_RANKS``).

The launcher owns its ranks. When one fails it names the rank that failed first and how (exit
code, signal, or exception with that rank's traceback), says which ranks failed only because of
it, stops the rest and exits with the first failure's code. On SIGINT or SIGTERM it stops every
process of the job (SIGKILL after a bounded wait), removes its temporary files and exits with
130 or 143; under mpi a SIGINT goes first to the ranks alone (mpiexec, signalled, would answer
with its own messages and kill them before they stop on their own), and what mpiexec writes
after it is dropped. ``--timeout`` bounds the whole job (exit 124). A rank that reported success but
does not exit within ``$NEEDLE_LAUNCH_EXIT_GRACE`` seconds (default 30) is stopped and named;
the verdict is then the ranks' own. An expendable rank (a parameter-server
worker) that is killed does not fail the job: ``--restart-workers N`` restarts it up to N times
(tcp), and it rejoins the running job; otherwise it is reported lost and the others go on.

An expendable rank never holds a finished job: once every rank of this node that is not
expendable has ended without failing, an expendable rank still alive ``--finish-grace``
seconds later (``finish_grace=``, else ``$NEEDLE_LAUNCH_FINISH_GRACE``, default 10) — frozen
(SIGSTOP), hung, or declared dead by the parameter servers and never told — is stopped
(SIGTERM and SIGCONT, SIGKILL after a bounded wait) and named, and the job's exit status is
the other ranks' verdict.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from needle._core.errors import CommError, NeedleError

from ._launch_job import Job
from ._launch_report import verdict
from ._nccl import HOST_ENV as NCCL_HOST_ENV
from ._run_rank import STATUS_DIR_ENV
from ._tcp_security import AUTH_ENV, JOB_ENV, SECRET_ENV, check_secret
from .progress import COLUMNS_ENV, PROGRESS_RANKS_ENV, shows_progress

FAILURE_GRACE = 3.0  # seconds to let the other ranks report after the first failure
STOP_GRACE = 5.0     # seconds between the first signal and SIGKILL when stopping
EXIT_GRACE_ENV = "NEEDLE_LAUNCH_EXIT_GRACE"  # seconds a rank that reported may take to exit
FINISH_GRACE_ENV = "NEEDLE_LAUNCH_FINISH_GRACE"  # seconds an expendable rank may outlive the job
FINISH_GRACE = 10.0  # long enough for a worker to see the servers' end and exit on its own


class LaunchSettingError(NeedleError, ValueError):
    """A launcher setting (argument or environment variable) with a value it cannot use."""


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


class Nodes:
    """Where this launcher's ranks sit in the job (tcp: torchrun-style; mpi: one mpiexec)."""

    def __init__(self, nproc: int, nnodes: int = 1, node_rank: int = 0,
                 master_addr: str | None = None, master_port: int | None = None,
                 local_addr: str | None = None, hostfile: str | None = None):
        if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
            raise ValueError(f"launch: bad layout, expected -n >= 1, --nnodes >= 1 and 0 <= "
                             f"--node-rank < --nnodes, got -n {nproc}, --nnodes {nnodes}, "
                             f"--node-rank {node_rank}")
        if nnodes > 1 and master_port is None:
            raise ValueError("launch: --nnodes > 1 needs --master-port (the same on every "
                             "node), got none")
        self.nproc, self.nnodes, self.node_rank = nproc, nnodes, node_rank
        self.master_addr, self.master_port = master_addr, master_port
        self.local_addr, self.hostfile = local_addr, hostfile

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def ranks(self) -> list[int]:
        return [self.node_rank * self.nproc + i for i in range(self.nproc)]


def _job_env(backend: str, nodes: Nodes, status_dir: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for stale in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "NEEDLE_LAUNCH_RANK"):
        env.pop(stale, None)  # set below (tcp) or by each rank's supervisor (mpi)
    env[STATUS_DIR_ENV] = status_dir
    # Ranks import needle from where the launcher did, installed or not.
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env["NEEDLE_DIST_BACKEND"] = backend
    if sys.stdout.isatty():  # progress bars fit the terminal they are redrawn on
        env[COLUMNS_ENV] = str(shutil.get_terminal_size().columns)
    if backend == "mpi":
        env["NEEDLE_LAUNCH_PREFIX"] = "1"
        return env
    if not env.get(SECRET_ENV):
        if nodes.nnodes > 1:
            raise ValueError(f"launch: --nnodes > 1 needs the job secret, expected "
                             f"{SECRET_ENV} (the same on every node) or --secret-file, got "
                             "neither")
        env[SECRET_ENV] = secrets.token_hex(32)
    if nodes.nnodes == 1:
        # This launcher starts every rank, so each launch is its own job even when the user
        # gave the secret: another launch on the same port is a stranger, never a member.
        env[JOB_ENV] = secrets.token_hex(8)
    env.update(WORLD_SIZE=str(nodes.world_size), LOCAL_WORLD_SIZE=str(nodes.nproc),
               GROUP_RANK=str(nodes.node_rank),
               MASTER_ADDR=nodes.master_addr or env.get("MASTER_ADDR", "127.0.0.1"),
               MASTER_PORT=str(nodes.master_port or free_port()))
    if nodes.local_addr:
        env["NEEDLE_DIST_LOCAL_ADDR"] = nodes.local_addr
    return env


def _exit_grace() -> float:
    return float(os.environ.get(EXIT_GRACE_ENV, "30"))


def _finish_grace(given: float | None) -> float:
    """``given``, else ``$NEEDLE_LAUNCH_FINISH_GRACE``, else :data:`FINISH_GRACE` (seconds)."""
    if given is None:
        text = os.environ.get(FINISH_GRACE_ENV)
        try:
            given = FINISH_GRACE if text is None else float(text)
        except ValueError:
            raise LaunchSettingError(f"launch: bad ${FINISH_GRACE_ENV}, expected seconds (a "
                                     f"number >= 0), got {text!r}") from None
    if not given >= 0:  # NaN too
        raise LaunchSettingError(f"launch: bad finish grace, expected seconds >= 0, got "
                                 f"{given!r}")
    return float(given)


class _Signals:
    """SIGINT/SIGTERM received while the job runs (main thread only; elsewhere none)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, lambda s, _f: self.received.append(s))
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _watch(job: Job, signals: _Signals, deadline: float | None,
           finish_grace: float = FINISH_GRACE) -> str:
    """Wait until the job is done, failed (plus a grace to hear from the others), finished
    but for expendable ranks that outlive it by ``finish_grace`` seconds, timed out or
    interrupted; return which."""
    failed_at = reported_at = finished_at = None
    while True:
        job.poll()
        job.ask_where()
        if signals.received:
            return "interrupted"
        if job.done():
            return "done"
        if job.running() and not job.failed() and job.finished():
            # The job's result is known; what still runs is expendable (a parameter-server
            # worker the servers declared dead may be frozen, and would never end on its own).
            finished_at = finished_at or time.monotonic()
            if time.monotonic() - finished_at > finish_grace:
                return "finished"
        if not job.running() and not job.failed():
            # Every rank reported success but a process lives on (stuck in interpreter
            # shutdown): the work is done, so do not let it run into the job's timeout.
            reported_at = reported_at or time.monotonic()
            if time.monotonic() - reported_at > _exit_grace():
                return "lingering"
        if job.failed():
            failed_at = failed_at or time.monotonic()
            if not job.running() or time.monotonic() - failed_at > FAILURE_GRACE:
                return "failed"
        if deadline is not None and time.monotonic() > deadline:
            return "timeout"
        time.sleep(0.05)


def _finish(job: Job, state: str, signals: _Signals, timeout: float | None,
            finish_grace: float = FINISH_GRACE, announce_interrupt: bool = True) -> int:
    """Stop what still runs, then print the verdict (after the ranks' last output)."""
    running = job.running()
    if state == "interrupted":
        sig = signals.received[0]
        if job.backend == "mpi":  # the ranks stop on their own, mpiexec is left quiet
            job.interrupt(sig, STOP_GRACE)
        job.stop(sig, STOP_GRACE)
        code = 128 + sig
        lines = [f"launch: interrupted by {signal.Signals(sig).name}; stopped ranks {running}"]
        if not announce_interrupt:
            lines = []
    elif state == "timeout":
        job.stop(signal.SIGTERM, STOP_GRACE)
        code = 124
        lines = [f"launch: timed out after {timeout:g} s; ranks {running} were still running "
                 "and have been stopped"] + job.wait_graph()
    elif state == "lingering":
        stuck = job.lingering()
        job.stop(signal.SIGTERM, STOP_GRACE)
        code, lines = verdict(job.outcomes)
        lines.append(f"launch: ranks {stuck} reported success but had not exited "
                     f"{_exit_grace():g} s later (stuck in interpreter shutdown); they were "
                     "stopped")
    elif state == "finished":
        outlived = {rank: job.describe_process(rank) for rank in running}
        stuck = job.lingering()
        job.stop(signal.SIGTERM, STOP_GRACE,
                 why=f"was still alive {finish_grace:g} s after the job finished; stopped by "
                     "the launcher")
        code, lines = verdict(job.outcomes)
        lines += [f"launch: rank {rank} ({what}) still alive {finish_grace:g} s after the job "
                  "finished; stopped it" for rank, what in sorted(outlived.items())]
        if stuck:
            lines.append(f"launch: ranks {stuck} reported how they ended but had not exited; "
                         "they were stopped")
    else:
        if state == "failed":
            job.stop(signal.SIGTERM, STOP_GRACE)
        code, lines = verdict(job.outcomes)
        if code:  # what the ranks that timed out waited for, first: the cause in one line
            lines = job.wait_graph() + lines
        mpiexec_code = job.procs[0].returncode if job.backend == "mpi" and job.procs else 0
        if not code and mpiexec_code:
            code = mpiexec_code
            lines = [f"launch: mpiexec exited with code {code} although every rank reported "
                     "success"]
    job.join_pumps()
    for line in lines:
        print(line, file=sys.stderr)
    return code


def run(nproc: int, script: str, args: list[str] | None = None, backend: str = "mpi",
        timeout: float | None = None, nodes: Nodes | None = None,
        restart_workers: int = 0, finish_grace: float | None = None,
        module: bool = False, announce_interrupt: bool = True) -> int:
    """Run ``script`` on ``nproc`` ranks and return the job's exit code (0 when all succeed).
    With ``module`` true, ``script`` names a module each rank runs as ``python -m`` does.

    ``finish_grace``: seconds an expendable rank may stay alive once every rank that is not
    expendable has ended without failing, before it is stopped and named (None:
    ``$NEEDLE_LAUNCH_FINISH_GRACE``, else :data:`FINISH_GRACE`); its being stopped does not
    fail the job. ``announce_interrupt`` False: on SIGINT/SIGTERM print nothing (a script
    that says in its own words how it was interrupted).

    Example (not run here: it starts processes):
        code = run(2, "train.py", ["--epochs", "1"], backend="tcp", timeout=600)
    """
    if backend not in ("mpi", "tcp", "nccl"):
        raise ValueError(f"launch: unknown backend, expected 'mpi', 'tcp' or 'nccl', got "
                         f"{backend!r}")
    nccl, backend = backend == "nccl", _host_of(backend)
    if timeout is not None and not timeout > 0:  # also refuses NaN
        raise ValueError(f"launch: bad --timeout, expected seconds > 0, got {timeout!r}")
    nodes = nodes or Nodes(nproc)
    grace = _finish_grace(finish_grace)
    status_dir = tempfile.mkdtemp(prefix="needle-launch-")
    job = Job(backend, nodes.ranks(), status_dir, restarts=restart_workers)
    try:
        with _Signals() as signals:
            env = _job_env(backend, nodes, status_dir)
            if nccl:  # the ranks' groups: NCCL for cuda() tensors over this host transport
                env.update({"NEEDLE_DIST_BACKEND": "nccl", NCCL_HOST_ENV: backend})
            mpiexec = None
            if backend == "mpi":
                mpiexec = [find_mpiexec(), *(["-f", nodes.hostfile] if nodes.hostfile else []),
                           "-n", str(nproc)]
            rank_env = {r: {"RANK": str(r), "LOCAL_RANK": str(i)}
                        for i, r in enumerate(nodes.ranks())}
            job.start([*(["-m"] if module else []), script, *(args or [])], env, mpiexec,
                      rank_env)
            deadline = None if timeout is None else time.monotonic() + timeout
            state = _watch(job, signals, deadline, grace)
            return _finish(job, state, signals, timeout, grace, announce_interrupt)
    finally:
        if not job.processes_done():  # an error in the launcher itself: leave nothing behind
            job.stop(signal.SIGKILL, 0.0)
        job.join_pumps()
        _remove_shm_files(status_dir)
        shutil.rmtree(status_dir, ignore_errors=True)


def _host_of(backend: str) -> str:
    """The transport the ranks start and talk on: nccl's is $NEEDLE_DIST_NCCL_HOST, else tcp."""
    return (os.environ.get(NCCL_HOST_ENV) or "tcp") if backend == "nccl" else backend


def _remove_shm_files(status_dir: str) -> None:
    """Remove the MPICH shared-memory files that this job's ranks recorded (and only those:
    other jobs' files are never touched); a clean finalize already removed them."""
    for path in Path(status_dir).glob("shm-*.json"):
        try:
            names = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for name in names if isinstance(names, list) else []:
            base = os.path.basename(str(name))  # a file directly in /dev/shm, nothing else
            if base.startswith("mpich_shm_"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", base))


def relaunch(nproc: int, backend: str | None = None, timeout: float | None = None,
             restart_workers: int = 0, finish_grace: float | None = None,
             announce_interrupt: bool = True) -> None:
    """For scripts with an ``--nproc N`` flag: when called in the user's own process with
    ``nproc > 1``, re-run this same command line on ``nproc`` ranks and exit with the job's code.
    Inside a rank (or with nproc == 1) it returns and the script carries on. ``timeout``,
    ``restart_workers``, ``finish_grace`` and ``announce_interrupt`` are :func:`run`'s.

    Example (top of a training script, before any work):
        >>> relaunch(1)  # nproc == 1: nothing to do
    """
    if nproc <= 1 or "NEEDLE_LAUNCH_RANK" in os.environ or "PMI_RANK" in os.environ:
        return
    backend = backend or os.environ.get("NEEDLE_DIST_BACKEND", "mpi")
    sys.exit(run(nproc, sys.argv[0], sys.argv[1:], backend, timeout,
                 restart_workers=restart_workers, finish_grace=finish_grace,
                 announce_interrupt=announce_interrupt))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m needle.distributed.launch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--nproc", "--nproc-per-node", "--nproc_per_node", type=int,
                   required=True, help="ranks to start (on this node, with --nnodes)")
    p.add_argument("--backend", choices=["mpi", "tcp", "nccl"], default="mpi",
                   help="how the ranks start and talk: mpi (mpiexec), tcp, or nccl (cuda() "
                        "tensors through NCCL, the rest over tcp or $NEEDLE_DIST_NCCL_HOST) "
                        "(default: mpi)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds for the whole job, then exit 124 (default: none, no limit)")
    p.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module name: every rank runs it as 'python -m' does")
    p.add_argument("--hostfile", default=None,
                   help="mpi: hosts for mpiexec (Hydra format: one 'host[:slots]' a line)")
    p.add_argument("--nnodes", type=int, default=1, help="tcp: machines in the job")
    p.add_argument("--node-rank", type=int, default=0, help="tcp: this machine's index")
    p.add_argument("--master-addr", default=None, help="tcp: address of node 0 (rank 0)")
    p.add_argument("--master-port", type=int, default=None, help="tcp: rendezvous port")
    p.add_argument("--local-addr", default=None,
                   help="tcp: address this node's ranks listen on (default: the interface "
                        "that reaches --master-addr)")
    p.add_argument("--secret-file", default=None,
                   help=f"tcp: file holding the job secret (else ${SECRET_ENV}, else a fresh "
                        "one for a one-node job)")
    p.add_argument("--restart-workers", type=int, default=0, metavar="N",
                   help="tcp: restart an expendable rank (a parameter-server worker) that is "
                        "killed, up to N times; it rejoins the running job")
    p.add_argument("--finish-grace", type=float, default=None, metavar="S",
                   help=f"seconds an expendable rank may stay alive once every rank that is "
                        f"not expendable has ended without failing; then it is stopped and "
                        f"named (default: ${FINISH_GRACE_ENV}, else {FINISH_GRACE:g})")
    p.add_argument("--progress-ranks", default=None, metavar="RANKS",
                   help=f"ranks whose progress (needle.distributed.progress) prints: 'all' or "
                        f"a list like '0,1' (default: ${PROGRESS_RANKS_ENV}, else 0)")
    p.add_argument("script", metavar="SCRIPT", help="the script (or, with -m, module) to run")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    opts = parser.parse_args(argv)
    host = _host_of(opts.backend)
    if host == "mpi" and opts.nnodes > 1:
        parser.error("--nnodes is for --backend tcp; with mpi give --hostfile and the total -n")
    if host == "tcp" and opts.hostfile:
        parser.error("--hostfile is for --backend mpi; with tcp start one launcher per node "
                     "with --nnodes/--node-rank")
    if opts.progress_ranks is not None:
        os.environ[PROGRESS_RANKS_ENV] = opts.progress_ranks
        try:
            shows_progress(0)
        except ValueError as exc:
            parser.error(str(exc))
    if opts.secret_file:
        os.environ[SECRET_ENV] = Path(opts.secret_file).read_text().strip()
    if host == "tcp" and opts.nnodes > 1 and not os.environ.get(SECRET_ENV):
        parser.error(f"--nnodes > 1 needs the job secret, expected {SECRET_ENV} (the same on "
                     "every node) or --secret-file, got neither")
    if opts.timeout is not None and not opts.timeout > 0:
        parser.error(f"bad --timeout, expected seconds > 0, got {opts.timeout:g}")
    secret = os.environ.get(SECRET_ENV)
    if host == "tcp" and secret and os.environ.get(AUTH_ENV, "curve") == "curve":
        try:
            check_secret("launch", secret)
        except CommError as exc:
            parser.error(str(exc))
    try:
        nodes = Nodes(opts.nproc, opts.nnodes, opts.node_rank, opts.master_addr,
                      opts.master_port, opts.local_addr, opts.hostfile)
        _finish_grace(opts.finish_grace)
    except ValueError as exc:
        parser.error(str(exc))
    return run(opts.nproc, opts.script, opts.args, opts.backend, opts.timeout, nodes,
               restart_workers=opts.restart_workers, finish_grace=opts.finish_grace,
               module=opts.module)


if __name__ == "__main__":
    sys.exit(main())
