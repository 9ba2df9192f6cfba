"""Gradient clipping by the whole model's norm when its gradients are spread over ranks.

``needle.optim.clip_grad_norm`` sees only this process's gradients. Under ZeRO each rank
holds a piece of every gradient, under tensor parallelism a shard of the sharded weights
(and a copy of the rest), under pipeline parallelism the parameters of its own stages: a
local norm differs from rank to rank, and so would the clipping. :func:`clip_grad_norm` gives
every rank the norm one process holding the whole model would compute:

* every rank sums the squares of the gradients it holds, in float64, in ``params`` order;
  a gradient that is replicated over ``replicated_group`` (a tensor-parallel layer's
  replicated bias, a LayerNorm left whole) is counted only by that group's rank 0;
* the per-rank sums are all-gathered over each group of ``group`` in turn and added in rank
  order, so every rank ends with the same float64 and scales by the same factor.

Which groups (docs/zero.md, docs/tensor_parallel.md):

==========================  =================================================================
ZeRO, stages 1-3            the shard gradients, ``group`` = the data-parallel group
                            (``ZeroDataParallel.clip_grad_norm`` does it)
DDP                         ``group=None``: every rank holds the whole averaged gradient
tensor parallel             ``group`` = the tp group, ``replicated`` =
                            ``tensor_parallel.replicated_parameters(module)``
pipeline                    ``group`` = the pp group (every stage holds other parameters)
3D mesh (dp x tp x pp)      ``group=[tp, pp]``, ``replicated_group`` = tp; the dp replicas
                            hold the same averaged gradients, so dp is left out
==========================  =================================================================
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from ._errors import CommError
from ._group import resolve
from .collectives import all_gather


def _groups(group: Any, what: str) -> list:
    if group is None:
        return []
    items = list(group) if isinstance(group, (list, tuple)) else [group]
    return [resolve(g, what) for g in items]


def sum_over(groups: Sequence[Any]) -> Callable[[float], float]:
    """``reduce(local) -> total`` for ``optim.clip_grad_norm``: ``local`` summed over the
    ranks of each group in turn (all-gathered, then added in rank order, so every rank gets
    the same float; collective over every group).

    Example (two thread ranks):
        >>> import needle.distributed as dist
        >>> dist.spawn_threads(lambda rank: sum_over([dist.new_group()])(rank + 0.5), 2)
        [2.0, 2.0]
    """
    pgs = [resolve(g, "clip_grad_norm") for g in groups]

    def reduce(local: float) -> float:
        from . import traffic

        total = float(local)
        for pg in pgs:
            if pg.size == 1:
                continue
            every = [np.zeros(1, np.float64) for _ in range(pg.size)]
            with traffic.label("grad norm"):
                all_gather(every, np.array([total], np.float64), group=pg)
            total = 0.0
            for value in every:  # rank order: the same additions on every rank
                total += float(value[0])
        return total

    return reduce


def clip_grad_norm(params: Sequence[Any], max_norm: float, group: Any = None, *,
                   replicated: Sequence[Any] = (), replicated_group: Any = None) -> float:
    """Clip ``params``' gradients by the norm of the whole model's gradients, of which this
    rank holds ``params``' (collective over ``group``); returns that norm before clipping.

    Every gradient is scaled by ``max_norm / (norm + 1e-6)`` when the norm exceeds
    ``max_norm``, as ``needle.optim.clip_grad_norm`` does in one process (see the module doc
    for which groups each kind of parallelism passes).

    Args:
        params: this rank's parameters (those without a gradient are skipped).
        max_norm: the largest norm kept, a positive number.
        group: a process group, or a list of groups along different mesh axes (the squared
            sums are added over every rank of their product), or None: no other rank holds
            a part of the model (unlike the collectives, None is not the world; pass
            ``dist.new_group()`` for that).
        replicated: parameters whose gradient is the same on every rank of
            ``replicated_group``: counted once, by that group's rank 0.
        replicated_group: the group (or groups) over which ``replicated`` is replicated;
            default ``group`` when that is one group (required when it is a list).

    Raises:
        CommError: ``max_norm`` not positive, or ``replicated`` without its group.

    Example (two thread ranks, each holding half of a gradient [3, 4] and a replicated 0):
        >>> import numpy as np, needle.distributed as dist
        >>> from needle.autograd import Tensor
        >>> def job(rank):
        ...     w, b = Tensor([0.0]), Tensor([0.0])
        ...     w.grad, b.grad = Tensor([3.0 + rank]), Tensor([0.0])
        ...     norm = dist.clip_grad_norm([w, b], 1.0, group=dist.new_group(), replicated=[b])
        ...     return round(norm, 4), round(float(w.grad.numpy()[0]), 4)
        >>> dist.spawn_threads(job, 2)
        [(5.0, 0.6), (5.0, 0.8)]
    """
    from needle import optim

    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float, np.floating)) \
            or not (math.isfinite(float(max_norm)) and max_norm > 0):
        raise CommError(f"clip_grad_norm: max_norm must be a positive finite number, got "
                        f"{max_norm!r}")
    groups = _groups(group, "clip_grad_norm")
    counted = None
    if len(replicated):
        if replicated_group is None:
            if len(groups) > 1:
                raise CommError("clip_grad_norm: replicated parameters need replicated_group "
                                "when group is a list, expected the group(s) they are "
                                f"replicated over, got None with {len(groups)} groups")
            replicated_group = groups
        owner = all(pg.rank == 0 for pg in _groups(replicated_group, "clip_grad_norm"))
        copies = {id(p) for p in replicated}
        counted = None if owner else (lambda p: id(p) not in copies)
    return optim.clip_grad_norm(params, max_norm, reduce=sum_over(groups) if groups else None,
                                counted=counted)
