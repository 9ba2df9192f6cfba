"""Run by test_zero_mp.py on real processes.

``equal``: every ZeRO stage's weights after a few steps equal DDP's (same optimizer, data).
``memory PRECISION``: a 1,000,000-parameter model, one step per stage; this rank's measured
model-state bytes (needle.memory) must equal the ledger's prediction category by category.
"""
from __future__ import annotations

import gc
import os
import sys

import numpy as np

import needle.autograd  # noqa: F401 - before needle.nn: works around a circular import

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _zero_checks  # noqa: E402

import needle as ndl  # noqa: E402
import needle.distributed as dist  # noqa: E402
from needle import amp, nn, optim  # noqa: E402
from needle.autograd import Tensor  # noqa: E402
from needle.distributed.zero import accounting  # noqa: E402


def check_equal(rank: int, world: int) -> None:
    for stage in (1, 2, 3):
        _zero_checks.check_matches_ddp(rank, world, stage)
    X = np.random.default_rng(1).standard_normal((23, 5))
    y = np.arange(23) % 3
    for strategy in ("ddp", "zero"):  # inside the process group: every rank calls it
        report = dist.check_equivalence(_zero_checks.float64_mlp, nn.SoftmaxLoss(), X, y,
                                        accumulate=3, strategy=strategy, verbose=rank == 0)
        assert report.world_size == world and report.total == 23
    print(f"ZERO EQUAL OK rank {rank} of {world} on {dist.get_backend()}")


def one_step(stage: int, precision: str, device) -> dict:
    np.random.seed(0)
    model = nn.Linear(1000, 1000, bias=False, device=device)  # 1,000,000 parameters
    if precision == "mixed":
        amp.cast_parameters(model)
    zero = dist.ZeroDataParallel(model, optimizer=lambda ps: optim.Adam(ps, lr=1e-3),
                                 stage=stage)
    scaler = amp.GradScaler(enabled=precision == "mixed")
    x = Tensor(np.random.default_rng(dist.get_rank()).standard_normal((4, 1000)),
               device=device, requires_grad=False)
    with amp.autocast(enabled=precision == "mixed"):
        out = zero(x)
        loss = ndl.ops.summation(out) / 4000.0  # gradients of order 1e-3: no overflow
    scaler.scale(loss).backward()
    del loss, out
    assert scaler.step(zero.optimizer)
    row = accounting.report(zero, device)
    zero.close()
    return row


def check_memory(rank: int, world: int, precision: str) -> None:
    device = ndl.cpu()
    ndl.memory.stats(device)  # install the C++ allocator's categories before anything
    failures = []
    for stage in (1, 2, 3):
        gc.collect()
        row = one_step(stage, precision, device)
        total = sum(row["predicted"].values())
        print(f"stage {stage} rank {rank}: measured {row['measured']} predicted "
              f"{row['predicted']} total {total:,} allocated {row['allocated']}", flush=True)
        if row["measured"] != row["predicted"]:
            failures.append(stage)
        # the allocator's rounding (docs/memory.md): < 512 B per small block; a large block
        # may carry up to 1 MiB of its 2 MiB segment's remainder
        rounding = {c: row["allocated"][c] - row["measured"][c] for c in row["measured"]}
        if any(not 0 <= r <= 2 ** 20 + 512 * 8 for r in rounding.values()):
            failures.append(f"rounding {stage}: {rounding}")
        gc.collect()
    if failures:
        raise SystemExit(f"memory mismatch on rank {rank}: {failures}")
    print(f"ZERO MEMORY OK rank {rank} of {world} {precision}")


if __name__ == "__main__":
    dist.init_process_group(timeout=60)
    r, n = dist.get_rank(), dist.get_world_size()
    if sys.argv[1] == "equal":
        check_equal(r, n)
    else:
        check_memory(r, n, sys.argv[2])
