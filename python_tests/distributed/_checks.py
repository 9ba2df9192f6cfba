"""Checks shared by the thread tests and the multi-process scripts (imported by both).

Every rank's input is a deterministic function of (rank, size), so each rank re-derives the
expected result with NumPy on its own; small integer values keep float16 sums exact.
"""
from __future__ import annotations

import numpy as np

import needle.distributed as dist
from needle.distributed.reference import naive_all_gather, naive_all_reduce

DTYPES = ["float32", "float64", "float16"]
SIZES = [1, 7, 13, 1001]
NP_OPS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def data(rank: int, numel: int, dtype: str, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + numel + salt)
    return rng.integers(-4, 5, size=numel).astype(dtype)


def expected_reduce(op: str, numel: int, dtype: str, world: int, salt: int = 0) -> np.ndarray:
    stack = np.stack([data(r, numel, dtype, salt).astype(np.float64) for r in range(world)])
    return NP_OPS[op](stack, axis=0).astype(dtype)


def check_all_reduce(rank: int, world: int, dtype: str) -> None:
    for numel in SIZES:
        for op in NP_OPS:
            x = data(rank, numel, dtype)
            dist.all_reduce(x, op=op)
            want = expected_reduce(op, numel, dtype, world)
            np.testing.assert_allclose(x, want, rtol=1e-3 if dtype == "float16" else 1e-6)
            ref = naive_all_reduce(data(rank, numel, dtype), op)
            np.testing.assert_allclose(x, ref, rtol=1e-3 if dtype == "float16" else 1e-6)
    native = data(rank, 13, dtype)
    if dist.get_backend() == "tcp":
        try:
            dist.all_reduce(native, algorithm="native")
        except dist.CommError as exc:
            assert "algorithm='native'" in str(exc), exc
        else:
            raise AssertionError("tcp has no native all_reduce, expected CommError")
        return
    dist.all_reduce(native, algorithm="native")
    np.testing.assert_array_equal(native, expected_reduce("sum", 13, dtype, world))


def check_others(rank: int, world: int, dtype: str) -> None:
    numel = 13
    for root in {0, world - 1}:
        x = data(rank, numel, dtype)
        dist.broadcast(x, src=root)
        np.testing.assert_array_equal(x, data(root, numel, dtype))
        x = data(rank, numel, dtype)
        dist.reduce(x, dst=root, op="sum")
        want = expected_reduce("sum", numel, dtype, world) if rank == root else data(rank, numel,
                                                                                     dtype)
        np.testing.assert_array_equal(x, want)
        outs = [np.zeros(numel, dtype) for _ in range(world)] if rank == root else None
        dist.gather(data(rank, numel, dtype), outs, dst=root)
        if rank == root:
            for r in range(world):
                np.testing.assert_array_equal(outs[r], data(r, numel, dtype))
        got = np.zeros(numel, dtype)
        parts = [data(100 + r, numel, dtype) for r in range(world)] if rank == root else None
        dist.scatter(got, parts, src=root)
        np.testing.assert_array_equal(got, data(100 + rank, numel, dtype))
    outs = [np.zeros((3, 5), dtype) for _ in range(world)]
    mine = data(rank, 15, dtype).reshape(3, 5)
    dist.all_gather(outs, mine)
    ref = naive_all_gather(mine)
    for r in range(world):
        np.testing.assert_array_equal(outs[r], data(r, 15, dtype).reshape(3, 5))
        np.testing.assert_array_equal(outs[r], ref[r])
    out = np.zeros(7, dtype)
    ins = [data(rank, 7, dtype, salt=s) for s in range(world)]
    dist.reduce_scatter(out, ins, op="max")
    want = np.max(np.stack([data(r, 7, dtype, salt=rank) for r in range(world)]), axis=0)
    np.testing.assert_array_equal(out, want)
    dist.barrier()


def check_p2p(rank: int, world: int) -> None:
    """Round trips of every dtype between rank 0 and each other rank, on two tags."""
    dtypes = DTYPES + ["int32", "int64", "uint8"]
    for peer in range(1, world):
        for i, dtype in enumerate(dtypes):
            shape = (2, 3 + i)
            ping = data(peer, 6 + 2 * i, dtype).reshape(shape)
            if rank == 0:
                dist.send(ping, peer, tag=i)
                back = np.zeros(shape, dtype)
                work = dist.irecv(back, peer, tag=100 + i)
                work.wait()
                assert work.is_completed()
                np.testing.assert_array_equal(back, ping * 2)
            elif rank == peer:
                got = np.zeros(shape, dtype)
                dist.recv(got, 0, tag=i)
                np.testing.assert_array_equal(got, ping)
                dist.isend(got * 2, 0, tag=100 + i).wait()


def check_mismatch(rank: int, world: int) -> None:
    """A receive whose buffer disagrees with the sender raises and leaves the buffer alone."""
    if world < 2 or rank > 1:
        return
    if rank == 0:
        dist.send(np.ones(4, np.float32), 1, tag=7)
        dist.send(np.ones(3, np.float32), 1, tag=8)
    else:
        for tag, buf in ((7, np.zeros(4, np.float64)), (8, np.zeros(5, np.float32))):
            try:
                dist.recv(buf, 0, tag=tag)
            except dist.CommError as exc:
                assert "expected" in str(exc) and "got float" in str(exc), exc
                assert not buf.any()
            else:
                raise AssertionError(f"mismatched recv on tag {tag} did not raise")
