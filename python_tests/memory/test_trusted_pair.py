"""The CUDA backend's per-buffer pair in C (``needle.memory._trusted_pair``) against the same
pair in Python (``cuda_allocator.python_trusted_owner``).

Both hand out an owner (``.ptr``, ``.block``) per call and release its block when the owner is
dropped. The C pair serves parked blocks itself and leaves everything else (the first block
of a size, recorders listening, a release re-entered from inside the allocator) to Python;
the tests drive both through the same random sequences and compare every observable.
"""
from __future__ import annotations

import contextlib
import random
import threading

import pytest

# _trusted_pair is built by `pip install -e .`: a missing module fails here, it is not
# skipped (without it the CUDA backend falls back to the Python pair, 3x the work per buffer)
from needle.memory import _trusted_pair, cuda_allocator, timeline
from needle.memory.caching_allocator import CachingAllocator, MiB
from needle.memory.categories import category, framework_category, thread_state


def test_the_c_pair_is_built_and_installed_for_cuda():
    """`pip install -e .` builds the module; without it the CUDA backend would fall back to
    the Python pair silently (and every buffer would cost three times as much)."""
    alloc = CachingAllocator("c")
    assert isinstance(cuda_allocator._trusted_owner(alloc), _trusted_pair.TrustedPair)
    assert type(alloc._parking) is _trusted_pair.ParkCounts
    assert {type(r) for r in (alloc._all, *alloc._by_category.values())} == \
        {_trusted_pair.CategoryRow}


class _Sink(list):
    """Events of one allocator; drops one held owner per event while ``drop`` has some (a
    release re-entered from inside the allocator's event emission)."""

    def __init__(self, device: str, drop: list):
        super().__init__()
        self.device, self.drop = device, drop

    def append(self, event) -> None:
        if event.device != self.device:
            return
        super().append((event.kind, event.nbytes, event.requested, event.category,
                        event.allocated_bytes, event.new_segment))
        if self.drop:
            self.drop.pop()  # the owner's release runs here, inside the allocator


def _layout(owner) -> tuple:
    block = owner.block
    return (block.segment.id, block.offset, block.size, block.requested, block.category,
            owner.ptr - block.segment.base)


_CATS = ("activation", "gradient", "other")


class _Twins:
    """Two allocators, one served by the Python pair and one by the C pair, driven alike."""

    def __init__(self):
        self.drops = {"py": [], "c": []}  # owners to drop from inside the allocator
        self.dropped_in_segment = {"py": 0, "c": 0}
        self.allocs = {kind: CachingAllocator(kind, self._segments(kind)) for kind in self.drops}
        self.pairs = {"py": cuda_allocator.python_trusted_owner(self.allocs["py"]),
                      "c": cuda_allocator._trusted_owner(self.allocs["c"])}
        assert isinstance(self.pairs["c"], _trusted_pair.TrustedPair)
        self.live = {kind: [] for kind in self.allocs}
        self.public = {kind: [] for kind in self.allocs}
        self.sinks = {kind: _Sink(kind, self.drops[kind]) for kind in self.allocs}

    def _segments(self, kind):
        from needle.memory.caching_allocator import _numpy_segment

        def new_segment(nbytes):  # runs inside the allocator: a release here is re-entrant
            if self.drops[kind]:
                self.drops[kind].pop()
                self.dropped_in_segment[kind] += 1
            return _numpy_segment(nbytes)
        return new_segment

    def allocate(self, rng) -> None:
        nbytes = rng.choice((0, 1, 100, 512, 513, 1000, 3000, 70_000, MiB + 1, 2 * MiB + 5))
        scope, cat = rng.choice(("user", "framework", "op", "none")), rng.choice(_CATS)
        state = thread_state()
        for kind in self.allocs:
            with contextlib.ExitStack() as scopes:
                if scope == "user":
                    scopes.enter_context(category(cat))
                elif scope == "framework":
                    scopes.enter_context(framework_category(cat))
                elif scope == "op":
                    state.op_category = cat
                self.live[kind].append(self.pairs[kind](nbytes))
            state.op_category = None

    def drop(self, rng) -> None:
        i = rng.randrange(len(self.live["py"]))
        inside = rng.random() < 0.4 and len(self.live["py"]) > 1
        for kind in self.allocs:
            if inside:  # dropped inside the allocator: at its next event or new segment
                self.drops[kind].append(self.live[kind].pop(i))
            else:
                del self.live[kind][i]  # the last reference: the owner releases here

    def other_call(self, rng, roll: float) -> None:
        if roll < 0.4:
            nbytes = rng.choice((100, 5000, MiB))
            for kind in self.allocs:
                self.public[kind].append(self.allocs[kind].allocate(nbytes))
        elif roll < 0.7 and self.public["py"]:
            i = rng.randrange(len(self.public["py"]))
            for kind in self.allocs:
                self.allocs[kind].release(self.public[kind].pop(i))
        elif roll < 0.9:
            i, new = rng.randrange(len(self.live["py"])), rng.choice(_CATS)
            for kind in self.allocs:
                self.allocs[kind].retag(self.live[kind][i].block, new)
        else:
            for kind in self.allocs:
                self.allocs[kind].reset_peak()

    def check(self, step: int) -> None:
        live, allocs = self.live, self.allocs
        if len(live["py"]) != len(live["c"]):
            pytest.fail(f"step {step}: {len(live['py'])} live owners in Python, "
                        f"{len(live['c'])} in C")
        assert [_layout(o) for o in live["c"]] == [_layout(o) for o in live["py"]], step
        assert allocs["c"].stats() | {"device": ""} == allocs["py"].stats() | {"device": ""}, \
            step
        assert self.sinks["c"] == self.sinks["py"], step


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_c_pair_behaves_as_the_python_pair(seed):
    """Random allocations (sizes that park, cut and take large segments), drops in any
    order, public calls in between (they unpark), retags, peak resets, category scopes,
    recorders listening, and releases re-entered from inside the allocator (from a recorder,
    and from the segment source without one): both allocators give the same blocks at the
    same offsets, the same statistics and the same events."""
    rng = random.Random(seed)
    twins = _Twins()
    for step in range(1200):
        roll = rng.random()
        recording = rng.random() < 0.2
        entries = [timeline.add_sink(sink) for sink in twins.sinks.values()] if recording else []
        try:
            if roll < 0.5 or not twins.live["py"]:
                twins.allocate(rng)
            elif roll < 0.85:
                twins.drop(rng)
            else:
                twins.other_call(rng, (roll - 0.85) / 0.15)
        finally:
            for entry in entries:
                timeline.remove_sink(entry)
        # an owner waits in drops until an event or a new segment comes (the same in both)
        twins.check(step)
    parking = twins.allocs["c"]._parking
    assert parking.parked_reuses > 40 and parking.parks > 40
    assert len(twins.sinks["c"]) > 100  # the recorded paths ran
    assert twins.dropped_in_segment["c"] == twins.dropped_in_segment["py"] > 3  # re-entrant
    twins.live.clear()
    for kind, alloc in twins.allocs.items():
        twins.drops[kind].clear()
        for block in twins.public[kind]:
            alloc.release(block)
        assert alloc.stats()["allocated_bytes"] == 0


def test_an_owner_holds_its_address_until_dropped():
    alloc = CachingAllocator("c")
    pair = cuda_allocator._trusted_owner(alloc)
    owner = pair(1000)
    block = owner.block
    assert owner.ptr == block.segment.base + block.offset and not block.free
    del owner
    assert block.free and alloc.stats()["allocated_bytes"] == 0
    again = pair(900)  # the same rounded size: the parked block comes back, served in C
    assert again.block is block and alloc._parking.parked_reuses == 1
    assert block.requested == 900 and block.category == "other"


def test_a_pair_waits_for_a_thread_inside_the_allocator():
    """A thread holding the allocator's lock (as a Python path does across a GIL switch)
    keeps the C pair's allocation and release out until it lets go."""
    alloc = CachingAllocator("c")
    pair = cuda_allocator._trusted_owner(alloc)
    parked = pair(1000)
    del parked
    done = []
    with alloc._lock:
        worker = threading.Thread(target=lambda: done.append(pair(1000)))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and not done  # waiting on the lock
        assert alloc._parking.parked_reuses == 0
    worker.join(60)
    assert len(done) == 1 and alloc._parking.parked_reuses == 1


def test_a_pair_reads_the_calling_threads_categories():
    alloc = CachingAllocator("c")
    pair = cuda_allocator._trusted_owner(alloc)
    pair(100)  # dropped at once: parked, so the next ones are served in C
    seen = []
    with category("gradient"):
        worker = threading.Thread(target=lambda: seen.append(pair(100).block.category))
        worker.start()
        worker.join(60)
        here = pair(100)
    assert seen == ["other"] and here.block.category == "gradient"


def test_bad_arguments_are_refused():
    alloc = CachingAllocator("c")
    pair = cuda_allocator._trusted_owner(alloc)
    with pytest.raises(TypeError, match="expected one argument"):
        pair()
    with pytest.raises(TypeError, match="expected one argument"):
        pair(1, 2)
    class Unslotted:  # the fields are class attributes, not slots the pair can address
        free = size = requested = category = segment = offset = None

    with pytest.raises(TypeError, match="__slots__ field"):
        _trusted_pair.TrustedPair(alloc, Unslotted, thread_state(), timeline, "other", 512)
    with pytest.raises(ValueError, match="power of two"):
        from needle.memory.caching_allocator import Block

        _trusted_pair.TrustedPair(alloc, Block, thread_state(), timeline, "other", 500)


def test_the_python_counters_have_the_c_counters_fields():
    """A tree used without building gets needle/memory/_pair_state.py's classes: the same
    attributes, so the allocator's code is the same either way."""
    from needle.memory import _pair_state

    for py_cls, c_cls in ((_pair_state._PyParkCounts, _trusted_pair.ParkCounts),
                          (_pair_state._PyCategoryRow, _trusted_pair.CategoryRow)):
        c_fields = {m for m in dir(c_cls) if not m.startswith("_")}
        assert set(py_cls.__slots__) == c_fields
        c, py = c_cls(), py_cls()
        assert all(getattr(c, f) == getattr(py, f) == 0 for f in c_fields)
