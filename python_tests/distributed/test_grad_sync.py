"""GradSync, the one gradient-sync engine: DDP, ZeRO and the mesh's data axis give the same
gradients bit for bit; the weighting rule; priority buckets; the ring's segment order."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import needle.distributed as dist
from needle import nn, optim
from needle.autograd import Tensor
from needle.distributed import traffic

pytestmark = pytest.mark.timeout(300)

CAP = 300 / 2 ** 20  # ~300-byte buckets: several, with members of unequal sizes


_BUILD = threading.Lock()  # thread ranks share NumPy's global generator


def _model() -> nn.Module:
    with _BUILD:  # the same initial weights on every rank and for every strategy
        np.random.seed(3)
        return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5), nn.ReLU(),
                             nn.Linear(5, 1))  # tiny pieces: segments != n equal parts


def _examples(rank: int) -> np.ndarray:
    """Unequal counts, values that do not sum exactly in float32 in any order."""
    rows = [2, 7, 4][rank]
    return (np.random.default_rng(10 + rank).standard_normal((rows, 7)) * 1.37
            ).astype(np.float32)


def _backward(model, x: np.ndarray) -> None:
    out = model(Tensor(x))
    ((out * out).sum() / (2.0 * len(x))).backward()  # a mean over this rank's examples


def _ddp(rank: int) -> list[np.ndarray]:
    x = _examples(rank)
    ddp = dist.DistributedDataParallel(_model(), bucket_cap_mb=CAP)
    assert len(ddp.buckets) > 2
    ddp.set_num_examples(len(x))
    _backward(ddp, x)
    ddp.finish_gradient_sync()
    return [p.grad.numpy() for p in ddp.params]


def _zero(stage: int):
    def job(rank: int) -> list[np.ndarray]:
        x = _examples(rank)
        zero = dist.ZeroDataParallel(_model(), optimizer=lambda ps: optim.SGD(ps, lr=0.1),
                                     stage=stage, bucket_cap_mb=CAP)
        zero.set_num_examples(len(x))
        _backward(zero, x)
        zero.finish_gradient_sync()
        grads = zero.full_gradients()
        zero.close()
        return grads

    return job


def _mesh(rank: int) -> list[np.ndarray]:
    x = _examples(rank)
    mesh = dist.init_device_mesh((dist.get_world_size(), 1, 1))
    model = _model()
    _backward(model, x)
    dist.mesh.average_gradients(model.parameters(), mesh.get_group("dp"), len(x),
                                bucket_cap_mb=CAP)
    return [p.grad.numpy() for p in model.parameters()]


def _reference(n: int) -> list[np.ndarray]:
    """float64 gradients of the global mean loss over every rank's examples (NumPy)."""
    x = np.concatenate([_examples(r) for r in range(n)]).astype(np.float64)
    weights = [p.numpy().astype(np.float64) for p in _model().parameters()]
    acts, h = [x], x
    for i in range(0, 6, 2):
        h = h @ weights[i] + weights[i + 1].reshape(1, -1)
        if i < 4:
            h = np.maximum(h, 0)
        acts.append(h)
    d = acts[-1] / len(x)
    grads: list[np.ndarray] = []
    for i in (4, 2, 0):
        grads = [acts[i // 2].T @ d, d.sum(0).reshape(weights[i + 1].shape)] + grads
        d = (d @ weights[i].T) * (acts[i // 2] > 0)
    return grads


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_zero2_and_mesh_dp_give_bitwise_equal_gradients(n):
    ddp = dist.spawn_threads(_ddp, n)
    zero2 = dist.spawn_threads(_zero(2), n)
    zero1 = dist.spawn_threads(_zero(1), n)
    mesh = dist.spawn_threads(_mesh, n)
    want = _reference(n)
    for rank in range(n):
        for a, b, c, d, w in zip(ddp[rank], zero2[rank], zero1[rank], mesh[rank], want,
                                 strict=True):
            np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-6)  # the right gradient
            assert a.tobytes() == b.tobytes() == c.tobytes() == d.tobytes()


def test_every_rank_holds_the_same_bits():
    grads = dist.spawn_threads(_ddp, 3)
    for other in grads[1:]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(grads[0], other, strict=True))


def test_ring_all_reduce_is_reduce_scatter_then_all_gather_bit_for_bit():
    bounds = [0, 2, 9, 10]  # unequal segments

    def job(rank):
        x = (np.random.default_rng(rank).standard_normal(10) * 1e3).astype(np.float32)
        a, b = x.copy(), x.copy()
        dist.all_reduce(a, bounds=bounds)
        rec = traffic.ledger().records[-1]
        dist.reduce_scatter_v(b, bounds)
        dist.all_gather_v(b, bounds)
        return a, b, (rec.sent, rec.recv), traffic.ring_all_reduce_bytes(10, 4, 3, rank, bounds)

    for a, b, measured, predicted in dist.spawn_threads(job, 3):
        assert a.tobytes() == b.tobytes()
        assert measured == predicted
    # segments [2, 7, 1]: rank 1 sends every segment but its own (2 + 1) in the reduce-scatter
    # and every one but rank 2's (2 + 7) in the all-gather; it receives every one but rank
    # 0's (7 + 1), then every one but its own (2 + 1)
    assert traffic.ring_all_reduce_bytes(10, 4, 3, 1, bounds) == (4 * (3 + 9), 4 * (8 + 3))


def test_mean_counts_after_backward_are_refused():
    def job(rank):
        ddp = dist.DistributedDataParallel(_model(), bucket_cap_mb=CAP)
        _backward(ddp, _examples(rank))
        with pytest.raises(dist.CommError, match="before the step's backward"):
            ddp.set_num_examples(3)

    dist.spawn_threads(job, 1)


def test_sum_reduction_divides_by_the_total_after_the_sum():
    def job(rank):
        p = Tensor(np.zeros(3, np.float32))
        sync = dist.GradSync([p], None, dist.AllReduceHook(), reduction="sum")
        p.grad = Tensor(np.full(3, [1.0, 5.0][rank], np.float32))
        sync.set_num_examples([1, 3][rank])
        sync.sync_now()
        return p.grad.numpy().tolist()

    assert dist.spawn_threads(job, 2) == [[1.5] * 3] * 2  # (1 + 5) / 4


def _priority(rank, priority):
    x = _examples(rank)
    ddp = dist.DistributedDataParallel(_model(), bucket_cap_mb=CAP, priority=priority)
    lanes = [b.group is ddp.group for b in ddp.buckets]
    ddp.set_num_examples(len(x))
    _backward(ddp, x)
    ddp.finish_gradient_sync()
    ddp.close()
    return lanes, [p.grad.numpy() for p in ddp.params]


def test_priority_buckets_take_the_second_lane_and_change_no_bit():
    plain = dist.spawn_threads(lambda r: _priority(r, 0), 3)
    fast = dist.spawn_threads(lambda r: _priority(r, 2), 3)
    for (lanes0, g0), (lanes2, g2) in zip(plain, fast, strict=True):
        assert all(lanes0)
        # the last two buckets hold the earliest layers (reverse order): the second lane
        assert lanes2 == [True] * (len(lanes2) - 2) + [False, False]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(g0, g2, strict=True))
