"""All-reduce of float32 from 4 KiB to 256 MiB: needle's pipelined ring vs the transport's native
collective (MPICH MPI_Iallreduce through mpi4py), time, algbw, busbw and their ratio.

    python bench/bench_collectives.py --nproc 2 --backend mpi     # also: --backend tcp, --nproc 4

Starts itself on ``--nproc`` ranks through needle's launcher. ring and native alternate at each
size (same buffers, same run); each entry is the median of repeats. busbw = algbw * 2(n-1)/n,
the per-rank link traffic of a bandwidth-optimal all-reduce.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import needle.distributed as dist  # noqa: E402
from needle.distributed.launch import relaunch  # noqa: E402

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def time_one(x: np.ndarray, algorithm: str) -> float:
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(x, algorithm=algorithm)
    elapsed = np.array([time.perf_counter() - start])
    dist.all_reduce(elapsed, op="max")  # the collective is as slow as its slowest rank
    return float(elapsed[0])


def measure(nbytes: int, algorithms: list[str], budget: float) -> dict[str, float]:
    x = np.ones(nbytes // 4, np.float32)
    for algorithm in algorithms:  # warm-up: page faults, connections, scratch buffers
        time_one(x, algorithm)
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
            samples[algorithm].append(time_one(x, algorithm))
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
    dist.init_process_group(timeout=120)
    n, rank = dist.get_world_size(), dist.get_rank()
    algorithms = ["ring", "native"] if dist.get_backend() == "mpi" else ["ring"]
    rows = []
    if rank == 0:
        print(f"all_reduce float32, {n} ranks, backend {dist.get_backend()}, medians")
        head = f"{'size':>9} " + " ".join(f"{a + ' us':>11} {a + ' algbw':>12} {'busbw':>7}"
                                          for a in algorithms)
        print(head + ("  ring/native" if len(algorithms) > 1 else ""))
    for nbytes in [s for s in SIZES if s <= opts.max_mib * 2**20]:
        t = measure(nbytes, algorithms, opts.budget)
        row = {"bytes": nbytes, "ranks": n, "backend": dist.get_backend()}
        cells = []
        for a in algorithms:
            algbw = nbytes / t[a] / 1e9
            row[a] = {"seconds": t[a], "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n}
            cells.append(f"{t[a] * 1e6:11.1f} {algbw:9.2f} GB/s {row[a]['busbw_GBps']:7.2f}")
        if len(algorithms) > 1:
            row["ring_speedup_vs_native"] = t["native"] / t["ring"]
            cells.append(f"  {row['ring_speedup_vs_native']:6.2f}x")
        rows.append(row)
        if rank == 0:
            print(f"{nbytes / 2**20:8.3f}M " + " ".join(cells), flush=True)
    if rank == 0 and opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
