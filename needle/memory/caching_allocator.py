"""A caching allocator over raw byte segments, with exact statistics per category.

Blocks are cut from segments (1-D ``uint8`` arrays: NumPy here, CuPy through
``segment_factory`` later). Freed blocks stay cached in free lists keyed by size and are
handed out again, so a training loop that repeats the same shapes stops asking the system for
memory after its first step (fresh pages cost ~10x the arithmetic on our machines).

Size classes (the rounding rule, see docs/memory.md):

* block size = request rounded up to a multiple of 512 B (a 0 B request takes 512 B);
* small pool (block <= 1 MiB): blocks are cut from 2 MiB segments;
* large pool (block > 1 MiB): a fresh segment is the block rounded up to 2 MiB; a cut leaves the
  remainder as its own free block only if it is larger than 1 MiB, otherwise the whole block is
  handed out (and counted in ``allocated_bytes``);
* reuse is best fit within the pool (LIFO among equal sizes); freed neighbours coalesce;
  :meth:`CachingAllocator.empty_cache` returns segments that are entirely free.

The trusted pair ``_allocate_trusted``/``_release_trusted`` (the CUDA backend's buffers) parks
a freed block uncoalesced under its rounded request size for the next request of that size: a
step that repeats its shapes neither searches, cuts nor coalesces. Parked blocks coalesce
before any other call reads or changes the free lists and before a new segment is taken; the
statistics count them freed at once, and their reuse as a reuse.

Example:
    >>> alloc = CachingAllocator("demo")
    >>> a = alloc.allocate(1000); a.size, a.requested
    (1024, 1000)
    >>> a.release(); b = alloc.allocate(600)
    >>> alloc.stats()["num_reused"], alloc.stats()["reserved_bytes"] == 2 * 2**20
    (1, True)
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable

import numpy as np

from . import timeline as _timeline
from ._errors import MemoryArgumentError
from ._pair_state import CategoryRow, ParkCounts, RLock, add_bytes, row_dict, take_bytes
from .categories import _DEFAULT as _DEFAULT_CATEGORY
from .categories import CATEGORIES, check_category, resolve, thread_state

_CATEGORY_STATE = thread_state()

__all__ = ["CachingAllocator", "Block", "round_size", "fresh_block_size", "KiB", "MiB",
           "BLOCK_ROUND", "SMALL_LIMIT", "SMALL_SEGMENT", "LARGE_ROUND", "MIN_LARGE_SPLIT",
           "ALIGNMENT"]

KiB = 1024
MiB = 1024 * KiB
ALIGNMENT = 256          # every block starts on a 256-byte boundary (kernels rely on it)
BLOCK_ROUND = 512        # block sizes are multiples of this
SMALL_LIMIT = 1 * MiB    # blocks up to this size live in the small pool
SMALL_SEGMENT = 2 * MiB  # small-pool segment size
LARGE_ROUND = 2 * MiB    # large-pool segments are multiples of this
MIN_LARGE_SPLIT = 1 * MiB  # a large block is split only if the remainder exceeds this

_SMALL, _LARGE = 0, 1
# round_size(n) // BLOCK_ROUND is (n + _ROUND_UP) >> _ROUND_SHIFT or 1 (the parked lists' key)
_ROUND_SHIFT = BLOCK_ROUND.bit_length() - 1
_ROUND_UP = BLOCK_ROUND - 1
assert 1 << _ROUND_SHIFT == BLOCK_ROUND


def round_size(nbytes: int) -> int:
    """Block size for a request of ``nbytes`` (multiple of 512, at least 512).

    Example:
        >>> round_size(0), round_size(512), round_size(513)
        (512, 512, 1024)
    """
    return max(BLOCK_ROUND, -(-nbytes // BLOCK_ROUND) * BLOCK_ROUND)


def fresh_block_size(nbytes: int) -> int:
    """Block size for a request of ``nbytes`` served from a fresh segment: :func:`round_size`,
    except that a large block takes its whole segment when the rest would be 1 MiB or less.
    A large block served from the cache may be up to 1 MiB larger or smaller than this.

    Example:
        >>> fresh_block_size(1000), fresh_block_size(4_000_000), fresh_block_size(3_136_000)
        (1024, 4194304, 3136000)
    """
    size = round_size(nbytes)
    if size <= SMALL_LIMIT:
        return size
    segment = -(-size // LARGE_ROUND) * LARGE_ROUND
    return segment if segment - size <= MIN_LARGE_SPLIT else size


def _numpy_segment(nbytes: int) -> np.ndarray:
    # Over-allocate so the segment can start on an ALIGNMENT boundary.
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    shift = (-raw.ctypes.data) % ALIGNMENT
    return raw[shift:shift + nbytes]


class _Segment:
    __slots__ = ("id", "size", "data", "pool", "base")

    def __init__(self, seg_id: int, size: int, data, pool: int):
        self.id, self.size, self.data, self.pool = seg_id, size, data, pool
        # NumPy segments know their address through ctypes; device segments (CuPy memory
        # pointers) carry it as ``ptr``; simulated ones (shape-only traces) have none. Read
        # once: Block.ptr runs for every buffer.
        if hasattr(data, "ptr"):
            self.base = int(data.ptr)
        else:
            self.base = None if data is None else data.ctypes.data


class Block:
    """A contiguous piece of a segment; handed out by :meth:`CachingAllocator.allocate`.

    ``size`` is the rounded block size, ``requested`` the bytes asked for.
    """

    __slots__ = ("allocator", "segment", "offset", "size", "requested", "category", "prev",
                 "next", "free", "id")

    def __init__(self, allocator, segment: _Segment, offset: int, size: int, block_id: int):
        self.allocator = allocator
        self.segment = segment
        self.offset = offset
        self.size = size
        self.requested = 0
        self.category = "other"
        self.prev: Block | None = None
        self.next: Block | None = None
        self.free = True
        self.id = block_id

    def view(self, dtype="uint8", count: int | None = None):
        """Typed 1-D view of the block's first ``count`` elements (default: requested bytes)."""
        dtype = np.dtype(dtype)
        if count is None:
            count = self.requested // dtype.itemsize
        if self.free or count * dtype.itemsize > self.size:
            raise MemoryArgumentError(
                f"view: expected a live block of at least {count * dtype.itemsize} bytes, "
                f"got {self!r}")
        start = self.offset
        return self.segment.data[start:start + count * dtype.itemsize].view(dtype)

    def ptr(self) -> int:
        """Address of the block's first byte."""
        return self.segment.base + self.offset

    def release(self) -> None:
        """Give the block back to its allocator (exactly once)."""
        self.allocator.release(self)

    def __repr__(self) -> str:
        state = "free" if self.free else self.category
        return f"Block(id={self.id}, offset={self.offset}, size={self.size}, {state})"


class CachingAllocator:
    """Caching allocator for one device (see the module docstring for the size classes).

    Args:
        name: device name used in statistics and timeline events.
        segment_factory: ``fn(nbytes) -> 1-D uint8 array`` returning fresh memory
            (default: 256-byte aligned NumPy arrays).
    """

    def __init__(self, name: str = "cpu_numpy",
                 segment_factory: Callable[[int], object] | None = None):
        self.name = name
        self._factory = segment_factory or _numpy_segment
        self._lock = RLock()  # the C pair's FastRLock when built: see _pair_state
        self._acquire, self._unlock = self._lock.acquire, self._lock.release  # the fast pair's
        self._depth = 0            # >0 while this thread is inside allocate/release/retag
        self._pending: list[Block] = []  # releases that arrived re-entrantly (GC inside a call)
        self._ids = itertools.count(1)
        self._segments: dict[int, _Segment] = {}
        self._head: dict[int, Block] = {}   # first block of each segment, by segment id
        # Per pool: block size -> {block: None} (an insertion-ordered set, popped LIFO).
        self._free: tuple[dict[int, dict[Block, None]], ...] = ({}, {})
        self._free_sizes: tuple[list[int], list[int]] = ([], [])
        # Parked blocks (see the module docstring): rounded request size in units of
        # BLOCK_ROUND -> blocks, LIFO. They are free (block.free) but in no free list until
        # _unpark coalesces them. No count of them is kept (the fast paths would pay an
        # update each): a key stays when its list empties, until _unpark clears them all.
        self._parked: dict[int, list[Block]] = {}
        self._limit: int | None = None  # refuse segments past this many reserved bytes
        self._reset_counters()

    def _reset_counters(self) -> None:
        # bytes and peaks of live blocks (all of them, and per category) and the parked
        # pair's events: in objects the C pair (needle/memory/_trusted_pair) updates too.
        # Parked reuses and parks are counted apart (one add on the fast path); stats() adds
        # them to num_allocs and num_reused, and to num_frees
        self._all = CategoryRow()
        self._by_category = {c: CategoryRow() for c in CATEGORIES}
        self._parking = ParkCounts()
        self._reserved = self._peak_reserved = 0
        self._num_allocs = self._num_frees = self._num_reused = 0
        self._num_segment_allocs = self._num_segment_frees = 0

    # ---- public API -------------------------------------------------------------------
    def allocate(self, nbytes: int, dtype=None, category: str | None = None) -> Block:
        """Return a live block of at least ``nbytes`` bytes.

        Args:
            nbytes: bytes wanted (>= 0).
            dtype: accepted for the protocol; blocks are untyped (use :meth:`Block.view`).
            category: a hint (e.g. ``"workspace"``); a user ``category()`` block wins over it.

        Raises:
            MemoryArgumentError: negative size or unknown category.
        """
        if nbytes.__class__ is not int:
            if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool):
                raise MemoryArgumentError(
                    f"allocate: bad size, expected a non-negative int, got {nbytes!r}")
            nbytes = int(nbytes)
        if nbytes < 0:
            raise MemoryArgumentError(
                f"allocate: bad size, expected a non-negative int, got {nbytes!r}")
        if category is not None:
            check_category(category, "allocate")
        cat = resolve(category)
        with self._lock:
            self._depth += 1
            try:
                if self._parked:
                    self._unpark()
                return self._allocate(nbytes, cat)
            finally:
                self._leave()

    def _allocate_trusted(self, nbytes: int) -> Block:
        """:meth:`allocate` without a hint, for callers inside needle that pass an int >= 0
        (the CUDA backend's buffers: one call per NDArray, so the checks are the caller's).
        A parked block of the same rounded size is handed out first (the last one parked)."""
        key = (nbytes + _ROUND_UP) >> _ROUND_SHIFT or 1  # the parked key of _release_trusted
        # categories.resolve(None), written out: one read of the thread-local state (its
        # fields from this thread's dict cost a third of three attribute reads)
        fields = _CATEGORY_STATE.__dict__
        cat = (fields["user_top"] or fields["framework_top"] or fields["op_category"]
               or _DEFAULT_CATEGORY)
        # acquire/release as bound methods: one call each (without the C module this pair
        # runs for every cuda() buffer, and a `with` on threading.RLock parses acquire's
        # arguments)
        self._acquire()
        try:
            stack = self._parked.get(key)
            if not stack or self._depth:
                self._depth += 1
                try:
                    return self._allocate(nbytes, cat)
                finally:
                    self._leave()
            # Up to the event, nothing allocates a tracked object or calls out: no destructor
            # can run in the middle (release() defers those only while _depth is set).
            block = stack.pop()
            self._parking.parked_reuses += 1
            block.free = False
            block.requested = nbytes
            block.category = cat
            # a large block may be bigger than its rounded request
            self._charge(cat, block.size, nbytes)
            if _timeline._RECORDERS:
                self._depth += 1  # the recorder may allocate (and so run destructors)
                try:
                    self._emit("alloc", block, False)
                finally:
                    self._leave()
            return block
        finally:
            self._unlock()

    def _release_trusted(self, block: Block) -> None:
        """:meth:`release` for the owner of a block from :meth:`_allocate_trusted` (it
        releases once): the block is parked, not coalesced (see the module docstring)."""
        if block.free:
            raise MemoryArgumentError(
                f"release: expected a live block of allocator {self.name!r}, got {block!r}")
        self._acquire()  # not `with`: see _allocate_trusted
        try:
            if self._depth:  # re-entered from a destructor: as release() does
                self._pending.append(block)
                return
            block.free = True
            size = block.size
            nbytes = block.requested
            self._parking.parks += 1  # counted in num_frees (_release's statistics)
            take_bytes(self._all, size, nbytes)
            take_bytes(self._by_category[block.category], size, nbytes)
            if _timeline._RECORDERS:
                self._depth += 1  # the recorder may allocate (and so run destructors)
                try:
                    self._emit("free", block, False)
                finally:
                    self._depth -= 1  # what it deferred is drained below
            block.requested = 0
            key = (nbytes + _ROUND_UP) >> _ROUND_SHIFT or 1  # round_size(nbytes) // BLOCK_ROUND
            stack = self._parked.get(key)
            if stack is None:
                # setdefault: a destructor run while the new list is made may park one first
                stack = self._parked.setdefault(key, [])
            stack.append(block)
            if self._pending:
                self._drain_pending()
        finally:
            self._unlock()

    def release(self, block: Block) -> None:
        """Return ``block`` to the cache.

        Raises:
            MemoryArgumentError: the block is already free or belongs to another allocator.
        """
        if block.allocator is not self or block.free:
            raise MemoryArgumentError(
                f"release: expected a live block of allocator {self.name!r}, got {block!r}")
        with self._lock:
            if self._depth:
                # Re-entered from a destructor run by the GC in the middle of another call on
                # this thread: the free lists may be mid-update, so defer.
                if any(b is block for b in self._pending):
                    raise MemoryArgumentError(
                        f"release: expected a live block, got {block!r} (already released)")
                self._pending.append(block)
                return
            self._depth += 1
            try:
                if self._parked:
                    self._unpark()
                self._release(block)
            finally:
                self._depth -= 1
                if self._pending and not self._depth:
                    self._drain_pending()

    def retag(self, block, category: str) -> None:
        """Move a live block's bytes to ``category`` (a user ``category()`` block wins).

        ``block`` may be a :class:`Block` or an object holding one as ``_block`` (an L1
        ``Array``); objects without a block are ignored (memory this allocator does not own).
        """
        check_category(category, "retag")
        block = block if isinstance(block, Block) else getattr(block, "_block", None)
        if block is None or block.allocator is not self or block.free:
            return
        new = resolve(category)
        with self._lock:
            old = block.category
            if old == new:
                return
            take_bytes(self._by_category[old], block.size, block.requested)
            block.category = new
            add_bytes(self._by_category[new], block.size, block.requested)
            if _timeline._RECORDERS:
                self._emit("retag", block, False, prev_category=old)

    def empty_cache(self) -> int:
        """Return every wholly free segment to the system; returns the bytes released."""
        with self._lock:
            self._unpark()
            released = 0
            for seg_id, seg in list(self._segments.items()):
                block = self._head[seg_id]
                if not block.free or block.next is not None:
                    continue
                self._unlink_free(block)
                del self._segments[seg_id]
                del self._head[seg_id]
                block.segment = None
                self._reserved -= seg.size
                self._num_segment_frees += 1
                released += seg.size
            return released

    def reset_peak(self) -> None:
        """Set every peak (total, requested, reserved, per category) to its current value."""
        with self._lock:
            self._peak_reserved = self._reserved
            for row in (self._all, *self._by_category.values()):
                row.peak = row.current
                row.peak_requested = row.current_requested

    def stats(self) -> dict:
        """A snapshot of the statistics (see docs/memory.md for every field)."""
        with self._lock:
            every, parking = self._all, self._parking
            return {
                "device": self.name,
                "allocated_bytes": every.current,
                "requested_bytes": every.current_requested,
                "peak_bytes": every.peak,
                "peak_requested_bytes": every.peak_requested,
                "reserved_bytes": self._reserved,
                "peak_reserved_bytes": self._peak_reserved,
                "cached_bytes": self._reserved - every.current,
                "num_allocs": self._num_allocs + parking.parked_reuses,
                "num_frees": self._num_frees + parking.parks,
                "num_reused": self._num_reused + parking.parked_reuses,
                "num_segments": len(self._segments),
                "num_segment_allocs": self._num_segment_allocs,
                "num_segment_frees": self._num_segment_frees,
                "by_category": {c: row_dict(r) for c, r in self._by_category.items()},
            }

    def set_limit(self, nbytes: int | None) -> int | None:
        """Refuse a new segment that would take the reserved bytes past ``nbytes`` (None: no
        limit); returns the previous limit. A refused request raises
        :class:`~needle._core.errors.OutOfMemoryError` (see :mod:`needle.memory.oom`)."""
        with self._lock:
            prev, self._limit = self._limit, nbytes
            return prev

    @property
    def limit(self) -> int | None:
        return self._limit

    def largest_free_block(self) -> int:
        """Bytes of the largest cached free block (0 when the cache is empty)."""
        with self._lock:
            self._unpark()
            return max((sizes[-1] for sizes in self._free_sizes if sizes), default=0)

    def live_blocks(self) -> list[tuple[int, int, int, str]]:
        """Blocks in use as ``(block id, size, requested, category)``, in segment order."""
        with self._lock:
            out = []
            for seg_id in self._segments:
                block = self._head[seg_id]
                while block is not None:
                    if not block.free:
                        out.append((block.id, block.size, block.requested, block.category))
                    block = block.next
            return out

    def free_blocks(self) -> list[tuple[int, int, int]]:
        """Cached free blocks as sorted ``(segment id, offset, size)`` (for tests and debugging)."""
        with self._lock:
            self._unpark()
            return sorted((b.segment.id, b.offset, b.size)
                          for pool in self._free for bucket in pool.values() for b in bucket)

    # ---- private: the work, with the lock held --------------------------------------------
    # The hot paths (_allocate, _release) are written out flat: they run once per NDArray and
    # small models are dispatch-bound (an MLPResNet step is 150+ primitive ops), so every
    # attribute lookup counts.
    def _leave(self) -> None:
        self._depth -= 1
        if self._pending and not self._depth:
            self._drain_pending()

    def _drain_pending(self) -> None:
        self._depth += 1
        try:
            if self._parked:
                self._unpark()
            while self._pending:
                self._release(self._pending.pop())
        finally:
            self._depth -= 1

    def _unpark(self) -> None:
        """Put every parked block into the free lists, coalesced with its free neighbours
        (its statistics were counted when it was parked)."""
        if not self._parked:
            return
        blocks = [b for stack in self._parked.values() for b in stack]
        self._parked.clear()
        for block in blocks:  # not free meanwhile: a neighbour merges only with listed blocks
            block.free = False
        for block in blocks:
            block.free = True
            self._coalesce(block)

    def _allocate(self, nbytes: int, cat: str) -> Block:
        size = BLOCK_ROUND if nbytes <= BLOCK_ROUND else -(-nbytes // BLOCK_ROUND) * BLOCK_ROUND
        small = size <= SMALL_LIMIT
        pool = _SMALL if small else _LARGE
        buckets = self._free[pool]
        bucket = buckets.get(size)
        if bucket is None:
            sizes = self._free_sizes[pool]
            i = bisect.bisect_left(sizes, size)
            if i < len(sizes):
                bucket = buckets[sizes[i]]
        if bucket is None:
            if self._parked:  # coalesced parked blocks may hold the room: look again
                self._unpark()
                return self._allocate(nbytes, cat)
            block = self._new_segment(pool, size, nbytes, cat)
            new_segment = True
        else:
            block = bucket.popitem()[0]  # LIFO: the most recently freed block is warmest
            if not bucket:
                del buckets[block.size]
                self._free_sizes[pool].remove(block.size)
            self._num_reused += 1
            new_segment = False
        rest = block.size - size
        if rest and (small or rest > MIN_LARGE_SPLIT):
            # cut: the rest becomes a cached free block (every small-pool allocation cuts one)
            tail = Block(self, block.segment, block.offset + size, rest, next(self._ids))
            after = tail.next = block.next
            if after is not None:
                after.prev = tail
            tail.prev, block.next, block.size = block, tail, size
            bucket = buckets.get(rest)
            if bucket is None:
                bucket = buckets[rest] = {}
                bisect.insort(self._free_sizes[pool], rest)
            bucket[tail] = None
        block.free = False
        block.requested = nbytes
        block.category = cat
        self._num_allocs += 1
        self._charge(cat, block.size, nbytes)  # the whole block when a large one is not cut
        if _timeline._RECORDERS:
            self._emit("alloc", block, new_segment)
        return block

    def _release(self, block: Block) -> None:
        block.free = True
        self._num_frees += 1
        take_bytes(self._all, block.size, block.requested)
        take_bytes(self._by_category[block.category], block.size, block.requested)
        if _timeline._RECORDERS:
            self._emit("free", block, False)
        block.requested = 0
        self._coalesce(block)

    def _coalesce(self, block: Block) -> None:
        """Merge the free ``block`` with its free neighbours into the free lists."""
        pool = block.segment.pool
        buckets = self._free[pool]
        prev = block.prev
        if prev is not None and prev.free:
            self._unlink_free(prev)
            self._absorb(prev, block)
            block = prev
        nxt = block.next
        if nxt is not None and nxt.free:
            # _unlink_free and _absorb, written out: a release next to a segment's free tail
            bucket = buckets[nxt.size]
            del bucket[nxt]
            if not bucket:
                del buckets[nxt.size]
                self._free_sizes[pool].remove(nxt.size)
            block.size += nxt.size
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            nxt.segment = None  # a stale handle to it can no longer read the bytes
        bucket = buckets.get(block.size)  # into the free lists (LIFO within a size)
        if bucket is None:
            bucket = buckets[block.size] = {}
            bisect.insort(self._free_sizes[pool], block.size)
        bucket[block] = None

    def _charge(self, cat: str, size: int, requested: int) -> None:
        """Count a block handed out, in the all-blocks row and ``cat``'s (the C pair counts a
        parked block's reuse the same way)."""
        add_bytes(self._all, size, requested)
        add_bytes(self._by_category[cat], size, requested)

    def _emit(self, kind: str, block: Block, new_segment: bool,
              prev_category: str | None = None) -> None:
        _timeline.emit(_timeline.Event(
            kind=kind, device=self.name, nbytes=block.size, requested=block.requested,
            category=block.category, op=_timeline.current_op(), block=block.id,
            new_segment=new_segment, allocated_bytes=self._all.current,
            prev_category=prev_category))

    def _new_segment(self, pool: int, size: int, nbytes: int = 0, cat: str = "other") -> Block:
        seg_size = SMALL_SEGMENT if pool == _SMALL else -(-size // LARGE_ROUND) * LARGE_ROUND
        if self._limit is not None and self._reserved + seg_size > self._limit:
            self.empty_cache()  # wholly free cached segments count against the limit too
            if self._reserved + seg_size > self._limit:
                self._refuse(nbytes, size, seg_size, cat)
        seg = _Segment(next(self._ids), seg_size, self._factory(seg_size), pool)
        self._segments[seg.id] = seg
        # The offset-0 block of a segment is never absorbed by a neighbour (absorption keeps
        # the lower block), so this head stays valid for the segment's whole life.
        block = self._head[seg.id] = Block(self, seg, 0, seg_size, next(self._ids))
        self._reserved += seg_size
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        self._num_segment_allocs += 1
        return block

    def _refuse(self, nbytes: int, size: int, seg_size: int, cat: str):
        from .oom import out_of_memory_error  # the report reads every allocator

        raise out_of_memory_error({
            "device": self.name, "requested": nbytes, "block": size, "segment": seg_size,
            "allocated": self._all.current, "reserved": self._reserved, "limit": self._limit,
            "largest_free_block": max((s[-1] for s in self._free_sizes if s), default=0),
            "category": cat}, allocator=self)

    @staticmethod
    def _absorb(first: Block, second: Block) -> None:
        """Merge ``second`` (the next block in the segment) into ``first``."""
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        second.segment = None  # a stale handle to it can no longer read the bytes

    def _unlink_free(self, block: Block) -> None:
        pool = block.segment.pool
        bucket = self._free[pool][block.size]
        del bucket[block]
        if not bucket:
            del self._free[pool][block.size]
            self._free_sizes[pool].remove(block.size)
