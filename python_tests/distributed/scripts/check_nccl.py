"""Run by test_nccl_device.py on a GPU machine: every NCCL check of ``_nccl_checks`` on this
rank of an nccl group (launch -n N --backend nccl; one rank per GPU)."""
from __future__ import annotations

import contextlib
import os
import sys

import needle.autograd  # noqa: F401 - before needle.nn: works around a circular import

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _nccl_checks  # noqa: E402

import needle.distributed as dist  # noqa: E402
from needle.backend_ndarray import cuda  # noqa: E402
from needle.backend_ndarray import ndarray_backend_cuda as backend  # noqa: E402

backend.to_numpy = _nccl_checks.counted(backend.to_numpy)
dist.init_process_group(timeout=120)
rank, world = dist.get_rank(), dist.get_world_size()
_nccl_checks.run_checks(cuda(), rank, world, contextlib.nullcontext())
print(f"NCCL OK rank {rank} of {world} on {dist.get_backend()}", flush=True)
dist.destroy_process_group()
