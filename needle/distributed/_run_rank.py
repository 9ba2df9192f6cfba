"""Runs one rank's script for the launcher: prefixes its output, records how it exited.

``python -m needle.distributed._run_rank script.py args`` (started by ``launch``). The exit
status goes to ``$NEEDLE_LAUNCH_STATUS_DIR/rank<k>`` before interpreter shutdown, so the launcher
learns about a failed rank at once, even while mpiexec keeps the other ranks alive.
"""
from __future__ import annotations

import io
import os
import runpy
import sys
import traceback


class _Prefixed(io.TextIOBase):
    """Writes whole lines, each prefixed, in one write: output of ranks never mixes mid-line."""

    def __init__(self, raw: io.TextIOBase, prefix: str):
        self.raw, self.prefix, self.pending = raw, prefix, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, self.pending = self.pending.rsplit("\n", 1)
            self.raw.write("".join(f"{self.prefix}{line}\n" for line in lines.split("\n")))
            self.raw.flush()
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.raw.write(f"{self.prefix}{self.pending}\n")
            self.pending = ""
        self.raw.flush()

    def isatty(self) -> bool:
        return False


def _rank() -> int:
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def main() -> None:
    rank = _rank()
    os.environ["NEEDLE_LAUNCH_RANK"] = str(rank)
    if os.environ.get("NEEDLE_LAUNCH_PREFIX") == "1":
        sys.stdout = _Prefixed(sys.stdout, f"[rank {rank}] ")
        sys.stderr = _Prefixed(sys.stderr, f"[rank {rank}] ")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - report any failure of the user's script
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    status_dir = os.environ.get("NEEDLE_LAUNCH_STATUS_DIR")
    if status_dir:
        with open(os.path.join(status_dir, f"rank{rank}"), "w") as f:
            f.write(str(code))
    sys.exit(code)


if __name__ == "__main__":
    main()
