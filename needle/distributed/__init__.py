"""needle.distributed: processes that communicate (layer L6).

transport (mpi / tcp / thread) -> ProcessGroup -> point-to-point -> collectives -> DDP.

Example:
    >>> import numpy as np, needle.distributed as dist
    >>> def job(rank):
    ...     x = np.arange(3, dtype=np.float32) + rank
    ...     dist.all_reduce(x, op="mean")
    ...     return x.tolist()
    >>> dist.spawn_threads(job, 2)
    [[0.5, 1.5, 2.5], [0.5, 1.5, 2.5]]
"""
from __future__ import annotations

from . import tracing, traffic
from ._errors import CommError, MessageError, ObjectTypeError, PeerError, SenderAborted
from ._group import ProcessGroup
from ._nccl import NcclUnavailable
from ._work import Work
from .clip import clip_grad_norm
from .collectives import (
    all_gather,
    all_gather_v,
    all_reduce,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_v,
    scatter,
    shard_bounds,
)
from .object_collectives import all_gather_object, gather_object
from .p2p import (
    irecv,
    irecv_array,
    irecv_object,
    isend,
    isend_array,
    isend_object,
    recv,
    recv_array,
    recv_object,
    send,
    send_array,
    send_object,
)
from .process_group import (
    destroy_process_group,
    get_backend,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
    spawn_threads,
)
from .tracing import trace

__all__ = [
    "trace", "tracing",
    "CommError", "MessageError", "NcclUnavailable", "ObjectTypeError", "PeerError",
    "ProcessGroup", "SenderAborted",
    "Work",
    "all_gather", "all_gather_object", "all_gather_v",
    "all_reduce", "barrier", "gather_object", "irecv_array", "irecv_object", "isend_array",
    "isend_object", "recv_array", "recv_object", "send_array", "send_object",
    "broadcast", "clip_grad_norm", "destroy_process_group", "gather", "get_backend", "get_rank",
    "get_world_size", "init_process_group",
    "irecv", "is_initialized", "isend", "new_group", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_v", "scatter", "send", "shard_bounds", "spawn_threads", "traffic",
]


def __getattr__(name: str):
    # DDP needs the autograd; import it only when asked for.
    if name == "DistributedDataParallel":
        from .ddp import DistributedDataParallel

        return DistributedDataParallel
    if name in ("GradSync", "BucketHook", "AllReduceHook"):
        from . import grad_sync

        return getattr(grad_sync, name)
    if name == "check_equivalence":
        from .equivalence import check_equivalence

        return check_equivalence
    if name in ("ParameterServer", "ps"):
        import importlib

        ps = importlib.import_module(".ps", __name__)
        return ps if name == "ps" else ps.ParameterServer
    if name in ("ZeroDataParallel", "zero"):
        import importlib

        zero = importlib.import_module(".zero", __name__)
        return zero if name == "zero" else zero.ZeroDataParallel
    # model parallelism (docs/pipeline.md, docs/tensor_parallel.md), also loaded on demand
    if name in ("pipeline", "tensor_parallel", "mesh"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in ("init_device_mesh", "DeviceMesh"):
        from . import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module 'needle.distributed' has no attribute {name!r}")
