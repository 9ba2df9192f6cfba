"""``measure_layer_costs(layers, x)``: the :class:`LayerCost` of every layer of a chain, measured.

The chain runs once with a graph, layer by layer, under :func:`needle.memory.profile`, the way
a stored segment runs; then autograd's release makes its last pass, as ``backward()`` does
first. From the allocator's events in the ``activation`` category (block bytes, so allocator
rounding is inside every number):

* ``output``: the block of the layer's output;
* ``kept``: the blocks allocated by the layer's forward that are still alive after that pass;
* ``working``: the highest activation bytes during the layer's forward minus what earlier
  layers keep (so the previous layer's late releases and an input nothing keeps are in it);
* ``keeps_output``: whether the output's block is among the kept ones.

These are what :func:`~needle.checkpoint.plan_checkpoints` needs for its predicted peak to bound
the measured one. The measurement is one real forward on ``x`` (gradients are not computed);
random layers (dropout) draw once, through ``needle.random`` as usual.

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle import nn
    >>> d = ndl.cpu_numpy(); np.random.seed(0)
    >>> layers = [nn.Sequential(nn.Linear(64, 64, device=d), nn.ReLU()) for _ in range(3)]
    >>> x = ndl.Tensor(np.ones((128, 64)), device=d, requires_grad=False)
    >>> c = measure_layer_costs(layers, x)
    >>> c[0].output == 128 * 64 * 4, c[0].keeps_output
    (True, True)
"""
from __future__ import annotations

import gc
import math

import numpy as np

from .. import memory
from ..autograd import enable_grad
from ..autograd.release import sweep
from .plan import LayerCost
from .sequential import _module_list

__all__ = ["measure_layer_costs"]


def _block_of(tensor):
    """(block id of the tensor's buffer, the bytes a fresh buffer of it would take)."""
    data = tensor.realize_cached_data()
    block = memory.oom.block_id(getattr(data, "_handle", None))
    nbytes = math.prod(data.shape) * np.dtype(str(data.dtype)).itemsize
    return block, memory.caching_allocator.round_size(nbytes)


def _activation_levels(recs: list, start: int) -> list[int]:
    """Activation bytes after each record (index 0: before the first)."""
    levels, level = [start], start
    for r in recs:
        if r.kind == "alloc" and r.category == "activation":
            level += r.nbytes
        elif r.kind == "free" and r.category == "activation":
            level -= r.nbytes
        elif r.kind == "retag":
            level += r.nbytes * ((r.category == "activation") - (r.prev_category == "activation"))
        levels.append(level)
    return levels


def _survivors(recs: list) -> dict:
    """Activation blocks alive after the records: block id -> (index of its alloc, bytes)."""
    live: dict = {}
    for i, r in enumerate(recs):
        if r.kind == "alloc":
            live[r.block] = (i, r.nbytes, r.category)
        elif r.kind == "free":
            live.pop(r.block, None)
        elif r.block in live:
            live[r.block] = (live[r.block][0], r.nbytes, r.category)
    return {b: (i, n) for b, (i, n, c) in live.items() if c == "activation"}


def measure_layer_costs(layers, x) -> list[LayerCost]:
    """Run ``layers`` (a ``Sequential`` or a list) on ``x`` once and measure each layer.

    Returns one :class:`LayerCost` per layer (module docstring).
    """
    layers = _module_list(layers)
    device = x.device
    gc.collect()
    marks, outs = [], []
    with memory.profile(device) as prof, enable_grad():
        h = x
        for layer in layers:
            prof._sync()
            marks.append(len(prof.records))
            h = layer(h)
            outs.append(_block_of(h))
        prof._sync()
        marks.append(len(prof.records))
        sweep(final=True)  # what backward() does first: the kept set is what survives it
    start = prof.start_stats[device.name]["by_category"]["activation"]["current"]
    recs = [r for r in prof.records if r.device == device.name]
    levels = _activation_levels(recs, start)
    alive = _survivors(recs)
    alloc_size = {(r.block, r.index): r.nbytes for r in recs if r.kind == "alloc"}
    costs, kept_before = [], 0
    for i in range(len(layers)):
        lo, hi = marks[i], marks[i + 1]
        kept = sum(n for b, (at, n) in alive.items() if lo <= at < hi)
        peak = max(levels[lo:hi + 1]) - start
        out_block, fresh = outs[i]
        # the block the layer allocated for its output; a layer that returns a buffer it did
        # not allocate (a view of its input) has a boundary the size of a fresh copy
        out_bytes = next((n for (b, at), n in alloc_size.items()
                          if b == out_block and lo <= at < hi), fresh)
        keeps = out_block in alive and lo <= alive[out_block][0] < hi
        costs.append(LayerCost(out_bytes, kept=kept, working=max(peak - kept_before, 0),
                               keeps_output=keeps))
        kept_before += kept
    del h
    return costs
