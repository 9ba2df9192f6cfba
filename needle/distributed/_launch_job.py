"""The processes of one launched job: start them, watch how each rank ends, stop them all.

tcp: one supervisor (``_run_rank``) per rank, each our child started with ``setsid``, its
output prefixed here. mpi: one ``mpiexec`` (started with ``setsid``); Hydra starts every rank
with its own ``setsid`` too, so stopping the job signals every process group of the job's
process tree, not only mpiexec's, and finishes with SIGKILL after a bounded wait.

Expendable ranks (tcp): a rank that wrote ``rank<k>.expendable`` to the status directory (a
parameter-server worker does) may be killed without failing the job: it is restarted, up to
``restarts`` times, with ``NEEDLE_DIST_REJOIN`` set so that it rejoins the running job, and
after that it is recorded as lost while the others go on. An expendable rank that raises or
exits with an error still fails the job: only a killed or vanished process is tolerated. Once
every rank that is not expendable has ended without failing, the job is :meth:`Job.finished`:
expendable ranks still alive then (a frozen worker never ends on its own) are the launcher's
to stop.
"""
from __future__ import annotations

import codecs
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ._launch_output import RankOutput
from ._launch_report import Outcome, outcome_from_records, read_record

SUPERVISOR = str(Path(__file__).with_name("_run_rank.py"))


def _pump(stream, output: RankOutput, prefix: str) -> None:
    """Copy a rank's output (or mpiexec's) to ``output``, each line prefixed with ``prefix``."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    into = output.stream(prefix)
    fd = stream.fileno()
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        into.feed(decoder.decode(chunk))
    into.close()


def descendants(roots: list[int]) -> list[int]:
    """Every live process below ``roots`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` in /proc ("R", "S", "T" stopped, "Z"...; "" unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Job:
    """The running job on this node: ``ranks`` are the global ranks started here."""

    def __init__(self, backend: str, ranks: list[int], status_dir: str, restarts: int = 0):
        self.backend, self.ranks, self.status_dir = backend, ranks, status_dir
        self.restarts_left = {r: int(restarts) for r in ranks}
        self.restarted: dict[int, int] = {}
        self._started: tuple | None = None
        self.procs: list[subprocess.Popen] = []
        self.by_rank: dict[int, subprocess.Popen] = {}  # tcp: rank -> its supervisor
        self.pumps: list[threading.Thread] = []
        self.outcomes: dict[int, Outcome] = {}
        self._pids: dict[int, int] = {}
        self._asked: set[int] = set()  # ranks asked where they are (ask_where)
        self.output = RankOutput()

    # ----- starting ---------------------------------------------------------------------
    def start(self, cmd_tail: list[str], env: dict, mpiexec: list[str] | None,
              rank_env: dict[int, dict]) -> None:
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        supervisor = [sys.executable, "-u", SUPERVISOR, *cmd_tail]
        if mpiexec is not None:  # through --exec: mpiexec is terminated if we die
            cmd = [sys.executable, SUPERVISOR, "--exec", *mpiexec, *supervisor]
            self._add(subprocess.Popen(cmd, env=env, **kw), "")
            return
        self._started = (supervisor, env, rank_env, kw)
        for rank in self.ranks:
            proc = subprocess.Popen(supervisor, env={**env, **rank_env[rank]}, **kw)
            self.by_rank[rank] = proc
            self._add(proc, f"[rank {rank}] ")

    def _restart(self, rank: int, outcome: Outcome) -> None:
        """Start ``rank`` again (it rejoins the running job; see the module doc)."""
        from ._launch_report import describe
        from ._tcp_transport import REJOIN_ENV

        self.restarts_left[rank] -= 1
        self.restarted[rank] = self.restarted.get(rank, 0) + 1
        for name in ("json", "exit", "pid", "expendable"):
            try:
                os.remove(os.path.join(self.status_dir, f"rank{rank}.{name}"))
            except OSError:
                pass
        self._pids.pop(rank, None)
        assert self._started is not None, "_restart before _start"
        supervisor, env, rank_env, kw = self._started
        print(f"launch: rank {rank} {describe(outcome)}; restarting it (restart "
              f"{self.restarted[rank]}), it rejoins the job", file=sys.stderr, flush=True)
        proc = subprocess.Popen(supervisor, env={**env, **rank_env[rank], REJOIN_ENV: str(
            self.restarted[rank])}, **kw)
        self.by_rank[rank] = proc
        self._add(proc, f"[rank {rank}] ")

    def _expendable(self, rank: int) -> bool:
        return self.backend == "tcp" and os.path.exists(
            os.path.join(self.status_dir, f"rank{rank}.expendable"))

    def _add(self, proc: subprocess.Popen, prefix: str) -> None:
        self.procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc.stdout, self.output, prefix),
                                daemon=True)
        pump.start()
        self.pumps.append(pump)

    # ----- watching ---------------------------------------------------------------------
    def pid_of(self, rank: int) -> int | None:
        if rank not in self._pids:
            record = read_record(self.status_dir, f"rank{rank}.pid")
            if record is None:
                return None
            self._pids[rank] = int(record["pid"])
        return self._pids[rank]

    def _records(self, rank: int) -> Outcome | None:
        return outcome_from_records(rank, read_record(self.status_dir, f"rank{rank}.json"),
                                    read_record(self.status_dir, f"rank{rank}.exit"))

    def poll(self) -> None:
        """Record the outcome of every rank that ended since the last call."""
        for rank in self.ranks:
            if rank in self.outcomes:
                continue
            outcome = self._records(rank) or self._silent_end(rank)
            if outcome is None:
                continue
            if outcome.kind in ("signal", "vanished") and self._expendable(rank):
                if self.restarts_left[rank] > 0:
                    self._restart(rank, outcome)
                    continue
                outcome.kind, outcome.detail = "lost", f"{outcome.kind}: {outcome.detail}"
            self.outcomes[rank] = outcome

    def _silent_end(self, rank: int) -> Outcome | None:
        """The outcome of a rank whose process ended without records, else None."""
        proc = self.by_rank.get(rank)
        pid = self.pid_of(rank)
        if proc is not None:
            code = proc.poll()
            if code is None:
                return None
            detail = f"its supervisor ended with {code}"
        elif pid is not None:
            if alive(pid):
                return None
            code, detail = 1, "its supervisor was killed"
        else:
            mpiexec = self.procs[0] if self.procs else None
            if mpiexec is None or mpiexec.poll() is None:
                return None
            return Outcome(rank, "unstarted", mpiexec.returncode or 1, time.time(),
                           f"mpiexec exited with code {mpiexec.returncode}")
        # Records are written before the process ends: read them once more.
        return self._records(rank) or Outcome(rank, "vanished", code or 1, time.time(), detail)

    def ask_where(self) -> None:
        """Ask each running rank that timed-out ranks wait for but that itself waits in no
        needle call where it is (SIGUSR1, forwarded by its supervisor): it writes
        ``rank<k>.where``, which the verdict names ("it was at file:line")."""
        from ._waits import follow, read_waits

        records = read_waits(self.status_dir)
        for rank in records:
            end = follow(records, rank)[-1]
            if end in records or end in self._asked or end not in self.ranks \
                    or end in self.outcomes:
                continue
            self._asked.add(end)
            pid = self.by_rank[end].pid if end in self.by_rank else self.pid_of(end)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except (ProcessLookupError, PermissionError):
                    pass

    def wait_graph(self) -> list[str]:
        """The wait-for graph's verdict lines (deadlocks, ranks that never arrived)."""
        from ._waits import explain, read_waits

        seen = {r: w["site"] for r in self.ranks
                if (w := read_record(self.status_dir, f"rank{r}.where")) and "site" in w}
        return ["launch: " + line for line in explain(read_waits(self.status_dir), seen)]

    def processes_done(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def failed(self) -> bool:
        return any(o.kind not in ("ok", "stopped", "lost") for o in self.outcomes.values())

    def done(self) -> bool:
        return self.processes_done() and len(self.outcomes) == len(self.ranks)

    def running(self) -> list[int]:
        return [r for r in self.ranks if r not in self.outcomes]

    def finished(self) -> bool:
        """True when the job's result is known although ranks still run: every rank here that
        is not expendable has ended, and at least one such rank exists (a node of expendable
        ranks only cannot tell that the job is over)."""
        needed = [r for r in self.ranks if not self._expendable(r)]
        return bool(needed) and all(r in self.outcomes for r in needed)

    def describe_process(self, rank: int) -> str:
        """``pid N`` of the rank's script process (else its supervisor's), with ", frozen"
        when the kernel holds it stopped (SIGSTOP): the words the launcher names it with."""
        supervisor = self.by_rank[rank].pid if rank in self.by_rank else self.pid_of(rank)
        if supervisor is None:
            return "pid unknown"
        below = [p for p in descendants([supervisor]) if alive(p)]
        pid = below[0] if below else supervisor
        frozen = process_state(pid) in ("T", "t")
        return f"pid {pid}" + (", frozen" if frozen else "")

    def lingering(self) -> list[int]:
        """Ranks that reported how they ended but whose process is still alive."""
        out = []
        for rank in self.outcomes:
            proc = self.by_rank.get(rank)
            pid = self.pid_of(rank)
            if (proc.poll() is None) if proc is not None else (pid is not None and alive(pid)):
                out.append(rank)
        return sorted(out)

    # ----- stopping ---------------------------------------------------------------------
    def interrupt(self, sig: int, grace: float) -> None:
        """mpi: pass ``sig`` to each running rank's supervisor only (it forwards it to the
        script), not to mpiexec, which would answer with its own messages and kill the ranks
        before they stop on their own; wait up to ``grace`` seconds for the job to end. What
        mpiexec itself writes from now on is dropped (rank output still passes)."""
        self.output.drop_untagged = True
        for rank in self.running():
            pid = self.pid_of(rank)
            if pid is not None:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        end = time.monotonic() + grace
        while time.monotonic() < end:
            self.poll()
            if not self.running() and self.processes_done():
                return
            time.sleep(0.05)

    def _tree(self) -> list[int]:
        roots = [p.pid for p in self.procs if p.poll() is None]
        roots += [pid for r in self.ranks if (pid := self.pid_of(r)) and alive(pid)]
        return sorted(set(roots + descendants(roots)))

    @staticmethod
    def _signal_all(pids: list[int], sig: int) -> None:
        own_group = os.getpgrp()
        groups = set()
        for pid in pids:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
        for group in groups - {own_group}:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _wait_gone(self, pids: list[int], seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for p in self.procs:
                p.poll()  # reap our children so that they stop counting as alive
            if not any(alive(pid) for pid in pids):
                return True
            time.sleep(0.05)
        return False

    def stop(self, sig: int = signal.SIGTERM, grace: float = 5.0, why: str = "") -> None:
        """Signal every process of the job (``sig``, then SIGKILL after ``grace`` seconds);
        ranks still running are recorded as stopped."""
        self.poll()
        still = self.running()
        pids = self._tree()
        self._signal_all(pids, sig)
        if sig != signal.SIGKILL:
            # A SIGSTOPped process keeps ``sig`` pending until it continues: let it act now
            # rather than wait the whole grace for the SIGKILL.
            self._signal_all(pids, signal.SIGCONT)
        if not self._wait_gone(pids, grace):
            pids = sorted(set(pids) | set(self._tree()))
            self._signal_all(pids, signal.SIGKILL)
            self._wait_gone(pids, 10.0)
        for p in self.procs:
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        name = signal.Signals(sig).name
        for rank in still:
            self.outcomes[rank] = Outcome(rank, "stopped", 128 + sig, time.time(),
                                          why or f"was stopped by the launcher ({name})")

    def join_pumps(self) -> None:
        for t in self.pumps:
            t.join(timeout=2.0)
