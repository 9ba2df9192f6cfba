"""needle's caching allocator for the ``cuda`` device, over memory from CuPy.

The CUDA backend asks ``fn(nbytes) -> owner`` for every buffer (``owner.ptr`` is the device
address; dropping the owner frees it). Here ``fn`` cuts blocks from segments that CuPy
allocates (with CuPy's own pool underneath) with the same size classes and
statistics as the CPU allocators, so ``needle.memory.stats(cuda())`` reports the same fields.
Reuse follows stream order: every needle kernel runs on the current stream, so a block freed
after its last kernel was queued is only written again by kernels queued after that one.

Example:
    >>> class FakeMemory:                     # stands in for cupy.cuda.MemoryPointer
    ...     def __init__(self, n): self.ptr = 4096
    >>> alloc = make_cuda_allocator(FakeMemory)
    >>> owner = DeviceBlock(alloc.allocate(1000)); owner.ptr
    4096
"""
from __future__ import annotations

from .caching_allocator import CachingAllocator

__all__ = ["DeviceBlock", "make_cuda_allocator", "install_cuda_allocator"]


class DeviceBlock:
    """What the CUDA backend holds for one buffer: the address, and the block until dropped.

    ``block`` must be a :class:`~needle.memory.caching_allocator.Block` of a live
    :class:`CachingAllocator` (its address is read from its segment without a call); other
    allocators' pieces need an owner of their own.
    """

    __slots__ = ("block", "ptr")

    def __init__(self, block):
        self.block = block
        self.ptr = block.segment.base + block.offset  # Block.ptr, written out (hot path)

    def __del__(self):
        block = self.block
        try:
            block.allocator._release_trusted(block)
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn the allocator down
            pass


def make_cuda_allocator(segment_alloc) -> CachingAllocator:
    """A caching allocator whose segments come from ``segment_alloc(nbytes)`` (e.g.
    ``cupy.cuda.alloc``, returning an object with ``.ptr``)."""
    return CachingAllocator("cuda", segment_factory=segment_alloc)


def install_cuda_allocator(mod, segment_alloc) -> CachingAllocator:
    """Route the CUDA backend module ``mod`` through a new caching allocator; returns it."""
    alloc = make_cuda_allocator(segment_alloc)
    mod.set_allocator(_trusted_owner(alloc))
    return alloc


def _trusted_owner(alloc: CachingAllocator):
    """``fn(nbytes) -> owner``: an owner (``.ptr``, ``.block``) of a new block of ``alloc`` in
    one call. The backend passes an int >= 0 (the Array checked it): the trusted pair skips
    the checks. The C pair (``needle.memory._trusted_pair``, built with the package) serves a
    parked block without running Python; without it, :func:`python_trusted_owner`."""
    try:
        from ._trusted_pair import TrustedPair
    except ImportError:  # a source tree used without building: the same pair in Python
        return python_trusted_owner(alloc)
    from . import timeline
    from .caching_allocator import BLOCK_ROUND, Block
    from .categories import _DEFAULT, thread_state

    return TrustedPair(alloc, Block, thread_state(), timeline, _DEFAULT, BLOCK_ROUND)


def python_trusted_owner(alloc: CachingAllocator) -> type:
    """The trusted owner in Python: a :class:`DeviceBlock` subclass whose ``cls(nbytes)``
    allocates through ``alloc``'s trusted pair (the reference the C pair is tested against)."""
    allocate, release = alloc._allocate_trusted, alloc._release_trusted

    class TrustedDeviceBlock(DeviceBlock):
        __slots__ = ()

        def __init__(self, nbytes: int):  # noqa: D107 - see python_trusted_owner
            block = self.block = allocate(nbytes)
            self.ptr = block.segment.base + block.offset

        def __del__(self):
            try:
                release(self.block)
            except Exception:  # noqa: BLE001 - interpreter shutdown may have torn it down
                pass

    return TrustedDeviceBlock
