"""An mpi rank that fails after MPI mapped its shared memory: prints SHM <files it mapped>,
then rank 1 raises (``raise``) or kills itself (``kill``) while rank 0 waits in a barrier."""
from __future__ import annotations

import os
import signal
import sys

import needle.distributed as dist

dist.init_process_group(timeout=60)
dist.barrier()
maps = {line.split()[-1] for line in open("/proc/self/maps")
        if line.split()[-1].startswith("/dev/shm/mpich_shm_")}
print("SHM", " ".join(sorted(maps)), flush=True)
dist.barrier()
if dist.get_rank() == 1:
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("boom on rank 1")
dist.barrier()
