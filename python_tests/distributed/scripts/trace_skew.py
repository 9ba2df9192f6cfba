"""A traced exchange on ranks whose clocks disagree: ``trace_skew.py PATH``.

Rank r's trace clock runs ``r * 1000`` seconds ahead (as a rank on another machine's clock
would), so only the alignment at start puts the ranks' events in order. Rank 0 sends to each
other rank, which answers; then an all_reduce. Each hop sleeps a little first, so that a
receive always starts well before its matching send.
"""
from __future__ import annotations

import sys
import time

import numpy as np

import needle.distributed as dist
from needle.distributed import tracing

dist.init_process_group(timeout=120)
rank, world = dist.get_rank(), dist.get_world_size()
tracing._skew = 1000.0 * rank
with dist.trace(sys.argv[1]):
    x = np.arange(256, dtype=np.float32)
    for _ in range(3):
        if rank == 0:
            for peer in range(1, world):
                time.sleep(0.02)
                dist.send(x, peer, tag=5)
                dist.recv(x, peer, tag=6)
        else:
            dist.recv(x, 0, tag=5)
            time.sleep(0.02)
            dist.send_array(x, 0, tag=6)
    dist.all_reduce(x)
print(f"TRACED rank {rank}")
