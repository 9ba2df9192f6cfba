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
    """Writes whole lines, each prefixed, in one write: output of ranks never mixes mid-line.

    A carriage return ends a line too (it is passed on), so a progress bar redraws in place.
    """

    def __init__(self, raw: io.TextIOBase, prefix: str):
        self.raw, self.prefix, self.pending = raw, prefix, ""

    def write(self, text: str) -> int:
        out, self.pending = prefix_lines(self.pending + text, self.prefix)
        if out:
            self.raw.write(out)
            self.raw.flush()
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.raw.write(f"{self.prefix}{self.pending}\n")
            self.pending = ""
        self.raw.flush()

    def isatty(self) -> bool:
        return False


def prefix_lines(text: str, prefix: str) -> tuple[str, str]:
    """Split ``text`` after each newline or carriage return, prefix every complete piece;
    return (what to write now, the incomplete rest).

    A bare carriage return (how progress bars begin each redraw) gets no prefix of its own:
    the redrawn line that follows carries it, so a log shows one prefix per bar, not two.

    Example:
        >>> prefix_lines("a\\nb\\rc", "> ")
        ('> a\\n> b\\r', 'c')
        >>> prefix_lines("\\rbar 1\\rbar 2", "> ")
        ('\\r> bar 1\\r', 'bar 2')
    """
    out, start = [], 0
    for i, ch in enumerate(text):
        if ch in "\n\r":
            piece = text[start:i + 1]
            out.append(piece if piece == "\r" else prefix + piece)
            start = i + 1
    return "".join(out), text[start:]


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
    except BaseException as exc:  # noqa: BLE001 - report any failure of the user's script
        traceback.print_exc()
        record = _exception_record(exc)
    sys.stdout.flush()
    sys.stderr.flush()
    record.update(rank=rank, time=time.time())
    write_record(os.environ.get(STATUS_DIR_ENV), f"rank{rank}.json", record)
    sys.exit(record["code"])


if __name__ == "__main__":
    main()
