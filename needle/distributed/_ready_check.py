"""The gradient-ready comparison: before a synchronized step's results are used, the ranks
compare which parameters their backward produced a gradient for.

A rank whose backward skipped a layer cannot finish the step, and the peers cannot either:
their buckets wait for gradients that never come. So that no rank is left waiting on a
collective its peer will never join, :meth:`GradSync.finish` first fills every missing
gradient with zeros (so every rank launches every bucket, in the same order), then all ranks
all-gather their ready sets (one bit per parameter, over ``count_group``, queued after the
buckets on the same group), and every rank raises the same :class:`GraphError` naming, rank
by rank, the parameters that got no gradient, and the ranks that did have them. A step with
every gradient on every rank costs that one small all-gather.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import traffic
from ._errors import GraphError
from .collectives import all_gather


def _names(sync: Any, indices: list[int]) -> str:
    shown = ", ".join(sync.describe(i) for i in indices[:8])
    return shown + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")


def ready_problem(sync: Any, missing: list[int]) -> str | None:
    """Exchange this rank's ready set (``missing``: the parameters its backward gave no
    gradient) over ``sync.count_group``; the error every rank raises, or None (collective)."""
    ready = np.ones(len(sync.params), bool)
    ready[missing] = False
    mine = np.packbits(ready)
    everyone = [np.zeros_like(mine) for _ in range(sync.count_group.size)]
    with traffic.label("gradient-ready check"):
        all_gather(everyone, mine, group=sync.count_group)
    sets = [np.unpackbits(e, count=len(sync.params)).astype(bool) for e in everyone]
    if all(s.all() for s in sets):
        return None
    none_anywhere = [i for i in range(len(sync.params)) if not any(s[i] for s in sets)]
    if all(np.array_equal(s, sets[0]) for s in sets):
        return (f"{sync.owner}: {len(none_anywhere)} parameter(s) got no gradient in this "
                f"backward on any rank, expected all {len(sync.params)}: "
                f"{_names(sync, none_anywhere)} (unused in forward? pass "
                "find_unused_parameters=True)")
    parts = []
    for r, s in enumerate(sets):
        lacking = [i for i in range(len(sync.params)) if not s[i]]
        if lacking:
            had = [q for q, other in enumerate(sets) if all(other[i] for i in lacking)]
            did = (f"; {'rank' if len(had) == 1 else 'ranks'} {', '.join(map(str, had))} did"
                   if had else "")
            parts.append(f"rank {r} produced no gradient for {_names(sync, lacking)}{did}")
    return (f"{sync.owner}: the ranks' backwards produced gradients for different parameters, "
            f"expected all {len(sync.params)} on every rank: " + "; ".join(parts) +
            " (a rank that skipped a layer? every rank must run the same forward, or pass "
            "find_unused_parameters=True)")


def check_ready(sync: Any, missing: list[int]) -> None:
    """With hooks and without ``find_unused_parameters``: compare the ready sets (collective);
    on a difference wait for the step's buckets (every rank launched them all), drop the
    step and raise the same :class:`GraphError` on every rank."""
    if sync.find_unused_parameters or not sync._handles:
        return
    problem = ready_problem(sync, missing)
    if problem is None:
        return
    for bucket in sync.buckets:
        bucket.work.wait()
    sync._reset()
    raise GraphError(problem)
