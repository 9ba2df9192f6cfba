"""Run by test_multiprocess.py on N ranks: p2p, every collective vs NumPy and the reference."""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _checks  # noqa: E402

import needle.distributed as dist  # noqa: E402

dist.init_process_group(timeout=30)
rank, world = dist.get_rank(), dist.get_world_size()
_checks.check_p2p(rank, world)
_checks.check_mismatch(rank, world)
for dtype in _checks.DTYPES:
    _checks.check_all_reduce(rank, world, dtype)
    _checks.check_others(rank, world, dtype)
x = np.array([[1, 2, 3], [1, 0, 1]][rank % 2], dtype=np.float32)
pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]  # every rank calls each
dist.all_reduce(x, group=pairs[min(rank // 2, len(pairs) - 1)])
assert x.tolist() == [2.0, 2.0, 4.0], x
big = np.arange(3_000_001, dtype=np.float32) % 7 + rank  # several 1 MiB chunks, uneven split
dist.all_reduce(big)
np.testing.assert_array_equal(big, world * (np.arange(3_000_001) % 7) + sum(range(world)))
print(f"ALL OK rank {rank} of {world} on {dist.get_backend()}")
dist.destroy_process_group()
