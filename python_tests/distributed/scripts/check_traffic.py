"""Run under the launcher: every rank checks the traffic ledger against the closed forms and
against its group's channel counters, for a ring all-reduce and a DDP step."""
from __future__ import annotations

import numpy as np

import needle.distributed as dist
from needle import nn
from needle.autograd import Tensor
from needle.distributed import traffic


def main() -> None:
    dist.init_process_group(timeout=60)
    n, rank = dist.get_world_size(), dist.get_rank()
    group = dist.process_group._group.current_state().world
    before = (group.counters.sent, group.counters.overhead_sent)
    x = np.ones(n * 25_000, np.float32)  # M = 100,000 n bytes, divisible into n segments
    dist.all_reduce(x)
    rec = traffic.ledger().records[-1]
    m = x.nbytes
    assert rec.predicted_sent == rec.predicted_recv == 2 * (n - 1) * m // n, rec
    assert (rec.sent, rec.recv) == (rec.predicted_sent, rec.predicted_recv), rec
    # the transport was handed exactly that payload plus one call check
    assert group.counters.sent - before[0] == rec.sent
    assert group.counters.overhead_sent - before[1] == 192
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    ddp = dist.DistributedDataParallel(model, bucket_cap_mb=0.001)
    for _ in range(2):
        ddp(Tensor(np.ones((4, 16), np.float32))).sum().backward()
        ddp.finish_gradient_sync()
    steps = traffic.ledger().per_step()
    grads = steps[-1]["by_label"]["ddp gradients"]
    sizes = [b.flat.nbytes for b in ddp.buckets]
    closed = sum(traffic.ring_all_reduce_bytes(b.flat.size, 4, n, rank)[0] for b in ddp.buckets)
    assert grads["sent"] == grads["expected_sent"] == grads["predicted_sent"] == closed
    assert len(sizes) > 1  # several buckets
    print(f"TRAFFIC OK rank {rank} of {n}: {grads['sent']} B per step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
