"""Collectives on the thread transport at world sizes 1-8 against NumPy and the naive reference."""
from __future__ import annotations

import numpy as np
import pytest

import needle.distributed as dist

from ._checks import DTYPES, check_all_reduce, check_others, data, expected_reduce


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", range(1, 9))
def test_collectives_match_reference(world: int, dtype: str) -> None:
    def job(rank: int) -> None:
        check_all_reduce(rank, world, dtype)
        check_others(rank, world, dtype)

    dist.spawn_threads(job, world, timeout=30)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_many_small_chunks_pipeline(world: int) -> None:
    """Tiny chunks force the pipelined path (many chunks per segment, uneven segments)."""

    def job(rank: int) -> None:
        dist.get_rank()
        from needle.distributed._group import resolve

        resolve(None, "test").chunk_bytes = 24
        for numel in (5, 97, 1000):
            x = data(rank, numel, "float32")
            dist.all_reduce(x)
            np.testing.assert_array_equal(x, expected_reduce("sum", numel, "float32", world))
            y = data(rank, numel, "float64")
            dist.broadcast(y, src=world - 1)
            np.testing.assert_array_equal(y, data(world - 1, numel, "float64"))
            z = data(rank, numel, "float32")
            dist.reduce(z, dst=1 % world, op="min")
            if rank == 1 % world:
                np.testing.assert_array_equal(z, expected_reduce("min", numel, "float32", world))

    dist.spawn_threads(job, world, timeout=30)


def test_worked_example() -> None:
    def job(rank: int) -> list[float]:
        x = np.array([[1, 2, 3], [1, 0, 1]][rank], dtype=np.float32)
        dist.all_reduce(x)
        return x.tolist()

    assert dist.spawn_threads(job, 2) == [[2.0, 2.0, 4.0], [2.0, 2.0, 4.0]]


def test_random_floats_close_to_float64_sum() -> None:
    def job(rank: int) -> None:
        x = np.random.default_rng(rank).standard_normal(12345).astype(np.float32)
        dist.all_reduce(x)
        want = sum(np.random.default_rng(r).standard_normal(12345) for r in range(4))
        np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)

    dist.spawn_threads(job, 4)


def test_async_all_reduce_returns_work_in_issue_order() -> None:
    def job(rank: int) -> None:
        xs = [np.full(100, float(rank + i), np.float32) for i in range(5)]
        works = [dist.all_reduce(x, async_op=True) for x in xs]
        dist.all_reduce(sync := np.ones(3, np.float32))  # queued behind the async ones
        for i, (w, x) in enumerate(zip(works, xs, strict=False)):
            w.wait()
            assert w.is_completed()
            np.testing.assert_array_equal(x, np.full(100, float(0 + 1 + 2 * i)))
        np.testing.assert_array_equal(sync, np.full(3, 2.0))

    dist.spawn_threads(job, 2)


def test_subgroups() -> None:
    def job(rank: int) -> None:
        evens = dist.new_group([0, 2])
        x = np.full(4, float(rank), np.float64)
        if rank in (0, 2):
            dist.all_reduce(x, group=evens)
            np.testing.assert_array_equal(x, np.full(4, 2.0))
            assert dist.get_rank(evens) == rank // 2 and dist.get_world_size(evens) == 2
        else:
            with pytest.raises(dist.CommError, match="not a member"):
                dist.all_reduce(x, group=evens)
        dist.all_reduce(y := np.ones(2), group=None)
        np.testing.assert_array_equal(y, np.full(2, 3.0))

    dist.spawn_threads(job, 3)
