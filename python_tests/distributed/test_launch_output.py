"""The launcher's terminal output: progress frames redrawn in place on a terminal, one final
frame per bar in a file or a pipe, whole lines that never mix, no bare prefix lines."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tty
from pathlib import Path

import pytest

from needle.distributed._launch_output import RankOutput, split_pieces
from needle.distributed._rank_main import _Prefixed

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]
BAR = "".join(f"\rbar step {i}/3" for i in range(1, 4)) + "\n"


def _through(tty_mode: bool, *feeds: tuple[str, str]) -> str:
    """What the launcher writes for ``feeds`` ((prefix, text) per stream, fed in order)."""
    out = io.StringIO()
    output = RankOutput(out, tty=tty_mode)
    streams = {}
    for prefix, text in feeds:
        streams.setdefault(prefix, output.stream(prefix)).feed(text)
    for stream in streams.values():
        stream.close()
    return out.getvalue()


def test_split_pieces_waits_for_the_half_of_a_crlf() -> None:
    assert split_pieces("a\r") == ([], "a\r")
    assert split_pieces("a\r\nb\r\rc\n") == ([("a", "\n"), ("b", "\r"), ("", "\r"),
                                              ("c", "\n")], "")


def test_a_file_keeps_one_final_frame_per_bar() -> None:
    text = _through(False, ("[rank 0] ", BAR), ("[rank 0] ", "epoch 1\n"),
                    ("[rank 0] ", BAR.replace("bar", "next")))
    assert text == "[rank 0] bar step 3/3\n[rank 0] epoch 1\n[rank 0] next step 3/3\n"


def test_a_file_keeps_the_last_frame_of_a_bar_that_never_ended() -> None:
    assert _through(False, ("[rank 0] ", "\rstep 1/3\rstep 2/3")) == "[rank 0] step 2/3\n"


def test_a_terminal_redraws_each_bar_on_one_line() -> None:
    text = _through(True, ("[rank 0] ", BAR), ("[rank 0] ", BAR.replace("bar", "next")))
    assert text.count("\n") == 2  # one line per bar
    frames = [f for f in text.replace("\x1b[K", "").split("\r") if f]
    assert frames[0] == "[rank 0] bar step 1/3" and "[rank 0] bar step 3/3\n" in frames
    assert "\n[rank 0] \n" not in "\n" + text and "[rank 0] [rank 0]" not in text


def test_a_line_of_another_rank_goes_above_the_drawn_bar() -> None:
    text = _through(True, ("[rank 0] ", "\rstep 1/3"), ("[rank 1] ", "hello\n"),
                    ("[rank 0] ", "\rstep 2/3\n"))
    lines = [ln.split("\r")[-1].replace("\x1b[K", "") for ln in text.split("\n")]
    assert lines == ["[rank 1] hello", "[rank 0] step 2/3", ""]


def test_mpi_ranks_prefix_their_frames_and_end_every_piece() -> None:
    """Ranks share mpiexec's pipe: each write is a whole piece, ended by a newline or a
    carriage return, and a bar's end repeats its last frame as a line (no bare prefix)."""
    raw = io.StringIO()
    out = _Prefixed(raw, "[rank 0] ")  # type: ignore[arg-type]
    for step in range(1, 3):
        out.write(f"\rstep {step}/2")
        out.flush()
    out.write("\n")
    out.write("done")
    out.flush()
    out.write("!\n")
    assert raw.getvalue() == ("[rank 0] step 1/2\r[rank 0] step 2/2\r[rank 0] step 2/2\n"
                              "[rank 0] done\r[rank 0] done!\n")
    assert _through(False, ("", raw.getvalue())) == "[rank 0] step 2/2\n[rank 0] done!\n"


def _launch(backend: str, stdout) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "needle.distributed.launch", "-n", "2", "--backend", backend,
           "--timeout", "120", str(SCRIPTS / "frames_demo.py")]
    return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, cwd=ROOT)


def _read_all(fd: int) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            return data
        if not chunk:
            return data
        data += chunk


WANTED = ["[rank 0] bar 0 step 3/3", "[rank 0] bar 1 step 3/3", "[rank 0] done",
          "[rank 1] hello from rank 1"]


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_under_a_terminal_each_bar_is_one_redrawn_line() -> None:
    master, slave = os.openpty()
    tty.setraw(slave)  # no newline translation: count what the launcher wrote
    proc = _launch("mpi", slave)
    os.close(slave)
    try:
        text = _read_all(master).decode()
        proc.wait(timeout=150)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text[-2000:] + proc.stderr.read().decode()[-2000:]
    lines = text.split("\n")
    assert lines[-1] == ""
    finals = sorted(ln.split("\r")[-1].replace("\x1b[K", "") for ln in lines[:-1])
    assert finals == WANTED  # four lines: one per bar, and no bare "[rank 0]" line
    bars = [ln for ln in lines if "bar 0" in ln or "bar 1" in ln]
    assert all(ln.count("\r") >= 2 for ln in bars), bars  # frames redrawn in place


def test_after_an_interrupt_only_rank_lines_pass_the_mpiexec_stream() -> None:
    out = io.StringIO()
    output = RankOutput(out, tty=False)
    mpiexec = output.stream("")
    mpiexec.feed("[rank 0] step 3\n[mpiexec@host] Sending Ctrl-C to processes as requested\n")
    output.drop_untagged = True
    mpiexec.feed("[mpiexec@host] Press Ctrl-C again to force abort\n[rank 1] bye\n=====\n")
    mpiexec.close()
    assert out.getvalue() == ("[rank 0] step 3\n[mpiexec@host] Sending Ctrl-C to processes as "
                              "requested\n[rank 1] bye\n")
