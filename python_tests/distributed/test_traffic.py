"""The communication-volume ledger: predicted bytes per call equal the channels' counters."""
from __future__ import annotations

import math

import numpy as np
import pytest

import needle.distributed as dist
from needle import nn
from needle.autograd import Tensor
from needle.distributed import traffic

from .test_multiprocess import launch


def _counters():
    return dist.process_group._group.current_state().world.counters


def _all_kinds(rank):
    """Every collective and a send/recv; returns the records and the channel counters."""
    n = dist.get_world_size()
    c = _counters()
    start = (c.sent, c.recv, c.overhead_sent, c.overhead_recv)
    dist.all_reduce(np.ones(n * 1000, np.float32))                   # 4000 n bytes
    dist.all_reduce(np.ones(1001, np.float32))                       # segments of unequal size
    dist.all_gather([np.zeros(10, np.float32) for _ in range(n)], np.ones(10, np.float32))
    dist.reduce_scatter(np.zeros(7, np.float32), [np.ones(7, np.float32)] * n)
    dist.broadcast(np.ones(33, np.float32), src=n - 1)
    dist.reduce(np.ones(9, np.float32), dst=0)
    dist.barrier()
    if rank == 0:
        dist.send(np.ones(5, np.float64), dst=1)
    elif rank == 1:
        dist.recv(np.ones(5, np.float64), src=0)
    end = (c.sent, c.recv, c.overhead_sent, c.overhead_recv)
    records = list(traffic.ledger().records)
    return records, tuple(e - s for s, e in zip(start, end, strict=True))


@pytest.mark.parametrize("n", [2, 3])
def test_every_call_measures_what_it_predicts(n):
    results = dist.spawn_threads(_all_kinds, n)
    for rank, (records, (sent, recv, over_sent, over_recv)) in enumerate(results):
        assert all(r.matches for r in records), [r for r in records if not r.matches]
        # every byte the channels saw belongs to a record: payload and overhead apart
        assert sum(r.sent for r in records) == sent and sum(r.recv for r in records) == recv
        assert sum(r.overhead_sent for r in records) == over_sent
        assert sum(r.overhead_recv for r in records) == over_recv
        by_kind = {}
        for r in records:
            by_kind.setdefault(r.kind, []).append(r)
        ring = by_kind["all_reduce"][0]  # the closed form of the ring, n divides the count
        assert ring.sent == ring.recv == 2 * (n - 1) * (n * 4000) // n
        assert by_kind["all_gather"][0].sent == (n - 1) * 40
        assert by_kind["reduce_scatter"][0].sent == (n - 1) * 28
        assert by_kind["barrier"][0].sent == math.ceil(math.log2(n))
        assert by_kind["broadcast"][0].recv == (0 if rank == n - 1 else 132)
        if rank == 0:
            assert by_kind["send"][0].sent == 40 and by_kind["send"][0].overhead_sent > 0
    # unequal segments: per rank it differs, over the ring it is exactly 2(n-1) M
    odd = [records[1] for records, _ in results]
    assert sum(r.sent for r in odd) == sum(r.recv for r in odd) == 2 * (n - 1) * 4004


def _ddp_steps(rank):
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    ddp = dist.DistributedDataParallel(model, bucket_cap_mb=0.001)
    for _ in range(3):
        ddp(Tensor(np.ones((4, 16), np.float32) * (rank + 1))).sum().backward()
        ddp.finish_gradient_sync()
    sizes = [b.flat.nbytes for b in ddp.buckets]
    return traffic.ledger().per_step(), sizes, traffic.ledger().summary()


def test_ddp_steps_are_predicted_per_bucket_and_measured():
    results = dist.spawn_threads(_ddp_steps, 2)
    for steps, sizes, summary in results:
        assert [s["step"] for s in steps] == [0, 1, 2, 3]  # set-up, then three steps
        assert "ddp set-up" in steps[0]["by_label"]
        for row in steps[1:]:
            grads = row["by_label"]["ddp gradients"]
            # ring 2(n-1)/n x M for each bucket, n = 2: M per bucket (every bucket is even)
            assert grads["expected_sent"] == grads["sent"] == grads["recv"] == sum(sizes)
            assert grads["calls"] == len(sizes) > 1
        assert summary["all_match"] and summary["sent"] == summary["predicted_sent"]


def test_native_collectives_are_recorded_unmeasured():
    def job(rank):
        dist.all_reduce(np.ones(8, np.float32), algorithm="native")
        return traffic.ledger().records[-1]

    for rec in dist.spawn_threads(job, 2):
        assert rec.sent is None and rec.matches is None and rec.predicted_sent == 32


def test_ledger_needs_a_process_group():
    with pytest.raises(dist.CommError, match="no process group"):
        traffic.ledger()


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_ring_prediction_equals_the_counters_over_mpi():
    out = launch(2, "mpi", "check_traffic.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for rank in range(2):
        assert f"[rank {rank}] TRAFFIC OK rank {rank} of 2" in out.stdout
