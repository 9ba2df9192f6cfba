"""Prints the torchrun-style variables a rank sees (before and after joining), its receive
address (tcp), an all_reduce of [rank + 1] and its arguments (run as a script or a module)."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

import needle.distributed as dist

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
before = {k: os.environ.get(k) for k in NAMES}
pg = dist.init_process_group(timeout=120)
after = {k: os.environ.get(k) for k in NAMES}
x = np.array([dist.get_rank() + 1.0])
dist.all_reduce(x)
print("REPORT", json.dumps({"before": before, "after": after, "rank": dist.get_rank(),
                            "size": dist.get_world_size(), "sum": float(x[0]),
                            "address": getattr(pg.transport, "address", None),
                            "argv": sys.argv[1:], "name": __name__}), flush=True)
dist.destroy_process_group()
