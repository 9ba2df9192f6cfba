"""Exact byte accounting of the caching allocator: rounding, reuse, splitting, coalescing."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from needle._core.errors import NeedleError
from needle.memory.caching_allocator import CachingAllocator, _numpy_segment, round_size
from needle.memory.categories import CATEGORIES, category, framework_category

MiB = 2**20


def _round(n):  # re-derivation of the documented rule
    return max(512, ((n + 511) // 512) * 512)


class CountingFactory:
    """Segment source that records every request (to count fresh memory exactly)."""

    def __init__(self):
        self.sizes = []

    def __call__(self, nbytes):
        self.sizes.append(nbytes)
        return _numpy_segment(nbytes)


@pytest.fixture
def alloc():
    return CachingAllocator("test", segment_factory=CountingFactory())


@pytest.mark.parametrize("n", [0, 1, 511, 512, 513, 1000, 4096, MiB - 1, MiB, MiB + 1])
def test_round_size_matches_rule(n):
    assert round_size(n) == _round(n)


def test_small_allocation_counts(alloc):
    a = alloc.allocate(1000)
    s = alloc.stats()
    assert (a.size, a.requested) == (1024, 1000)
    assert s["allocated_bytes"] == 1024 and s["requested_bytes"] == 1000
    assert s["reserved_bytes"] == 2 * MiB and alloc._factory.sizes == [2 * MiB]
    assert s["num_allocs"] == 1 and s["num_reused"] == 0 and s["num_segment_allocs"] == 1
    # The remainder of the 2 MiB segment stays cached as one free block.
    assert alloc.free_blocks() == [(a.segment.id, 1024, 2 * MiB - 1024)]


def test_reuse_of_freed_block_returns_same_bytes(alloc):
    a = alloc.allocate(3000)
    ptr = a.ptr()
    a.release()
    b = alloc.allocate(2600)  # same 3072-byte class
    s = alloc.stats()
    assert b.ptr() == ptr
    assert s["num_reused"] == 1 and s["num_allocs"] == 2 and s["num_frees"] == 1
    assert s["allocated_bytes"] == 3072 and s["requested_bytes"] == 2600
    assert len(alloc._factory.sizes) == 1


def test_small_pool_packs_one_segment(alloc):
    blocks = [alloc.allocate(n) for n in (100, 700, 5000, 512, 60000)]
    sizes = [_round(n) for n in (100, 700, 5000, 512, 60000)]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    assert [b.offset for b in blocks] == offsets
    assert [b.size for b in blocks] == sizes
    assert alloc.stats()["num_reused"] == 4 and alloc._factory.sizes == [2 * MiB]


def test_large_block_rounding_and_split(alloc):
    # 1.5 MiB: segment 2 MiB, remainder 0.5 MiB <= 1 MiB so the whole segment is handed out.
    a = alloc.allocate(3 * MiB // 2)
    assert (a.size, alloc._factory.sizes[-1]) == (2 * MiB, 2 * MiB)
    # 2.5 MiB: segment 4 MiB, remainder 1.5 MiB > 1 MiB is kept as a free block.
    b = alloc.allocate(5 * MiB // 2)
    assert b.size == 5 * MiB // 2 and alloc._factory.sizes[-1] == 4 * MiB
    assert (b.segment.id, 5 * MiB // 2, 3 * MiB // 2) in alloc.free_blocks()
    s = alloc.stats()
    assert s["allocated_bytes"] == 2 * MiB + 5 * MiB // 2
    assert s["requested_bytes"] == 3 * MiB // 2 + 5 * MiB // 2
    assert s["reserved_bytes"] == 6 * MiB


def test_large_best_fit_splits_cached_block(alloc):
    big = alloc.allocate(10 * MiB)
    big.release()
    small = alloc.allocate(3 * MiB)  # cut from the cached 10 MiB block, 7 MiB stays free
    assert small.offset == 0 and small.size == 3 * MiB
    assert alloc.free_blocks() == [(small.segment.id, 3 * MiB, 7 * MiB)]
    assert alloc.stats()["num_reused"] == 1 and len(alloc._factory.sizes) == 1


def test_coalescing_restores_whole_segment(alloc):
    blocks = [alloc.allocate(4096) for _ in range(4)]
    seg = blocks[0].segment.id
    for i in (1, 3, 0, 2):  # free out of order: neighbours merge step by step
        blocks[i].release()
    assert alloc.free_blocks() == [(seg, 0, 2 * MiB)]
    assert alloc.stats()["allocated_bytes"] == 0


def test_empty_cache_returns_only_free_segments(alloc):
    keep = alloc.allocate(100)
    drop = alloc.allocate(4 * MiB)
    drop.release()
    assert alloc.stats()["reserved_bytes"] == 6 * MiB
    assert alloc.empty_cache() == 4 * MiB
    s = alloc.stats()
    assert s["reserved_bytes"] == 2 * MiB and s["num_segments"] == 1
    assert s["num_segment_frees"] == 1
    keep.release()
    assert alloc.empty_cache() == 2 * MiB and alloc.stats()["reserved_bytes"] == 0


def test_peak_and_reset_peak(alloc):
    a = alloc.allocate(10_000)
    b = alloc.allocate(20_000)
    a.release()
    s = alloc.stats()
    assert s["peak_bytes"] == _round(10_000) + _round(20_000)
    assert s["peak_requested_bytes"] == 30_000
    alloc.reset_peak()
    s = alloc.stats()
    assert s["peak_bytes"] == _round(20_000) == s["allocated_bytes"]
    assert s["by_category"]["other"]["peak"] == _round(20_000)
    b.release()


def test_double_release_raises(alloc):
    a = alloc.allocate(10)
    a.release()
    with pytest.raises(NeedleError, match="release"):
        a.release()


def test_bad_size_and_category_raise(alloc):
    with pytest.raises(NeedleError, match="allocate"):
        alloc.allocate(-1)
    with pytest.raises(NeedleError, match="unknown memory category"):
        alloc.allocate(8, category="weights")


def test_view_is_typed_and_writable(alloc):
    a = alloc.allocate(40)
    v = a.view("float32")
    assert v.dtype == np.float32 and v.size == 10
    v[:] = np.arange(10)
    assert a.view("float32", 10).tolist() == list(range(10))
    assert a.ptr() % 256 == 0
    with pytest.raises(NeedleError, match="view"):
        a.view("float32", 129)  # 516 bytes > the 512-byte block
    a.release()
    with pytest.raises(NeedleError, match="view"):
        a.view()


def test_categories_current_and_peak(alloc):
    with category("weight"):
        w = alloc.allocate(1000)
    with framework_category("activation"):
        act = alloc.allocate(3000)
        ws = alloc.allocate(500, category="workspace")
    ws.release()
    by = alloc.stats()["by_category"]
    assert by["weight"] == {"current": 1024, "peak": 1024, "current_requested": 1000,
                            "peak_requested": 1000}
    assert by["activation"]["current"] == 3072
    assert by["workspace"] == {"current": 0, "peak": 512, "current_requested": 0,
                               "peak_requested": 500}
    alloc.retag(act, "gradient")
    by = alloc.stats()["by_category"]
    assert by["activation"]["current"] == 0 and by["activation"]["peak"] == 3072
    assert by["gradient"]["current"] == 3072
    w.release()
    act.release()


def test_user_category_wins_over_hint_and_retag(alloc):
    with category("optimizer"):
        a = alloc.allocate(100, category="workspace")
        alloc.retag(a, "weight")
    assert a.category == "optimizer"
    a.release()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3 * MiB),
                          st.sampled_from(CATEGORIES)), min_size=1, max_size=60))
def test_random_sequences_account_exactly(ops):
    """Replay allocs/frees against a dictionary model of what is live."""
    alloc = CachingAllocator("h", segment_factory=CountingFactory())
    live, peak, cat_peak = {}, 0, {c: 0 for c in CATEGORIES}
    for is_free, n, cat in ops:
        if is_free and live:
            key = sorted(live)[n % len(live)]
            live.pop(key).release()
        else:
            with category(cat):
                b = alloc.allocate(n)
            live[b.id] = b
        cur = {c: sum(b.size for b in live.values() if b.category == c) for c in CATEGORIES}
        peak = max(peak, sum(cur.values()))
        cat_peak = {c: max(cat_peak[c], cur[c]) for c in CATEGORIES}
        s = alloc.stats()
        assert s["allocated_bytes"] == sum(b.size for b in live.values())
        assert s["requested_bytes"] == sum(b.requested for b in live.values())
        assert s["peak_bytes"] == peak
        assert {c: s["by_category"][c]["peak"] for c in CATEGORIES} == cat_peak
        assert s["reserved_bytes"] == sum(alloc._factory.sizes)
        # Live blocks never overlap in a segment.
        spans = sorted((b.segment.id, b.offset, b.offset + b.size) for b in live.values())
        for (s1, _, e1), (s2, b2, _) in zip(spans, spans[1:], strict=False):
            assert s1 != s2 or e1 <= b2
    for b in live.values():
        b.release()
    s = alloc.stats()
    assert s["allocated_bytes"] == 0 and s["num_frees"] == s["num_allocs"]
    # Everything coalesced back: one free block per segment.
    assert len(alloc.free_blocks()) == s["num_segments"]


def test_steady_loop_stops_asking_for_memory(alloc):
    sizes = [4096, 128 * 1024, 3 * MiB, 700, 5 * MiB]
    for step in range(50):
        blocks = [alloc.allocate(n) for n in sizes]
        for b in reversed(blocks):
            b.release()
        if step == 0:
            after_first = alloc.stats()
    s = alloc.stats()
    assert s["num_segment_allocs"] == after_first["num_segment_allocs"]
    assert s["num_reused"] == 50 * len(sizes) - s["num_segment_allocs"]
    assert s["allocated_bytes"] == 0 and s["reserved_bytes"] == after_first["reserved_bytes"]


class _Holder:
    """Stands in for an L1 Array whose destructor releases its block (possibly via the GC)."""

    def __init__(self, alloc, n):
        self._block = alloc.allocate(n)
        self.cycle = self

    def __del__(self):
        self._block.release()


def test_release_from_gc_cycles_is_exact(alloc):
    # A low threshold makes the cyclic GC run inside allocate() itself, so destructors release
    # blocks re-entrantly while the allocator is mid-update.
    threshold = gc.get_threshold()
    gc.set_threshold(10)
    try:
        for _ in range(2000):
            _Holder(alloc, 1000)
        gc.collect()
    finally:
        gc.set_threshold(*threshold)
    s = alloc.stats()
    assert s["allocated_bytes"] == 0 and s["num_frees"] == s["num_allocs"] == 2000
    assert alloc.free_blocks() == [(seg, 0, 2 * MiB) for seg in sorted(alloc._segments)]
