"""A frozen rank never holds a finished job: a parameter-server worker that SIGSTOPs itself is
declared dead by the servers, training finishes, and the launcher stops the frozen process
after its finish grace, names it, exits with the job's own status and leaves nothing behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from needle.distributed import launch
from needle.distributed._launch_job import Job, alive, process_state
from needle.distributed._run_rank import write_record

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "apps" / "train.py"


def _live_pids_mentioning(marker: str) -> list[str]:
    """``pid: command line`` of every live (not zombie) process whose command line holds
    ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd and process_state(int(entry)) not in ("", "Z"):
            found.append(f"{entry}: {cmd}")
    return found


def _run_train(out: Path, *args: str, seconds: float = 240) -> subprocess.CompletedProcess:
    """apps/train.py with ``args``; stopped by SIGTERM (the launcher then stops its ranks) if
    it runs past ``seconds``, which fails the test with its output."""
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1",
               NEEDLE_LAUNCH_FINISH_GRACE="2")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT",
                 "NEEDLE_DIST_SECRET", "NEEDLE_DIST_JOB_ID", "NEEDLE_DIST_BACKEND"):
        env.pop(name, None)
    cmd = [sys.executable, str(SCRIPT), *args, "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"train.py still ran {seconds:g} s later (a frozen rank held the job):\n"
                    f"{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.mpi
@pytest.mark.timeout(360)
def test_frozen_ps_worker_is_stopped_named_and_the_job_succeeds(tmp_path: Path) -> None:
    """Worker rank 2 SIGSTOPs itself at step 3; the server declares it dead after 3 s and
    writes the summary; the launcher stops rank 2 two seconds after the job finished, names
    it with its pid, and exits 0. No process of the job is left afterwards."""
    out = tmp_path / f"frozen-{uuid.uuid4().hex}"  # unique: every rank's command line has it
    done = _run_train(out, "--model", "mlp", "--max-steps", "8", "--epochs", "1",
                      "--no-progress", "--strategy", "ps", "--servers", "1", "--nproc", "2",
                      "--ps-mode", "async", "--dead-after", "3", "--freeze-worker", "2@3")
    text = done.stdout + done.stderr
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    frozen = re.search(r"--freeze-worker 2@3: sending SIGSTOP to myself \(pid (\d+)\)", text)
    assert frozen, text[-3000:]
    pid = int(frozen.group(1))
    assert (f"launch: rank 2 (pid {pid}, frozen) still alive 2 s after the job finished; "
            "stopped it") in done.stderr, done.stderr[-3000:]
    block = json.loads((out / "summary.json").read_text())["ps"]
    assert block["workers_lost"] == 1 and block["worker_clocks"][0] == 8, block

    end = time.monotonic() + 30  # the kernel may take a moment to reap the killed ranks
    while (left := _live_pids_mentioning(out.name)) and time.monotonic() < end:
        time.sleep(0.2)
    assert not left, left
    assert not alive(pid)


# ----- the launcher's logic, with stand-in processes (no ranks, no training) ---------------


class _NoSignals:
    received: list[int] = []


def _stand_in(frozen: bool) -> subprocess.Popen:
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    if frozen:
        os.kill(proc.pid, signal.SIGSTOP)
        end = time.monotonic() + 10
        while process_state(proc.pid) != "T" and time.monotonic() < end:
            time.sleep(0.01)
    return proc


def _job(tmp_path: Path, expendable: list[int], ok: list[int],
         running: dict[int, subprocess.Popen]) -> Job:
    """A tcp Job over ranks 0..2 whose status folder says what the arguments say."""
    status = str(tmp_path)
    now = time.time()
    for rank in expendable:
        write_record(status, f"rank{rank}.expendable", {"rank": rank})
    for rank in ok:
        write_record(status, f"rank{rank}.json", {"code": 0, "time": now})
        write_record(status, f"rank{rank}.exit", {"code": 0, "time": now})
    for rank, proc in running.items():
        write_record(status, f"rank{rank}.pid", {"pid": proc.pid, "time": now})
    return Job("tcp", [0, 1, 2], status)


def test_launcher_stops_an_expendable_rank_that_outlives_the_job(tmp_path: Path,
                                                                 capsys) -> None:
    """Ranks 0 and 1 succeeded, expendable rank 2 is frozen: the job is finished, rank 2 is
    stopped after the grace and named, and the verdict is success."""
    frozen = _stand_in(frozen=True)
    try:
        job = _job(tmp_path, expendable=[1, 2], ok=[0, 1], running={2: frozen})
        job.poll()
        assert job.finished() and job.running() == [2]
        assert launch._watch(job, _NoSignals(), time.monotonic() + 60, 0.2) == "finished"
        code = launch._finish(job, "finished", _NoSignals(), None, 0.2)
        assert code == 0
        assert frozen.wait(timeout=30) in (-signal.SIGTERM, -signal.SIGKILL)
        err = capsys.readouterr().err
        assert (f"launch: rank 2 (pid {frozen.pid}, frozen) still alive 0.2 s after the job "
                "finished; stopped it") in err, err
        assert job.outcomes[2].kind == "stopped"
    finally:
        frozen.kill()
        frozen.wait()


@pytest.mark.parametrize("expendable", [[1], [0, 1, 2]], ids=["needed-rank-runs", "all-spare"])
def test_job_is_not_finished_while_its_result_is_unknown(tmp_path: Path,
                                                         expendable: list[int]) -> None:
    """Not finished while a rank that is not expendable still runs, nor on a node whose ranks
    are all expendable (it cannot tell that the job is over): the watch runs into the
    deadline instead."""
    spare = _stand_in(frozen=False)
    try:
        job = _job(tmp_path, expendable=expendable, ok=[0], running={1: spare, 2: spare})
        job.poll()
        assert not job.finished()
        assert launch._watch(job, _NoSignals(), time.monotonic() + 0.5, 0.0) == "timeout"
    finally:
        spare.kill()
        spare.wait()


def test_finish_grace_setting(monkeypatch) -> None:
    monkeypatch.delenv(launch.FINISH_GRACE_ENV, raising=False)
    assert launch._finish_grace(None) == launch.FINISH_GRACE == 10.0
    assert launch._finish_grace(3) == 3.0
    monkeypatch.setenv(launch.FINISH_GRACE_ENV, "0.5")
    assert launch._finish_grace(None) == 0.5
    monkeypatch.setenv(launch.FINISH_GRACE_ENV, "soon")
    with pytest.raises(launch.LaunchSettingError, match="NEEDLE_LAUNCH_FINISH_GRACE.*'soon'"):
        launch._finish_grace(None)
    with pytest.raises(launch.LaunchSettingError, match="expected seconds >= 0, got -1"):
        launch._finish_grace(-1)


def test_freeze_worker_flag_is_checked(monkeypatch) -> None:
    """``--freeze-worker RANK@STEP`` is parsed and checked like ``--kill-worker``."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(ROOT / "apps"))
    from training.config import UsageError
    from training.faults import parse_faults

    def cfg(spec: str) -> SimpleNamespace:
        return SimpleNamespace(slow_worker=None, kill_worker=None, freeze_worker=spec,
                               die_at_step=None, die_after_micro_batches=None)

    faults = parse_faults(cfg("2@3"), 3)
    assert (faults.freeze_rank, faults.freeze_step, faults.kill_rank) == (2, 3, None)
    for spec, message in (("2", "--freeze-worker expects RANK@STEP, got '2'"),
                          ("x@3", "--freeze-worker: RANK must be an integer, got 'x'"),
                          ("5@3", "--freeze-worker: RANK must be in [0, 3), got 5"),
                          ("1@0", "--freeze-worker: STEP must be >= 1, got 0")):
        with pytest.raises(UsageError, match=re.escape(message)):
            parse_faults(cfg(spec), 3)
