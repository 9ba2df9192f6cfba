"""ndl.compile keeps buffers that share arena bytes out of one fused run, in every geometry.

The predicate under test is the one the kernel program builds from the real plan (captured
where it is handed to the fusion pass), checked against an interval test written here for
every pair of planned buffers: one starts inside the other (either way round), one holds the
other, they touch end to start, they are apart. The fused runs the program then replays never
hold two buffers that share bytes.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import needle as ndl
from needle.compiler import compiled as compiled_mod
from needle.compiler import program as program_mod
from needle.compiler.fusion import FusedCall, slots_of

sys.path.append(os.path.dirname(__file__))
from test_compile_models import make, step_for  # noqa: E402 - the shared model zoo

DEVICES = ["cpu_numpy"] + (["cpu"] if ndl.cpu().enabled() else [])


def _share_bytes(a: tuple, b: tuple) -> bool:
    """[offset, offset + size) of a and b intersect."""
    return max(a[0], b[0]) < min(a[0] + a[1], b[0] + b[1])


def _geometry(a: tuple, b: tuple) -> str:
    a_end, b_end = a[0] + a[1], b[0] + b[1]
    if a_end <= b[0] or b_end <= a[0]:
        return "touching" if a_end == b[0] or b_end == a[0] else "apart"
    if b[0] <= a[0] and a_end <= b_end:
        return "a within b"
    if a[0] <= b[0] and b_end <= a_end:
        return "b within a"
    return "a starts inside b" if b[0] < a[0] else "b starts inside a"


@pytest.fixture
def captured(monkeypatch):
    """What the compiler hands to fusion: the plan's arena and the overlap predicate."""
    seen: dict = {}
    fuse, fusion = program_mod.fuse, compiled_mod._fusion

    def spy_fusion(program, plan):
        kernel, arena = fusion(program, plan)
        seen["arena"] = arena
        return kernel, arena

    def spy_fuse(ops, sizes, keep, kernel, overlaps=None, pooled=None):
        seen["overlaps"] = overlaps
        seen["ops"] = fuse(ops, sizes, keep, kernel, overlaps, pooled)
        return seen["ops"]

    monkeypatch.setattr(compiled_mod, "_fusion", spy_fusion)
    monkeypatch.setattr(program_mod, "fuse", spy_fuse)
    return seen


@pytest.mark.parametrize("arena", ["bounded", "all"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_programs_overlap_predicate_on_every_pair_of_the_plan(captured, device, arena):
    np.random.seed(0)
    model, opt, data = make("mlp", getattr(ndl, device)())
    step = ndl.compile(step_for(model, opt), arena=arena)
    for _ in range(6):
        step(*data[0])
    assert step.replay_mode()["fused_runs"] > 0, step.replay_mode()
    planned, overlaps = captured["arena"], captured["overlaps"]
    slots = [s for s in planned if planned[s][1] > 0]
    seen = set()
    for a in slots:
        for b in slots:
            if a != b:
                seen.add(_geometry(planned[a], planned[b]))
                assert overlaps(a, b) == _share_bytes(planned[a], planned[b]), \
                    (a, planned[a], b, planned[b], _geometry(planned[a], planned[b]))
    assert seen == {"apart", "touching", "a within b", "b within a", "a starts inside b",
                    "b starts inside a"}  # the plan meets every geometry
    for op in captured["ops"]:
        if isinstance(op, FusedCall):
            inside = sorted({s for member in op.members for s in slots_of(member)
                             if s in planned and planned[s][1] > 0})
            assert not [(a, b) for a in inside for b in inside
                        if a < b and _share_bytes(planned[a], planned[b])], op
