"""memory.explain on steps built buffer by buffer, with the bytes worked out by hand.

Pinned: the lifetimes listed as overlapping the peak add up to the liveness peak, also when
the step never rises above the bytes it started with (the peak is then the start, and a buffer
the step frees first still counts); the planned arena holds buffers alive before the step
that the step releases after its peak allocation.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import needle as ndl
import needle.memory as mem

MINE = {(64, 64), (32, 32), (32, 64), (16, 16)}
DEVICES = [ndl.cpu_numpy()] + ([ndl.cpu()] if ndl.cpu().enabled() else [])


def _alive_before(device) -> int:
    """Requested bytes other tests left alive on ``device`` (kernel workspaces, caches): they
    are there before every step here, throughout."""
    gc.collect()
    return mem.stats(device)["requested_bytes"]


def _mine(rows: list) -> list:
    """The rows of the buffers this test made (the others are ``_alive_before``'s)."""
    return sorted(r["requested"] for r in rows if r["shape"] in MINE)


def _tensor(device, rows, cols):
    """A float32 tensor of rows * cols * 4 requested bytes."""
    return ndl.Tensor(np.ones((rows, cols), np.float32), device=device, requires_grad=False)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_a_step_that_only_frees_peaks_at_its_start(device):
    # before: x 16384 B and k 4096 B; the step frees x, then makes y of 1024 B.
    # Live bytes: 20480 at the start, 4096, 5120: the peak is the start, where x and k
    # are the whole 20480 B (x is freed by the step's first event, after the peak).
    base = _alive_before(device)
    held = {"x": _tensor(device, 64, 64), "k": _tensor(device, 32, 32)}

    def step():
        del held["x"]
        held["y"] = _tensor(device, 16, 16)

    e = mem.explain(step, device=device, top=10**6)
    assert e.liveness_bytes == base + 16384 + 4096
    assert _mine(e.overlapping) == [4096, 16384]
    assert sum(r["requested"] for r in e.overlapping) == e.liveness_bytes
    assert all(r["start"] is None for r in e.overlapping)  # all were there before
    assert e.peak_phase == "before"


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_a_step_that_frees_then_makes_as_much_again(device):
    # before: x 16384 B; the step frees x and makes y of 16384 B: the live bytes come back
    # to the start's, never above. Only x is alive at the peak (y comes after it).
    base = _alive_before(device)
    held = {"x": _tensor(device, 64, 64)}

    def step():
        del held["x"]
        held["y"] = _tensor(device, 64, 64)

    e = mem.explain(step, device=device, top=10**6)
    assert e.liveness_bytes == base + 16384
    assert _mine(e.overlapping) == [16384]
    assert all(r["start"] is None for r in e.overlapping)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_the_arena_holds_what_was_there_before_until_released_after_the_peak(device):
    # before: x 16384 B (released by the step after its peak) and k 4096 B (kept). The step
    # makes z of 1024 B, then y of 8192 B, then frees x: the peak is y's allocation, with x,
    # k, z and y alive, 29696 B. The arena must hold x (from the start to its release), z and
    # y together, 25600 B, beside k: planned 29696 B. Leaving x out of the plan says 13312 B;
    # ending x's lifetime at the step's first event lets y reuse x's bytes: 21504 B.
    base = _alive_before(device)
    held = {"x": _tensor(device, 64, 64), "k": _tensor(device, 32, 32)}

    def step():
        held["z"] = _tensor(device, 16, 16)
        held["y"] = _tensor(device, 32, 64)
        del held["x"]

    e = mem.explain(step, device=device, top=10**6)
    assert e.liveness_bytes == base + 16384 + 4096 + 1024 + 8192
    assert e.before_bytes == base + 4096
    assert e.arena_bytes == 16384 + 1024 + 8192
    assert e.planned_bytes == e.liveness_bytes
    assert _mine(e.overlapping) == [1024, 4096, 8192, 16384]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_what_was_there_before_and_freed_before_the_peak_shares_the_arena(device):
    # before: x 16384 B, freed first; then the step makes y of 8192 B. The arena places x
    # (from the start until its free) and y (after) at the same offset: 16384 B planned.
    base = _alive_before(device)
    held = {"x": _tensor(device, 64, 64)}

    def step():
        del held["x"]
        held["y"] = _tensor(device, 32, 64)

    e = mem.explain(step, device=device, top=10**6)
    assert e.liveness_bytes == base + 16384
    assert e.before_bytes == base and e.arena_bytes == 16384
    assert e.planned_bytes == base + 16384


@st.composite
def _scripts(draw):
    """(sizes of the buffers alive before, the step: ("make", rows) or ("free", name))."""
    before = draw(st.lists(st.integers(1, 16), max_size=3))
    alive = [f"b{i}" for i in range(len(before))]
    script, made = [], 0
    for _ in range(draw(st.integers(1, 6))):
        if alive and draw(st.booleans()):
            name = draw(st.sampled_from(alive))
            alive.remove(name)
            script.append(("free", name))
        else:
            script.append(("make", draw(st.integers(1, 16))))
            alive.append(f"s{made}")
            made += 1
    return before, script


@settings(max_examples=30, deadline=None)
@given(case=_scripts())
def test_overlapping_lifetimes_add_up_to_the_liveness_peak(case):
    """Any step of makes and frees: the liveness peak is the running maximum of live bytes
    (counted here), the lifetimes overlapping it add up to it, and the plan holds at least
    that much."""
    device = ndl.cpu_numpy()
    before, script = case
    base = _alive_before(device)
    held = {f"b{i}": _tensor(device, rows, 8) for i, rows in enumerate(before)}
    rows = {f"b{i}": r for i, r in enumerate(before)}
    rows.update({f"s{k}": r for k, r in enumerate(a for kind, a in script if kind == "make")})
    live = peak = base + 32 * sum(before)  # a float32 (rows, 8) tensor requests 32 * rows bytes
    for kind, arg in script:
        live += 32 * arg if kind == "make" else -32 * rows[arg]
        peak = max(peak, live)

    def step():
        count = 0
        for kind, arg in script:
            if kind == "make":
                held[f"s{count}"] = _tensor(device, arg, 8)
                count += 1
            else:
                del held[arg]

    e = mem.explain(step, device=device, top=10**6)
    assert e.liveness_bytes == peak
    assert sum(r["requested"] for r in e.overlapping) == peak
    assert e.planned_bytes >= e.liveness_bytes
