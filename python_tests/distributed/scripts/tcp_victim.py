"""A two-rank tcp job that a test attacks from outside (python_tests/.../test_tcp_security.py).

    tcp_victim.py DIR [flood]

Each rank writes its receive address to DIR/rank<k>.addr, then waits for DIR/go (the attack is
over). Then rank 0 sends [1, 2, 3, 4] to rank 1, which prints what it received, and both
all-reduce [rank + 1]. With "flood", rank 1 first waits until the flood has been dealt with.
Every rank prints its transport's counters and its peak memory (VmHWM) as JSON lines.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import needle.distributed as dist


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return -1.0


def wait_for(path: Path, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"victim: {path} never appeared")
        time.sleep(0.05)


out = Path(sys.argv[1])
flood = len(sys.argv) > 2 and sys.argv[2] == "flood"
pg = dist.init_process_group(backend="tcp", timeout=120)
rank, transport = dist.get_rank(), pg.transport
address = getattr(transport, "address", None) or transport.pull.getsockopt(32).decode()
(out / f"rank{rank}.addr.tmp").write_text(address)
os.replace(out / f"rank{rank}.addr.tmp", out / f"rank{rank}.addr")
print("BASELINE_MB", round(peak_rss_mb(), 1), flush=True)
wait_for(out / "go", 120)
if flood and rank == 1:  # let the receiver thread take in the whole flood first
    gone = getattr(transport.mailbox, "gone", None)
    end = time.monotonic() + 60
    while time.monotonic() < end and (gone is None or gone(0) is None):
        time.sleep(0.05)
x = np.array([1, 2, 3, 4], np.float32)
try:
    if rank == 0:
        dist.send(x, 1, timeout=30)
    else:
        got = np.zeros(4, np.float32)
        dist.recv(got, 0, timeout=30)
        print("RECV", got.tolist(), flush=True)
    total = np.array([rank + 1.0])
    dist.all_reduce(total, timeout=30)
    print("ALL_REDUCE", float(total[0]), flush=True)
except dist.CommError as exc:
    print("COMM_ERROR", exc, flush=True)
print("STATS", json.dumps(getattr(transport, "stats", {})), flush=True)
print("PEAK_MB", round(peak_rss_mb(), 1), flush=True)
