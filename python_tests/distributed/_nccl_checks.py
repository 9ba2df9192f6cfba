"""One body of NCCL checks for two runs: the emulator with the fake NCCL on thread ranks
(test_nccl.py) and real NCCL, one process per GPU (scripts/check_nccl.py, a cuda test).

Every rank can compute every rank's input, so each result is compared with a float64 NumPy
reference (within the dtype's rounding: NCCL's summation order is its own) and the count of
device-to-host copies the collective itself made (``counted``) must be zero.
"""
from __future__ import annotations

import threading

import numpy as np

import needle.distributed as dist
from needle import nn
from needle._core.dtypes import numpy_dtype
from needle.autograd import Tensor

TOLERANCE = {"float32": 1e-6, "float64": 1e-12, "float16": 2e-3, "bfloat16": 1.6e-2}
_COUNT = threading.local()


def counted(to_numpy):
    """``to_numpy`` counting its calls per thread (each rank is a thread or a process)."""
    def wrapper(*args, **kwargs):
        _COUNT.n = getattr(_COUNT, "n", 0) + 1
        return to_numpy(*args, **kwargs)

    return wrapper


def _copies() -> int:
    return getattr(_COUNT, "n", 0)


def _inputs(world: int, n: int, salt: float) -> list[np.ndarray]:
    return [np.linspace(-1.0, 1.0, n) * (r + 1) + salt * r for r in range(world)]


class _Checker:
    def __init__(self, dev, rank: int, world: int):
        self.dev, self.rank, self.world = dev, rank, world

    def on(self, values, dtype: str) -> Tensor:
        return Tensor(np.asarray(values, dtype=dtype), device=self.dev, dtype=dtype,
                      requires_grad=False)

    def call(self, fn, *args, **kwargs) -> None:
        before = _copies()
        fn(*args, **kwargs)
        assert _copies() == before, f"{fn.__name__} copied a cuda() tensor to the host"

    def close(self, got, want: np.ndarray, dtype: str, what: str) -> None:
        tol = TOLERANCE[dtype]
        values = got.numpy() if isinstance(got, Tensor) else got
        assert str(values.dtype) == dtype, f"{what}: expected {dtype}, got {values.dtype}"
        np.testing.assert_allclose(values.astype(np.float64), want, rtol=tol,
                                   atol=tol, err_msg=f"{what} {dtype} rank {self.rank}")

    def collectives(self, dtype: str) -> None:
        rank, world = self.rank, self.world
        xs = _inputs(world, 6, 0.5)
        # what each rank really holds
        xs = [x.astype(numpy_dtype(dtype)).astype(np.float64) for x in xs]
        for op, ref in (("sum", np.sum(xs, axis=0)), ("mean", np.mean(xs, axis=0)),
                        ("max", np.max(xs, axis=0)), ("min", np.min(xs, axis=0))):
            t = self.on(xs[rank], dtype)
            self.call(dist.all_reduce, t, op=op)
            self.close(t, ref, dtype, f"all_reduce {op}")
        t = self.on(xs[rank], dtype)
        self.call(dist.broadcast, t, src=world - 1)
        self.close(t, xs[world - 1], dtype, "broadcast")
        outs = [self.on(np.zeros(6), dtype) for _ in range(world)]
        self.call(dist.all_gather, outs, self.on(xs[rank], dtype))
        for r in range(world):
            self.close(outs[r], xs[r], dtype, f"all_gather [{r}]")
        out = self.on(np.zeros(2), dtype)
        parts = [self.on(xs[rank][2 * (r % 3):2 * (r % 3) + 2], dtype) for r in range(world)]
        self.call(dist.reduce_scatter, out, parts)
        self.close(out, sum(x[2 * (rank % 3):2 * (rank % 3) + 2] for x in xs), dtype,
                   "reduce_scatter")
        bounds = [0] + [1 + 5 * (r + 1) // world for r in range(world)]  # unequal segments
        bounds[-1] = 6
        flat = self.on(xs[rank], dtype)
        self.call(dist.reduce_scatter_v, flat, bounds)
        lo, hi = bounds[rank], bounds[rank + 1]
        self.close(flat.numpy()[lo:hi], np.sum(xs, axis=0)[lo:hi], dtype,
                   "reduce_scatter_v")
        flat = self.on(xs[rank], dtype)
        self.call(dist.all_gather_v, flat, bounds)
        want = np.concatenate([xs[r][bounds[r]:bounds[r + 1]] for r in range(world)])
        self.close(flat, want, dtype, "all_gather_v")

    def point_to_point(self) -> None:
        """Rank r sends to r + 1 in turn (no two ranks send to each other at once)."""
        rank, world = self.rank, self.world
        if world == 1:
            return
        got = self.on(np.zeros(5), "float32")
        if rank > 0:
            self.call(dist.recv, got, src=rank - 1, tag=3)
            self.close(got, np.arange(5.0) + rank - 1, "float32", "recv")
        if rank < world - 1:
            self.call(dist.send, self.on(np.arange(5.0) + rank, "float32"), dst=rank + 1,
                      tag=3)
        dist.barrier()

    def ddp(self, build_lock) -> None:
        """DDP of a small MLP on cuda(): the gradients of the global mean batch."""
        x = np.random.default_rng(0).standard_normal((2 * self.world, 3)).astype(np.float32)
        with build_lock:
            np.random.seed(0)
            model = nn.Sequential(nn.Linear(3, 4, device=self.dev), nn.ReLU(),
                                  nn.Linear(4, 2, device=self.dev))
            np.random.seed(0)
            host = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        ddp = dist.DistributedDataParallel(model, bucket_cap_mb=1e-5)
        part = Tensor(x[2 * self.rank:2 * self.rank + 2], device=self.dev, requires_grad=False)
        before = _copies()
        ddp(part).sum().backward()
        ddp.finish_gradient_sync()
        assert _copies() == before, "DDP copied a gradient to the host"
        (host(Tensor(x, requires_grad=False)).sum() / self.world).backward()
        for p, q in zip(model.parameters(), host.parameters(), strict=True):
            np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-6)


def run_checks(dev, rank: int, world: int, build_lock) -> None:
    """Every check on this rank (call it on every rank of an nccl group, with ``to_numpy``
    of the CUDA backend wrapped by :func:`counted`)."""
    assert dist.get_backend() == "nccl", dist.get_backend()
    checker = _Checker(dev, rank, world)
    for dtype in TOLERANCE:
        checker.collectives(dtype)
    checker.point_to_point()
    checker.ddp(build_lock)
