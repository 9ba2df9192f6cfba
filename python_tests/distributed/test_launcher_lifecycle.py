"""The launcher owns its ranks: signals end the whole job; ranks see the torchrun variables;
many-machine layouts (an mpi hostfile, tcp nodes on two loopback addresses) work here."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from needle.distributed.launch import free_port

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def _env(tmp_path: Path, **extra: str) -> dict:
    env = dict(os.environ, NEEDLE_TEST_JOB_TOKEN=uuid.uuid4().hex, TMPDIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT",
                 "NEEDLE_DIST_SECRET", "NEEDLE_DIST_JOB_ID"):
        env.pop(name, None)
    env.update(extra)
    return env


def _processes_with(token: str) -> list[str]:
    """Command lines of live processes whose environment carries ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if token.encode() in environ and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(f"{entry}: {cmd}")
    return found


class _Lines:
    """Collects a process's stdout lines on a thread (so that its pipe never fills)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)

    def wait_for(self, *needles: str, seconds: float = 120.0) -> None:
        end = time.monotonic() + seconds
        while not all(any(n in line for line in self.lines) for n in needles):
            assert time.monotonic() < end, f"never saw {needles}: {self.lines[-20:]}"
            time.sleep(0.05)


def _start_launcher(env: dict, *args: str) -> tuple[subprocess.Popen, _Lines]:
    proc = subprocess.Popen([sys.executable, "-m", "needle.distributed.launch", *args],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return proc, _Lines(proc)


@pytest.mark.parametrize("mode", ["hang", "stubborn"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_signal_stops_every_process_of_the_job(tmp_path: Path, backend: str, sig: int,
                                               mode: str) -> None:
    """SIGINT/SIGTERM to the launcher: it exits 130/143, no process of the job survives (not
    even a rank that ignores both signals), and its temporary folder is gone."""
    env = _env(tmp_path)
    proc, out = _start_launcher(env, "-n", "2", "--backend", backend,
                                str(SCRIPTS / "fail_or_hang.py"), mode)
    out.wait_for("[rank 0] started rank 0", "[rank 1] started rank 1")
    assert list(tmp_path.glob("needle-launch-*"))  # the launcher's folder exists while it runs
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 128 + sig, err
    assert f"launch: interrupted by {signal.Signals(sig).name}" in err, err
    end = time.monotonic() + 10  # the kernel may take a moment to reap
    while (left := _processes_with(env["NEEDLE_TEST_JOB_TOKEN"])) and time.monotonic() < end:
        time.sleep(0.1)
    assert not left, left
    assert not list(tmp_path.glob("needle-launch-*"))


@pytest.mark.parametrize("mode", ["hang", "stubborn"])
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_killed_launcher_leaves_no_process_behind(tmp_path: Path, backend: str,
                                                  mode: str) -> None:
    """Even SIGKILL of the launcher (no handler can run) ends the job: supervisors and
    mpiexec are terminated by the kernel when their parent dies, and stop their ranks."""
    env = _env(tmp_path)
    proc, out = _start_launcher(env, "-n", "2", "--backend", backend,
                                str(SCRIPTS / "fail_or_hang.py"), mode)
    out.wait_for("[rank 0] started rank 0", "[rank 1] started rank 1")
    proc.kill()
    proc.communicate(timeout=30)
    end = time.monotonic() + 30  # SIGTERM, then SIGKILL after the 5 s grace
    while (left := _processes_with(env["NEEDLE_TEST_JOB_TOKEN"])) and time.monotonic() < end:
        time.sleep(0.2)
    assert not left, left


def test_relaunching_script_is_stopped_whole_by_a_signal(tmp_path: Path) -> None:
    """A training script that relaunches itself (``--nproc``) owns its ranks the same way."""
    script = tmp_path / "relaunching.py"
    script.write_text(
        "import sys, time\n"
        "from needle.distributed.launch import relaunch\n"
        "relaunch(2, backend='tcp')\n"
        "import needle.distributed as dist\n"
        "dist.init_process_group(timeout=120)\n"
        "print('started rank', dist.get_rank(), flush=True)\n"
        "time.sleep(120)\n")
    env = _env(tmp_path)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = _Lines(proc)
    out.wait_for("[rank 0] started rank 0", "[rank 1] started rank 1")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    end = time.monotonic() + 10
    while (left := _processes_with(env["NEEDLE_TEST_JOB_TOKEN"])) and time.monotonic() < end:
        time.sleep(0.1)
    assert not left, left


def _reports(stdout: str) -> dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        if "REPORT " in line:
            report = json.loads(line.split("REPORT ", 1)[1])
            found[report["rank"]] = report
    return found


def _launch(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "needle.distributed.launch", "--timeout",
                           str(timeout), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout + 60)


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_every_backend_sets_rank_variables(tmp_path: Path, backend: str) -> None:
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, before init_process_group already,
    even when stale values are inherited from the launcher's own environment."""
    env = _env(tmp_path, RANK="7", LOCAL_RANK="7", WORLD_SIZE="9", LOCAL_WORLD_SIZE="9")
    out = _launch(env, "-n", "2", "--backend", backend, str(SCRIPTS / "env_report.py"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    reports = _reports(out.stdout)
    for rank in (0, 1):
        want = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2"}
        assert reports[rank]["before"] == want == reports[rank]["after"], reports
        assert reports[rank]["sum"] == 3.0


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_module_runs_on_every_rank(tmp_path: Path, backend: str) -> None:
    """``--nproc_per_node 2 -m module args``: each rank runs the module as ``python -m`` does
    (found on PYTHONPATH, as ``__main__``, with its arguments), and the ranks form one job."""
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join((str(SCRIPTS), env["PYTHONPATH"]))
    out = _launch(env, "--nproc_per_node", "2", "--backend", backend, "-m", "env_report",
                  "--flag", "x")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    reports = _reports(out.stdout)
    assert sorted(reports) == [0, 1] and all(r["sum"] == 3.0 for r in reports.values())
    assert all(r["argv"] == ["--flag", "x"] and r["name"] == "__main__"
               for r in reports.values()), reports


def test_help_shows_the_defaults() -> None:
    out = subprocess.run([sys.executable, "-m", "needle.distributed.launch", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    text = " ".join(out.stdout.split())  # argparse wraps lines where it likes
    assert out.returncode == 0 and "--nproc_per_node" in text and "-m, --module" in text
    assert "(default: mpi)" in text and "(default: none, no limit)" in text


def test_mpi_hostfile_is_handed_to_mpiexec(tmp_path: Path) -> None:
    """A hostfile naming this host twice runs both ranks here; one naming a host that does
    not exist makes mpiexec fail, so the file really reaches it."""
    host = os.uname().nodename
    good = tmp_path / "hosts"
    good.write_text(f"{host}:1\n{host}:1\n")
    out = _launch(_env(tmp_path), "-n", "2", "--hostfile", str(good),
                  str(SCRIPTS / "env_report.py"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    reports = _reports(out.stdout)
    assert sorted(reports) == [0, 1] and all(r["sum"] == 3.0 for r in reports.values())
    assert [reports[r]["before"]["WORLD_SIZE"] for r in (0, 1)] == ["2", "2"]
    bad = tmp_path / "bad-hosts"
    bad.write_text(f"{host}:1\nneedle-no-such-host.invalid:1\n")
    out = _launch(_env(tmp_path), "-n", "2", "--hostfile", str(bad),
                  str(SCRIPTS / "env_report.py"), timeout=60)
    assert out.returncode not in (0, 124), out.stdout[-3000:] + out.stderr
    assert "launch: rank" in out.stderr


def test_two_tcp_nodes_on_loopback_addresses(tmp_path: Path) -> None:
    """Two launchers, torchrun-style, one per "node": node 0 on 127.0.0.1, node 1 listening
    on 127.0.0.2, sharing a secret and a master port; two ranks per node."""
    env = _env(tmp_path, NEEDLE_DIST_SECRET=uuid.uuid4().hex)
    port = str(free_port())
    nodes = []
    for node, local in ((0, "127.0.0.1"), (1, "127.0.0.2")):
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "needle.distributed.launch", "--backend", "tcp", "-n", "2",
             "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
             "--master-port", port, "--local-addr", local, "--timeout", "120",
             str(SCRIPTS / "env_report.py")],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in nodes]
    for p, (stdout, stderr) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, stdout[-3000:] + stderr
    reports = {**_reports(outs[0][0]), **_reports(outs[1][0])}
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, report in reports.items():
        assert report["before"] == {"RANK": str(rank), "LOCAL_RANK": str(rank % 2),
                                    "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, report
        assert report["sum"] == 10.0
        want_host = "127.0.0.1" if rank < 2 else "127.0.0.2"
        assert report["address"].startswith(f"tcp://{want_host}:"), report
    assert sorted(_reports(outs[1][0])) == [2, 3]  # node 1 ran ranks 2 and 3


def test_many_nodes_need_a_shared_secret(tmp_path: Path) -> None:
    out = _launch(_env(tmp_path), "--backend", "tcp", "-n", "1", "--nnodes", "2",
                  "--master-port", str(free_port()), str(SCRIPTS / "env_report.py"))
    assert out.returncode != 0
    assert "--nnodes > 1 needs the job secret" in out.stderr, out.stderr


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_rank_stuck_after_reporting_success_is_stopped_not_timed_out(tmp_path: Path,
                                                                      backend: str) -> None:
    """A rank that reported success but never exits (stuck in interpreter shutdown) is stopped
    after the exit grace and named; the job's work is done, so the verdict is success, not the
    job timeout's 124."""
    env = _env(tmp_path, NEEDLE_LAUNCH_EXIT_GRACE="2")
    out = _launch(env, "-n", "2", "--backend", backend, str(SCRIPTS / "hang_at_exit.py"), "1",
                  timeout=150)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    assert "[rank 0] WORK DONE rank 0" in out.stdout and "[rank 1] WORK DONE rank 1" in out.stdout
    assert "launch: ranks [1] reported success but had not exited 2 s later" in out.stderr
