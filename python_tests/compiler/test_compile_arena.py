"""ndl.compile's arena: a replay never needs more memory than the eager step it replays.

Bytes are counts (the allocator's requested bytes), so the tests assert them: on each course
model the peak measured during every replay (recorded and kernel replays) is at most the peak
measured during an eager step of an identical model, and planted mistakes in the arena's
account make that check fail.
"""
from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle.compiler import arena as arena_mod
from needle.compiler.fusion import FusedCall, fuse
from needle.compiler.recorder import Alloc, Call, Ref
from needle.memory import plan, trace

sys.path.append(os.path.dirname(__file__))
from test_compile_models import make, step_for  # noqa: E402 - the shared model zoo

CALLS = 7  # two eager warm-ups, trace, two recordings, two kernel replays


def peaks(kind, dev, optimizer, arena="bounded"):
    """The compiled step and the measured peak (requested bytes above those before the
    call) of each of its calls; the second call is an eager one, as the compiler runs it
    (optimisers take their composed path there, as in the traced call)."""
    np.random.seed(11)
    model, opt, data = make(kind, dev)
    if optimizer == "sgd":
        opt = ndl.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    elif optimizer == "adam":
        opt = ndl.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    step = ndl.compile(step_for(model, opt), arena=arena, warmup=2)
    x, y = data[0]
    np.random.seed(3)
    out = []
    for _ in range(CALLS):
        gc.collect()  # a previous step's graph freed by a collection inside this one
        before = mem.stats(dev)["requested_bytes"]
        mem.reset_peak(dev)
        step(x, y)
        out.append(mem.stats(dev)["peak_requested_bytes"] - before)
    return out, step


def check_within_eager(kind, dev, optimizer, arena="bounded"):
    """Every replay's measured peak against the measured eager call; returns the step."""
    got, step = peaks(kind, dev, optimizer, arena=arena)
    m, eager = step.memory(), got[1]
    assert m["eager_peak_bytes"] == eager  # the trace saw the eager call's peak
    assert max(got[3:]) <= eager, got  # every replay within the eager peak
    assert m["planned_peak_bytes"] <= m["eager_peak_bytes"], m
    assert got[3] == got[4] == m["planned_peak_bytes"]  # recorded replays: as planned
    return step


@pytest.mark.parametrize("kind,optimizer", [("mlp", "adam"), ("mlp", "sgd"),
                                            ("resnet9", "sgd"), ("resnet9", "adam"),
                                            ("lstm", "sgd"), ("transformer", "adam")])
def test_replays_need_no_more_than_the_eager_step(kind, optimizer):
    step = check_within_eager(kind, ndl.cpu(), optimizer)
    assert step.replay_mode()["mode"] == "kernels"
    assert step.memory()["arena_buffers"] > 0  # the arena still holds something


def test_within_eager_on_the_numpy_device_with_a_checkpoint_region():
    check_within_eager("mlp_checkpoint", ndl.cpu_numpy(), "adam")


def test_every_intermediate_in_the_arena_can_pass_the_eager_peak():
    """arena="all" (what the compiler did before): held from before the step drops the
    previous gradients to after it made the new weights, the arena passes the eager peak."""
    with pytest.raises(AssertionError):
        check_within_eager("mlp", ndl.cpu(), "adam", arena="all")


def test_planted_account_that_frees_the_previous_step_first_fails(monkeypatch):
    """The mistake behind arena="all": the buffers of the previous step (its gradients,
    replaced weights and moments) counted as freed before the arena is taken."""
    real = arena_mod._base

    def planted(events, end):
        return real([(1 if delta < 0 else step, delta) for step, delta in events], end)

    monkeypatch.setattr(arena_mod, "_base", planted)
    with pytest.raises(AssertionError):
        check_within_eager("mlp", ndl.cpu(), "adam")


def test_the_account_of_a_trace_reproduces_its_eager_peak_and_the_plans_peak():
    dev = ndl.cpu()
    np.random.seed(11)
    model, opt, data = make("transformer", dev)
    step = step_for(model, opt)
    step(*data[0])  # optimiser state made: the traced step is a steady one
    graph = trace(step, *data[0])
    events = arena_mod.outside_events(graph)
    assert events is not None and len(events) == len(graph.outside_deltas)
    full = plan(graph)
    # every intermediate in the arena: needle.memory's own planned peak
    assert arena_mod.replay_peak(graph, full) == graph.planned_peak_bytes(full)
    choice = arena_mod.plan_arena(graph)
    assert choice.planned_peak_bytes <= graph.eager_peak_bytes < graph.planned_peak_bytes(full)
    assert arena_mod.replay_peak(graph, choice.plan) == choice.planned_peak_bytes
    assert 0 < choice.arena_buffers < choice.intermediates


def test_an_unknown_arena_policy_is_refused():
    with pytest.raises(ndl.CompileError, match="bad arena"):
        ndl.compile(lambda x: x, arena="smallest")


def test_fusion_makes_no_pool_buffer_before_the_run_frees_another():
    """x*2 -> a, a+x -> b (a's last use), b*3 -> c: fused, c would be made before a is freed;
    with a, b, c from the pools the run stops before c, with them in the arena it does not."""
    ops = [Alloc(1, 8, "float32"), Call("scalar_mul", None, (Ref(0), 2.0, Ref(1))),
           Alloc(2, 8, "float32"), Call("ewise_add", None, (Ref(1), Ref(0), Ref(2))),
           Alloc(3, 8, "float32"), Call("scalar_mul", None, (Ref(2), 3.0, Ref(3)))]
    sizes = {s: (8, "float32") for s in range(4)}
    whole = fuse(ops, sizes, keep={3}, kernel=None, pooled=set())
    assert [type(op).__name__ for op in whole].count("FusedCall") == 1
    assert len(next(op for op in whole if isinstance(op, FusedCall)).members) == 3
    split = fuse(ops, sizes, keep={3}, kernel=None, pooled={0, 1, 2, 3})
    fused = [op for op in split if isinstance(op, FusedCall)]
    assert len(fused) == 1 and len(fused[0].members) == 2
    assert split[-1] == ops[-1] and split[-2] == ops[-2]  # c made after the run, as traced


@pytest.mark.parametrize("dev", [ndl.cpu_numpy(), ndl.cpu()], ids=str)
def test_without_an_account_of_the_trace_the_arena_stays_empty(dev, monkeypatch):
    monkeypatch.setattr(arena_mod, "outside_events", lambda graph: None)
    step = check_within_eager("mlp", dev, "sgd")
    m = step.memory()
    assert m["strategy"] == "pools (no account)"
    assert m["arena_bytes"] == m["arena_buffers"] == 0
    assert m["planned_peak_bytes"] == m["eager_peak_bytes"]
    assert step.replay_mode()["mode"] == "kernels"
