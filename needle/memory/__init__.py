"""needle.memory (layer L2): measure, plan and explain memory.

* measure: every buffer of a Python backend comes from a :class:`CachingAllocator`;
  :func:`stats`, :func:`reset_peak`, :func:`empty_cache`, :func:`category`, :func:`record`,
  :func:`plot_timeline`;
* plan: :func:`trace` records a call's buffer graph, :func:`plan` places its intermediates in
  one arena (liveness, greedy by size) and ``Plan.run`` executes the call in that arena;
* explain: :func:`estimate` predicts a training step's bytes, :func:`compare` lays the
  prediction beside measured peaks; :func:`predict_step` traces a training step on shapes
  alone (activations, kernel scratch, every buffer's lifetime) before it runs;
  :func:`profile` records every allocation with its tensor, op, phase and Python line
  (``python -m needle.memory profile SCRIPT``); :func:`set_limit` makes a device refuse past
  a budget with an :class:`~needle.OutOfMemoryError` that says what filled it.

The contract with the layers around it is docs/memory.md.

Example:
    >>> import needle.memory as mem
    >>> mem.estimate(num_params=1_000_000, margin=0).model_state_bytes
    16000000
"""
from __future__ import annotations

from .caching_allocator import Block, CachingAllocator
from .categories import CATEGORIES, category, current_category, framework_category
from .explain import Explanation, explain
from .ledger import Comparison, Ledger, compare, estimate
from .offload import offload_saved_tensors
from .oom import get_limit, set_limit
from .planner import Graph, OpNode, Plan, TensorSpec, plan
from .profiler import Profile, profile
from .registry import (
    attribute,
    empty_cache,
    get_allocator,
    install_device_hook,
    install_python_allocators,
    register_allocator,
    reset_peak,
    stats,
)
from .shape_trace import StepPrediction, predict_step
from .timeline import Event, Timeline, current_op, plot_timeline, record, set_current_op
from .trace import TracedGraph, trace

__all__ = [
    "stats", "reset_peak", "empty_cache", "category", "record", "plot_timeline", "trace",
    "plan", "estimate", "compare", "profile", "set_limit", "get_limit", "explain",
    "offload_saved_tensors", "predict_step",
    # framework-facing
    "framework_category", "current_category", "attribute", "set_current_op", "current_op",
    "register_allocator", "get_allocator", "CachingAllocator", "Block", "CATEGORIES",
    "Graph", "TracedGraph", "OpNode", "TensorSpec", "Plan", "Ledger", "Comparison", "Event",
    "Timeline", "Profile", "Explanation", "StepPrediction",
]

install_python_allocators()
install_device_hook()  # cuda gets its allocator when the device is first made
