"""Rank 1 quits right after joining; the others must get CommError within the timeout."""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import needle.distributed as dist

dist.init_process_group(timeout=float(sys.argv[1]))
dist.barrier()
if dist.get_rank() == 1:
    if len(sys.argv) > 2 and sys.argv[2] == "crash":
        os._exit(0)  # no goodbye: the peers can only notice at their timeout
    sys.exit(0)
start = time.monotonic()
try:
    dist.all_reduce(np.ones(10, np.float32))
except dist.CommError as exc:
    print(f"CommError after {time.monotonic() - start:.1f} s: {exc}")
else:
    print("no error: FAIL")
    sys.exit(1)
