"""How a job fails, for the launcher tests:

    fail   rank 1 exits with code 3, the others sleep (the launcher must stop them)
    raise  rank 1 raises ValueError while rank 0 waits for it in an all_reduce
    absent the last rank never calls the all_reduce the others wait in (timeout 5 s)
    hang   every rank sleeps (the job timeout or a signal must stop them)
    stubborn  like hang, but rank 1 ignores SIGINT and SIGTERM (only SIGKILL stops it)
"""
from __future__ import annotations

import signal
import sys
import time

import numpy as np

import needle.distributed as dist

mode = sys.argv[1]
dist.init_process_group(timeout=120)
rank, world = dist.get_rank(), dist.get_world_size()
if mode == "stubborn" and rank == 1:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"started rank {rank}", flush=True)
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode == "raise":
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)  # rank 0 is inside the all_reduce by now
        raise ValueError("boom on rank 1")
    dist.all_reduce(np.ones(4, np.float32))
if mode == "absent":
    if rank == world - 1:
        time.sleep(120)
    dist.all_reduce(np.ones(4, np.float32), timeout=5)
time.sleep(120)
