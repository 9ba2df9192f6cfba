"""Run by test_nccl_launch.py: the NCCL checks of ``_nccl_checks`` on this rank, with cuda()
on the CUDA emulator and the fake NCCL exchanging bytes between the processes."""
from __future__ import annotations

import contextlib
import os
import sys

import needle.autograd  # noqa: F401 - before needle.nn: works around a circular import

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import _fake_nccl  # noqa: E402
import _nccl_checks  # noqa: E402

import needle.backend_ndarray as nd  # noqa: E402
import needle.distributed as dist  # noqa: E402
from needle.backend_ndarray import ndarray_backend_cuda as backend  # noqa: E402

fake = _fake_nccl.install_in_this_process()
backend.to_numpy = _nccl_checks.counted(backend.to_numpy)

dist.init_process_group(timeout=60)
rank, world = dist.get_rank(), dist.get_world_size()
_nccl_checks.run_checks(nd.BackendDevice("cuda", backend), rank, world,
                        contextlib.nullcontext())
calls = {c["kind"] for c in fake.calls}
assert {"allReduce", "reduce", "broadcast"} <= calls, calls
print(f"NCCL OK rank {rank} of {world} on {dist.get_backend()} (emulated)", flush=True)
dist.destroy_process_group()
