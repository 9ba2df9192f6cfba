"""The pure overlap model (no communication): the constructed two-bucket example and limits."""
from __future__ import annotations

from needle.distributed.schedule import bucket_finish_times


def test_two_bucket_example_overlap_finishes_at_8_not_11() -> None:
    # backward ends at 6; bucket 0 ready at 3 (sends for 3), bucket 1 ready at 6 (sends for 2)
    assert bucket_finish_times([3, 6], [3, 2], backward_end=6)[-1] == 3 + 3 + 2
    assert bucket_finish_times([3, 6], [3, 2], 6, overlap=False)[-1] == 6 + 3 + 2


def test_overlap_never_slower_and_link_is_serial() -> None:
    ready, comm = [1, 2, 2.5, 7], [4, 1, 1, 0.5]
    on = bucket_finish_times(ready, comm, 7)
    off = bucket_finish_times(ready, comm, 7, overlap=False)
    assert all(a <= b for a, b in zip(on, off, strict=True))
    gaps = zip(on, on[1:], comm[1:], strict=False)
    assert all(later - earlier >= c for earlier, later, c in gaps)
