"""Succeeds, but makes writing the launcher's per-rank status files slow (2 s between creating
a file and writing it), widening the window in which the launcher could read a half-written
status: a launcher that does so reports a failure although every rank succeeded."""
from __future__ import annotations

import builtins
import os
import time

_open = builtins.open


def slow_open(path, mode="r", *args, **kwargs):
    f = _open(path, mode, *args, **kwargs)
    if "w" in mode and os.path.basename(str(path)).startswith("rank"):
        time.sleep(2)
    return f


builtins.open = slow_open
print("script done", flush=True)
