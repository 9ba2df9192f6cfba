"""Ranks that call different collectives, for the call-check tests: ``mismatch.py MODE``.

    shape  rank 0 all-reduces 4 floats, the others 8 (on another line)
    op     rank 0 broadcasts, the others all-reduce

The group's timeout is long (120 s): the call check must fail at once, not time out.
"""
from __future__ import annotations

import sys

import numpy as np

import needle.distributed as dist

mode = sys.argv[1]
dist.init_process_group(timeout=120)
rank = dist.get_rank()
dist.barrier()
if rank == 0 and mode == "shape":
    dist.all_reduce(np.ones(4, np.float32))
elif rank == 0:
    dist.broadcast(np.ones(8, np.float32))
else:
    dist.all_reduce(np.ones(8, np.float32))
print("no mismatch found", flush=True)
