"""The memory profiler attributes each event to the innermost phase open when it happens.

A user phase (``phase("train_step")``) around a training step holds the engine's ``backward``
and the optimizer's ``optimizer`` phases: events inside those belong to them, events between
them to ``train_step``, and once the inner phase ends its events go back to the outer one.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle import optim
from needle.memory.observers import phase

DEVICES = [ndl.cpu_numpy()] + ([ndl.cpu()] if ndl.cpu().enabled() else [])


def _phases_of_allocations(prof, device) -> list[str]:
    return [r.phase for r in prof.records if r.device == device.name and r.kind == "alloc"]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_backward_and_optimizer_inside_a_user_phase(device):
    w = ndl.Tensor(np.ones((8, 8), np.float32), device=device)
    opt = optim.SGD([w], lr=0.1, momentum=0.9)
    x = ndl.Tensor(np.ones((4, 8), np.float32), device=device, requires_grad=False)
    with mem.profile(device) as prof:
        with phase("train_step"):
            loss = (x @ w).sum()
            marks = {"forward_end": len(prof.records)}
            loss.backward()
            marks["backward_end"] = len(prof.records)
            between = ndl.Tensor(np.ones((3, 3), np.float32), device=device) + 1
            marks["between_end"] = len(prof.records)
            opt.step()
            marks["step_end"] = len(prof.records)
            after = ndl.Tensor(np.ones((5, 5), np.float32), device=device) * 2
        outside = x + 1
    recs = prof.records
    slices = {"forward": recs[:marks["forward_end"]],
              "backward": recs[marks["forward_end"]:marks["backward_end"]],
              "between": recs[marks["backward_end"]:marks["between_end"]],
              "optimizer": recs[marks["between_end"]:marks["step_end"]],
              "after": recs[marks["step_end"]:]}
    assert all(slices[k] for k in slices)  # every stretch allocated something
    assert {r.phase for r in slices["forward"]} == {"train_step"}
    # the engine's gradient steps are in "backward"; the seed gradient it makes before it
    # opens that phase (and frees after) belongs to the phase around it
    steps = [r for r in slices["backward"] if r.op and r.op.endswith(".gradient")]
    assert steps and {r.phase for r in steps} == {"backward"}
    assert {r.phase for r in slices["backward"]} == {"backward", "train_step"}
    assert {r.phase for r in slices["between"]} == {"train_step"}
    assert {r.phase for r in slices["optimizer"]} == {"optimizer"}
    tail = [r.phase for r in slices["after"] if r.kind == "alloc"]
    assert tail[:1] == ["train_step"] and tail[-1] == "forward"  # 5x5 in, x + 1 outside
    del between, after, outside


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_three_nested_user_phases_unwind_in_order(device):
    with mem.profile(device) as prof:
        with phase("outer"):
            a = ndl.Tensor(np.ones(16, np.float32), device=device)
            with phase("middle"):
                b = ndl.Tensor(np.ones(16, np.float32), device=device)
                with phase("inner"):
                    c = ndl.Tensor(np.ones(16, np.float32), device=device)
                d = ndl.Tensor(np.ones(16, np.float32), device=device)
            e = ndl.Tensor(np.ones(16, np.float32), device=device)
    assert _phases_of_allocations(prof, device) == ["outer", "middle", "inner", "middle",
                                                    "outer"]
    del a, b, c, d, e
