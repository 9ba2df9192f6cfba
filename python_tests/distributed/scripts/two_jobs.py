"""One rank of a two-rank tcp job that all-reduces [BASE + rank + 1] (started by hand, with a
MASTER_PORT that another job may share).

    two_jobs.py [GO_FILE]

With GO_FILE the rank prints JOINING before the rendezvous and JOINED after it, then waits for
GO_FILE before the all-reduce (so that a test can start other processes in between).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import needle.distributed as dist

base = float(os.environ["JOB_BASE"])
go = sys.argv[1] if len(sys.argv) > 1 else None
print("JOINING", flush=True)
dist.init_process_group(backend="tcp", timeout=20)
print("JOINED", flush=True)
end = time.monotonic() + 120
while go and not os.path.exists(go) and time.monotonic() < end:
    time.sleep(0.05)
x = np.array([base + dist.get_rank() + 1])
dist.all_reduce(x, timeout=20)
print("RESULT", float(x[0]), flush=True)
dist.destroy_process_group()
