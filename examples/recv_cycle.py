"""Three ranks that wait for each other: each receives from its right neighbour before it
sends anything. Run it to see how needle reports a deadlock:

    python -m needle.distributed.launch --nproc 3 examples/recv_cycle.py

Every rank times out after 5 seconds, and the launcher prints the cycle with each rank's
source line instead of three ranks that "never arrived".
"""
import numpy as np

import needle.distributed as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
buf = np.zeros(4, np.float32)
dist.recv(buf, src=(rank + 1) % world, timeout=5)  # everyone waits here: no one sent
dist.send(buf, dst=(rank - 1) % world)
