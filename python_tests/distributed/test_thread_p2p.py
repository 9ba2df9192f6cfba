"""Point-to-point and failure behaviour on the thread transport."""
from __future__ import annotations

import time

import numpy as np
import pytest

import needle.distributed as dist

from ._checks import check_mismatch, check_p2p


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_round_trips_every_dtype(world: int) -> None:
    dist.spawn_threads(check_p2p, world, world)


def test_mismatched_dtype_or_shape_raises_and_keeps_buffer() -> None:
    dist.spawn_threads(check_mismatch, 2, 2)


def test_irecv_mismatch_raises_at_wait() -> None:
    def job(rank: int) -> None:
        if rank == 0:
            dist.send(np.arange(6, dtype=np.float32).reshape(2, 3), 1)
        else:
            buf = np.zeros((3, 2), np.float32)
            work = dist.irecv(buf, 0)
            mismatch = r"expected float32 \(3, 2\), got float32 \(2, 3\)"
            with pytest.raises(dist.CommError, match=mismatch):
                work.wait()
            assert not buf.any()

    dist.spawn_threads(job, 2)


def test_recv_timeout_names_op_rank_and_peer() -> None:
    def job(rank: int) -> None:
        if rank == 1:
            start = time.monotonic()
            with pytest.raises(dist.CommError, match=r"recv: rank 1 timed out after 0.2 s "
                                                     r"waiting for rank 0 \(tag 5"):
                dist.recv(np.zeros(2), 0, tag=5, timeout=0.2)
            assert time.monotonic() - start < 5
        dist.barrier()

    dist.spawn_threads(job, 2)


def test_collective_timeout_names_peer() -> None:
    def job(rank: int) -> None:
        if rank == 0:
            with pytest.raises(dist.CommError, match=r"all_reduce: rank 0 timed out .* rank 1"):
                dist.all_reduce(np.zeros(3), timeout=0.2)
        else:
            time.sleep(0.5)  # rank 1 never joins the all_reduce

    dist.spawn_threads(job, 2)


def test_rank_that_leaves_fails_peers_fast() -> None:
    def job(rank: int) -> None:
        if rank == 1:
            return  # leaves at once: spawn_threads destroys its group
        start = time.monotonic()
        with pytest.raises(dist.CommError, match="rank 1 left"):
            dist.recv(np.zeros(2), 1, timeout=10)
        assert time.monotonic() - start < 5

    dist.spawn_threads(job, 2)


def test_different_collectives_are_reported() -> None:
    def job(rank: int) -> None:
        x = np.zeros(3 + rank, np.float32)
        with pytest.raises(dist.CommError, match="ranks called different collectives"):
            dist.all_reduce(x, timeout=2)

    dist.spawn_threads(job, 2)


def test_bad_arguments_raise() -> None:
    def job(rank: int) -> None:
        with pytest.raises(dist.CommError, match="dst rank out of range"):
            dist.send(np.zeros(1), 5)
        with pytest.raises(dist.CommError, match="tag out of range"):
            dist.send(np.zeros(1), 1 - rank, tag=-1)
        with pytest.raises(dist.CommError, match="unknown reduction"):
            dist.all_reduce(np.zeros(1), op="prod")
        with pytest.raises(dist.CommError, match="unknown algorithm"):
            dist.all_reduce(np.zeros(1), algorithm="butterfly")

    dist.spawn_threads(job, 2)


def test_without_group_raises() -> None:
    with pytest.raises(dist.CommError, match="init_process_group"):
        dist.all_reduce(np.zeros(1))


def test_destroyed_group_raises() -> None:
    def job(rank: int) -> None:
        sub = dist.new_group([0, 1])
        dist.destroy_process_group(sub)
        with pytest.raises(dist.CommError, match="destroyed"):
            dist.all_reduce(np.zeros(1), group=sub)

    dist.spawn_threads(job, 2)
