"""A pipeline stage that fails mid-step, left to the launcher to report:
``pipeline_fault.py MODE RANK``.

    raise  rank RANK raises ValueError("boom") in its second forward of step 2
    kill   rank RANK SIGKILLs itself there instead

The other ranks stop because of it (the abort or the lost connection); the launcher's headline
must name rank RANK.
"""
from __future__ import annotations

import os
import signal
import sys

import needle.autograd  # noqa: F401 - before needle.nn: works around a circular import

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from distributed import _pipeline_checks as checks  # noqa: E402

import needle.distributed as dist  # noqa: E402
from needle import nn  # noqa: E402
from needle.distributed import pipeline  # noqa: E402

mode, faulty = sys.argv[1], int(sys.argv[2])


class _Fault(checks.Boom):
    """Boom, or with ``kill`` a SIGKILL at the same call."""

    def forward(self, x):
        if mode == "kill" and self.calls + 1 == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


dist.init_process_group(timeout=60)
rank, world = dist.get_rank(), dist.get_world_size()
stages = checks.stages_for(rank, world, checks.build_mlp())
if rank == faulty:
    stages[0].module = nn.Sequential(_Fault(at=4 + 2), stages[0].module)
sched = pipeline.Schedule1F1B(stages[0], 4, loss_fn=nn.SoftmaxLoss())
X, y = checks.data()
for _ in range(3):
    sched.step(X if rank == 0 else None, y if rank == world - 1 else None)
    for p in stages[0].module.parameters():
        p.grad = None
print(f"rank {rank}: no failure", flush=True)
