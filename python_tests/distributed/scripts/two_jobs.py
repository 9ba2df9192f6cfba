"""One rank of a two-rank tcp job that all-reduces [BASE + rank + 1] (started by hand, with a
MASTER_PORT that another job may share)."""
from __future__ import annotations

import os

import numpy as np

import needle.distributed as dist

base = float(os.environ["JOB_BASE"])
dist.init_process_group(backend="tcp", timeout=20)
x = np.array([base + dist.get_rank() + 1])
dist.all_reduce(x, timeout=20)
print("RESULT", float(x[0]), flush=True)
dist.destroy_process_group()
