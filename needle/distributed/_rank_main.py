"""Runs one rank's script for the launcher: prefixes its output, records how the script ended.

``python -m needle.distributed._rank_main script.py args`` (or ``-m module args``; started by
the ``_run_rank`` supervisor). Before interpreter shutdown (so before the process group says
goodbye to its peers) it writes ``$NEEDLE_LAUNCH_STATUS_DIR/rank<k>.json``: the exit code, and
for an exception its type, message, traceback and, when a peer caused it (a ``PeerError``),
that peer.
The launcher reads it to tell the rank that failed first from those that failed because of it.
"""
from __future__ import annotations

import io
import os
import runpy
import signal
import sys
import time
import traceback
from typing import Any

from ._run_rank import STATUS_DIR_ENV, write_record


class _Prefixed(io.TextIOBase):
    """Writes whole pieces, each prefixed and ended, in one write: output of ranks that share
    mpiexec's pipe never mixes mid-line.

    A line ends with a newline. Text ended by a carriage return, or still unfinished when the
    stream is flushed (a progress bar's current frame), is written as a *frame*: prefixed and
    ended by a carriage return, so that the launcher redraws it in place on a terminal. A
    newline right after a frame repeats that frame as a line: the bar's final state.
    """

    def __init__(self, raw: io.TextIOBase, prefix: str):
        self.raw, self.prefix, self.pending = raw, prefix, ""
        self.shown = False  # ``pending`` was already written as a frame

    def write(self, text: str) -> int:
        from ._launch_output import split_pieces

        shown = self.pending.rstrip("\r") if self.shown else None
        pieces, rest = split_pieces(self.pending + text)
        out = []
        for i, (body, end) in enumerate(pieces):
            if end == "\n":
                out.append(f"{self.prefix}{body}\n")
            elif body and not (i == 0 and body == shown):  # a frame not written yet
                out.append(f"{self.prefix}{body}\r")
        self.shown = self.shown and not pieces and rest == self.pending
        self.pending = rest
        if out:
            self.raw.write("".join(out))
            self.raw.flush()
        return len(text)

    def flush(self) -> None:
        frame = self.pending.rstrip("\r")
        if frame and not self.shown:
            self.raw.write(f"{self.prefix}{frame}\r")
            self.shown = True
        self.raw.flush()

    def isatty(self) -> bool:
        return False


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _exception_record(exc: BaseException) -> dict:
    record = {"kind": "exception", "code": 1, "error": f"{type(exc).__name__}: {exc}",
              "traceback": traceback.format_exc()[-6000:]}
    peer = getattr(exc, "peer", None)
    if peer is not None and getattr(exc, "reason", None):
        record.update(peer=int(peer), reason=exc.reason)
    return record


def _tell_where(rank: int) -> None:
    """On SIGUSR1 (the launcher asks a rank that others wait for), write ``rank<k>.where``:
    the innermost frame outside needle.distributed that the script is executing."""
    from ._waits import PACKAGE_DIR

    def handler(_sig: int, frame: Any) -> None:
        while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
            frame = frame.f_back
        if frame is not None:
            site = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
            write_record(os.environ.get(STATUS_DIR_ENV), f"rank{rank}.where",
                         {"rank": rank, "site": site, "time": time.time()})

    if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:  # a script may install its own
        signal.signal(signal.SIGUSR1, handler)


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    os.environ["NEEDLE_LAUNCH_RANK"] = str(rank)
    _tell_where(rank)
    if os.environ.get("NEEDLE_LAUNCH_PREFIX") == "1":
        sys.stdout = _Prefixed(sys.stdout, f"[rank {rank}] ")
        sys.stderr = _Prefixed(sys.stderr, f"[rank {rank}] ")
    module = sys.argv[2] if sys.argv[1] == "-m" else None
    script = sys.argv[1]
    sys.argv = sys.argv[2:] if module else sys.argv[1:]
    # what ``python -m`` / ``python script.py`` put first on sys.path
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(script)))
    record: dict = {"kind": "exit", "code": 0}
    try:
        if module:  # sys.argv[0] becomes the module's file, as under python -m
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        record["code"] = _exit_code(exc)
    except KeyboardInterrupt:  # the launcher passed the user's Ctrl-C on, and says so itself
        record["code"] = 128 + signal.SIGINT
    except BaseException as exc:  # noqa: BLE001 - report any failure of the user's script
        traceback.print_exc()
        record = _exception_record(exc)
    # The script has ended: a Ctrl-C the launcher repeats now (it signals again once its grace
    # runs out, as on a loaded machine) only asks for what is happening anyway, and must not
    # cut the status record short with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    record.update(rank=rank, time=time.time())
    write_record(os.environ.get(STATUS_DIR_ENV), f"rank{rank}.json", record)
    sys.exit(record["code"])


if __name__ == "__main__":
    main()
