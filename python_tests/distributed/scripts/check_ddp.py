"""Run by test_multiprocess.py: DDP gradients equal NumPy gradients of the union of batches."""
from __future__ import annotations

import os
import sys

import needle.autograd  # noqa: E402,F401 - before needle.nn: works around a circular import

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _ddp_checks  # noqa: E402

import needle.distributed as dist  # noqa: E402

dist.init_process_group(timeout=30)
rank, world = dist.get_rank(), dist.get_world_size()
_ddp_checks.run_all(rank, world)
print(f"DDP OK rank {rank} of {world} on {dist.get_backend()}")
