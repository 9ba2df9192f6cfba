"""All-reduce of float32 from 4 KiB to 256 MiB, side by side, time, algbw, busbw and ratio:

* ``--backend mpi``: needle's pipelined ring vs the transport's native collective (MPICH
  MPI_Iallreduce through mpi4py);
* ``--backend tcp``: needle's ring over the authenticated transport (CURVE: every frame
  encrypted and authenticated, the default) vs the same ring over a second, unauthenticated
  process group (``NEEDLE_DIST_AUTH=off``), i.e. the cost of authentication.

    python bench/bench_collectives.py --nproc 2 --backend mpi     # also: --backend tcp, --nproc 4

Starts itself on ``--nproc`` ranks through needle's launcher. The two variants alternate at each
size (same buffers, same run); each entry is the median of repeats. busbw = algbw * 2(n-1)/n,
the per-rank link traffic of a bandwidth-optimal all-reduce.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import needle.distributed as dist  # noqa: E402
from needle.distributed.launch import free_port, relaunch  # noqa: E402

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def plain_tcp_group(world: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second group of the same ranks over a transport without authentication (private
    API: only a benchmark wants two transports in one process)."""
    from needle.distributed._tcp_security import Security
    from needle.distributed._tcp_transport import TcpTransport

    port = np.array([free_port() if world.rank == 0 else 0], np.int64)
    dist.broadcast(port, src=0)
    insecure = Security("off", "bench-plain", None, world.size)
    transport = TcpTransport(world.rank, world.size, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                             int(port[0]), world.timeout, security=insecure)
    return dist.ProcessGroup(transport, transport.channels(2, list(range(world.size))),
                             world.timeout)


def time_one(x: np.ndarray, variant: tuple) -> float:
    group, algorithm = variant
    dist.barrier(group=group)
    start = time.perf_counter()
    dist.all_reduce(x, algorithm=algorithm, group=group)
    elapsed = np.array([time.perf_counter() - start])
    dist.all_reduce(elapsed, op="max")  # the collective is as slow as its slowest rank
    return float(elapsed[0])


def measure(nbytes: int, variants: dict[str, tuple], budget: float) -> dict[str, float]:
    x = np.ones(nbytes // 4, np.float32)
    algorithms = list(variants)
    for algorithm in algorithms:  # warm-up: page faults, connections, scratch buffers
        time_one(x, variants[algorithm])
    samples: dict[str, list[float]] = {a: [] for a in algorithms}
    start = time.perf_counter()
    go = np.ones(1, np.int32)
    while go[0]:
        count = len(samples[algorithms[0]])
        # rank 0 decides how many repeats, so that every rank runs the same collectives
        go[0] = count < 3 or (time.perf_counter() - start < budget and count < 50)
        dist.broadcast(go, src=0)
        if not go[0]:
            break
        for algorithm in algorithms:
            x[...] = 1.0  # keep values finite over repeats
            samples[algorithm].append(time_one(x, variants[algorithm]))
    return {a: statistics.median(s) for a, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", choices=["mpi", "tcp"], default="mpi")
    parser.add_argument("--max-mib", type=float, default=256)
    parser.add_argument("--budget", type=float, default=0.5, help="seconds per size")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    opts = parser.parse_args()
    relaunch(opts.nproc, backend=opts.backend, timeout=1800)
    world = dist.init_process_group(timeout=120)
    n, rank = dist.get_world_size(), dist.get_rank()
    if dist.get_backend() == "mpi":
        variants = {"ring": (None, "ring"), "native": (None, "native")}
        ratio_name, ratio = "ring/native", ("native", "ring")  # > 1: ring is faster
    else:
        auth = world.transport.security.mode
        variants = {auth: (None, "ring"), "plain": (plain_tcp_group(world), "ring")}
        ratio_name, ratio = f"{auth}/plain", (auth, "plain")  # > 1: authentication costs
    names = list(variants)
    rows = []
    if rank == 0:
        print(f"all_reduce float32, {n} ranks, backend {dist.get_backend()}, medians")
        head = f"{'size':>9} " + " ".join(f"{a + ' us':>12} {a + ' algbw':>13} {'busbw':>7}"
                                          for a in names)
        print(head + f"  {ratio_name}")
    for nbytes in [s for s in SIZES if s <= opts.max_mib * 2**20]:
        t = measure(nbytes, variants, opts.budget)
        row = {"bytes": nbytes, "ranks": n, "backend": dist.get_backend()}
        cells = []
        for a in names:
            algbw = nbytes / t[a] / 1e9
            row[a] = {"seconds": t[a], "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n}
            cells.append(f"{t[a] * 1e6:12.1f} {algbw:10.2f} GB/s {row[a]['busbw_GBps']:7.2f}")
        row[ratio_name] = t[ratio[0]] / t[ratio[1]]
        cells.append(f"  {row[ratio_name]:6.2f}x")
        rows.append(row)
        if rank == 0:
            print(f"{nbytes / 2**20:8.3f}M " + " ".join(cells), flush=True)
    if rank == 0 and opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
