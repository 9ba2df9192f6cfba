"""Rank 1 ends right after joining; rank 0's next collective must fail naming rank 1.

    early_exit.py CHECK_TIMEOUT MODE      MODE: clean (sys.exit), crash (os._exit), kill (SIGKILL)

Start-up (init and the first barrier) gets a generous timeout of its own, so a loaded machine
cannot fail it; only the collective after rank 1 left uses CHECK_TIMEOUT.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import needle.distributed as dist

STARTUP_TIMEOUT = 120.0
check_timeout, mode = float(sys.argv[1]), sys.argv[2]
dist.init_process_group(timeout=STARTUP_TIMEOUT)
dist.barrier()
if dist.get_rank() == 1:
    if mode == "crash":
        os._exit(0)  # no goodbye, no exit status
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)
start = time.monotonic()
try:
    dist.all_reduce(np.ones(10, np.float32), timeout=check_timeout)
except dist.CommError as exc:
    print(f"CommError after {time.monotonic() - start:.1f} s: {exc}")
else:
    print("no error: FAIL")
    sys.exit(1)
