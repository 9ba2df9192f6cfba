"""Rank 1 fails with exit code 3 ("fail") or every rank sleeps ("hang")."""
from __future__ import annotations

import sys
import time

import needle.distributed as dist

dist.init_process_group(timeout=30)
print(f"started rank {dist.get_rank()}")
if sys.argv[1] == "fail" and dist.get_rank() == 1:
    sys.exit(3)
time.sleep(60)
