"""Failure semantics on the thread transport: who is blamed, and the unexpected-message bound."""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest

import needle.distributed as dist
from needle.distributed._errors import PeerError
from needle.distributed._transport import Mailbox


def test_timeout_names_the_rank_that_never_arrived_not_the_neighbour() -> None:
    """Rank 3 of 4 never calls all_reduce. Rank 0 waits for it directly (its left neighbour);
    ranks 1 and 2 wait for innocent neighbours that are themselves stuck. All name rank 3."""
    reported = threading.Semaphore(0)

    def job(rank: int) -> tuple[int, str, str]:
        if rank == 3:  # stays away until the others have given up on it
            for _ in range(3):
                reported.acquire(timeout=60)
            return (-1, "", "")
        try:
            dist.all_reduce(np.ones(8, np.float32), timeout=3)
        except PeerError as exc:
            return (exc.peer, exc.reason, str(exc))
        finally:
            reported.release()
        return (-2, "", "no error")

    results = dist.spawn_threads(job, 4, timeout=60)[:3]
    for rank, (peer, reason, text) in enumerate(results):
        assert (peer, reason) == (3, "timeout"), (rank, text)
    assert "waiting for rank 3 (the call check)" in results[0][2]
    for rank in (1, 2):  # stuck on the left neighbour, which timed out (and maybe left)
        text = results[rank][2]
        assert re.search(rf"(waiting for|with) rank {rank - 1}\b", text), text
        assert re.search(r"rank 3(, which)? never arrived", text), text


def test_unexpected_messages_are_bounded_per_sender() -> None:
    """Beyond the bound a sender is cut off: its kept messages are freed and every receive
    from it raises a PeerError naming it; other senders are unaffected."""
    box = Mailbox(limit_bytes=1000)
    for tag in range(4):
        box.deliver((0, 1, tag), bytes(300))  # 1200 bytes from rank 1 in total: over the bound
    box.deliver((0, 2, 0), bytes(300))
    assert box.peak_held_bytes == 900  # the 4th message is refused, not kept
    with pytest.raises(PeerError, match=r"rank 1 sent 1200 bytes .* limit of 1000") as info:
        box.post(np.empty(300, np.uint8), (0, 1, 0)).test()
    assert (info.value.peer, info.value.reason) == (1, "flood")
    assert box._held[1] == 0 and not any(k[1] == 1 for k in box._unexpected)
    ok = np.empty(300, np.uint8)
    assert box.post(ok, (0, 2, 0)).test()


def test_receives_posted_before_a_sender_is_cut_off_fail_too() -> None:
    box = Mailbox(limit_bytes=100)
    waiting = box.post(np.empty(8, np.uint8), (0, 1, 99))
    box.deliver((0, 1, 5), bytes(101))
    with pytest.raises(PeerError, match="rank 1 sent 101 bytes"):
        waiting.test()
