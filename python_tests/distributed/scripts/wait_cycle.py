"""Ranks that wait for each other, for the wait-for graph tests: ``wait_cycle.py MODE``.

    cycle   rank r receives from rank r + 1 (mod n): every rank arrived, none can go on
    absent  the same chain, but the last rank sleeps instead of receiving: it never arrives
    collective  rank r receives from r + 1 (mod n), except rank 0, which calls all_reduce

Receives time out after 5 s (start-up keeps the default, so a loaded machine cannot fail it).
"""
from __future__ import annotations

import sys
import time

import numpy as np

import needle.distributed as dist

mode = sys.argv[1]
dist.init_process_group(timeout=120)
rank, world = dist.get_rank(), dist.get_world_size()
dist.barrier()
buf = np.zeros(4, np.float32)
if mode == "absent" and rank == world - 1:
    time.sleep(120)  # the line the launcher must name
if mode == "collective" and rank == 0:
    dist.all_reduce(buf, timeout=5)
dist.recv(buf, src=(rank + 1) % world, timeout=5)
