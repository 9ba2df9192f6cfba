"""Pure model of DDP's communication schedule, to reason about (and test) overlap without
any communication: buckets become ready during backward and share one communication link."""
from __future__ import annotations


def bucket_finish_times(ready: list[float], comm: list[float], backward_end: float,
                        overlap: bool = True) -> list[float]:
    """When each bucket's all-reduce ends, buckets being sent one at a time in index order.

    With ``overlap`` a bucket starts as soon as it is ready and the link is free; without, all
    wait for the end of backward.

    Example (two buckets, backward ends at t=6): overlap finishes at 8, not 11.
        >>> bucket_finish_times([3, 6], [3, 2], backward_end=6)
        [6, 8]
        >>> bucket_finish_times([3, 6], [3, 2], backward_end=6, overlap=False)
        [9, 11]
    """
    link_free = 0.0 if overlap else backward_end
    done = []
    for r, c in zip(ready, comm, strict=False):
        start = max(r, link_free)
        link_free = start + c
        done.append(link_free)
    return done
