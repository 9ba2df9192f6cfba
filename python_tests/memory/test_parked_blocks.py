"""The trusted allocate/release pair parks freed blocks: exact statistics, same memory.

A parked block is handed out again to the next trusted request of its rounded size without a
search; anything else that reads or changes the free lists sees it coalesced first, and a
request that finds no room coalesces the parked blocks before it takes a new segment.
"""
from __future__ import annotations

import pytest

from needle.memory._errors import MemoryArgumentError
from needle.memory.caching_allocator import CachingAllocator, MiB


def test_a_parked_block_is_handed_out_again_with_exact_statistics():
    alloc = CachingAllocator("parked")
    a = alloc._allocate_trusted(1000)
    b = alloc._allocate_trusted(3000)
    alloc._release_trusted(a)
    assert a.free and alloc.stats()["allocated_bytes"] == 3072
    again = alloc._allocate_trusted(900)  # rounds to 1,024 bytes like a: a itself comes back
    assert again is a and alloc._parking.parked_reuses == 1
    st = alloc.stats()
    assert (st["allocated_bytes"], st["requested_bytes"]) == (1024 + 3072, 900 + 3000)
    assert (st["peak_bytes"], st["peak_requested_bytes"]) == (1024 + 3072, 1000 + 3000)
    assert (st["num_allocs"], st["num_frees"], st["num_reused"]) == (3, 1, 2)
    assert st["by_category"]["other"] == {"current": 4096, "peak": 4096,
                                          "current_requested": 3900,
                                          "peak_requested": 4000}
    alloc._release_trusted(again)
    alloc._release_trusted(b)
    assert alloc.stats()["allocated_bytes"] == alloc.stats()["requested_bytes"] == 0


def test_parked_blocks_coalesce_before_the_layout_is_read():
    alloc = CachingAllocator("parked")
    blocks = [alloc._allocate_trusted(n) for n in (1000, 3000, 5000)]
    for block in blocks:
        alloc._release_trusted(block)
    assert alloc.free_blocks() == [(blocks[0].segment.id, 0, 2 * MiB)]
    assert alloc.largest_free_block() == 2 * MiB
    assert alloc.empty_cache() == 2 * MiB and alloc.stats()["num_segments"] == 0


def test_a_request_without_room_coalesces_the_parked_blocks_before_a_new_segment():
    alloc = CachingAllocator("parked")
    quarters = [alloc._allocate_trusted(MiB // 2) for _ in range(4)]  # one whole segment
    for block in quarters:
        alloc._release_trusted(block)
    whole = alloc._allocate_trusted(MiB)  # no 1 MiB block parked: the four quarters merge
    st = alloc.stats()
    assert st["num_segment_allocs"] == 1 and st["reserved_bytes"] == 2 * MiB
    assert whole.offset == 0 and whole.size == MiB


def test_the_public_calls_see_parked_neighbours_coalesced():
    alloc = CachingAllocator("parked")
    a = alloc._allocate_trusted(1000)
    b = alloc.allocate(1000)  # public: parked blocks are unparked first
    alloc._release_trusted(a)
    alloc.release(b)  # coalesces with a, parked just before
    assert alloc.free_blocks() == [(a.segment.id, 0, 2 * MiB)]
    assert alloc.stats()["allocated_bytes"] == 0 and alloc.stats()["num_frees"] == 2


def test_a_parked_block_cannot_be_released_again():
    alloc = CachingAllocator("parked")
    a = alloc._allocate_trusted(10)
    alloc._release_trusted(a)
    with pytest.raises(MemoryArgumentError, match="expected a live block"):
        alloc._release_trusted(a)
    with pytest.raises(MemoryArgumentError, match="expected a live block"):
        alloc.release(a)
    assert alloc.stats()["num_frees"] == 1


def test_a_recorded_parked_reuse_emits_the_events_of_an_allocation():
    from needle.memory import timeline

    alloc = CachingAllocator("parked")
    a = alloc._allocate_trusted(1000)
    events: list = []  # a sink: anything with append
    entry = timeline.add_sink(events)
    try:
        alloc._release_trusted(a)
        again = alloc._allocate_trusted(1000)  # parked, handed out again while recorded
    finally:
        timeline.remove_sink(entry)
    assert again is a and alloc._parking.parked_reuses == 1
    assert [(e.kind, e.nbytes, e.requested, e.allocated_bytes, e.new_segment)
            for e in events] == [("free", 1024, 1000, 0, False),
                                 ("alloc", 1024, 1000, 1024, False)]


@pytest.mark.parametrize("seed", [0, 1])
def test_statistics_equal_counting_each_event(seed):
    """Through trusted and public calls, retags and peak resets in any order, the counters
    and every peak (total, requested, per category) equal a model that counts each event;
    each block's category follows resolve's order (user scope, framework scope, op default)."""
    import contextlib
    import random

    from needle.memory.categories import category, framework_category, thread_state

    rng = random.Random(seed)
    alloc = CachingAllocator("counted")
    state = thread_state()
    cats = ("activation", "gradient", "other")
    model = {"cur": 0, "peak": 0, "req": 0, "peak_req": 0}
    rows = {c: {"current": 0, "peak": 0, "current_requested": 0, "peak_requested": 0}
            for c in cats}

    def count(cat, size, nbytes):
        model["cur"] += size
        model["req"] += nbytes
        model["peak"] = max(model["peak"], model["cur"])
        model["peak_req"] = max(model["peak_req"], model["req"])
        row = rows[cat]
        row["current"] += size
        row["current_requested"] += nbytes
        row["peak"] = max(row["peak"], row["current"])
        row["peak_requested"] = max(row["peak_requested"], row["current_requested"])

    live = []
    for step in range(1500):
        roll = rng.random()
        if roll < 0.5 or not live:
            nbytes = rng.choice((0, 100, 512, 1000, 3000, 70_000, 2 * MiB + 5))
            cat = rng.choice(cats)
            trusted = rng.random() < 0.8
            # resolve's order: a user scope > a framework scope > the op default
            user = rng.random() < 0.6
            framework = rng.random() < 0.5
            state.op_category = "activation" if rng.random() < 0.5 else None
            scopes = contextlib.ExitStack()
            if framework:
                scopes.enter_context(framework_category("gradient" if user else cat))
            if user:
                scopes.enter_context(category(cat))
            with scopes:
                block = (alloc._allocate_trusted if trusted else alloc.allocate)(nbytes)
            if not user and not framework:
                cat = state.op_category or "other"
            state.op_category = None
            assert block.category == cat, (user, framework, trusted)
            live.append((block, trusted))
            count(cat, block.size, nbytes)
        elif roll < 0.95:
            block, trusted = live.pop(rng.randrange(len(live)))
            count(block.category, -block.size, -block.requested)
            (alloc._release_trusted if trusted else alloc.release)(block)
        elif roll < 0.98:
            block, _ = rng.choice(live)
            new = rng.choice(cats)
            if new != block.category:
                count(block.category, -block.size, -block.requested)
                count(new, block.size, block.requested)
            alloc.retag(block, new)
        else:
            alloc.reset_peak()
            model["peak"], model["peak_req"] = model["cur"], model["req"]
            for row in rows.values():
                row["peak"], row["peak_requested"] = row["current"], row["current_requested"]
        if step % 97 == 0 or step == 1499:
            st = alloc.stats()
            assert (st["allocated_bytes"], st["peak_bytes"], st["requested_bytes"],
                    st["peak_requested_bytes"]) == (model["cur"], model["peak"], model["req"],
                                                    model["peak_req"]), step
            assert {c: st["by_category"][c] for c in cats} == rows, step


def test_a_trusted_allocation_on_a_fresh_thread_reads_that_threads_categories():
    """The category comes from the allocating thread's own state (a new thread starts outside
    every scope), not from the thread that opened a scope."""
    import threading

    from needle.memory.categories import category

    alloc = CachingAllocator("threads")
    seen = []
    with category("gradient"):
        worker = threading.Thread(target=lambda: seen.append(alloc._allocate_trusted(100)))
        worker.start()
        worker.join(60)
        here = alloc._allocate_trusted(100)
    assert [b.category for b in seen] == ["other"] and here.category == "gradient"
