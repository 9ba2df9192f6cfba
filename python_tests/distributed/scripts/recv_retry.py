"""A recv that timed out in the middle of a message, then called again, gets that message.

Rank 0 sends the header of ``send(values, 1)`` at once and its payload 6 s later (through the
point-to-point channel, as ``send`` would). Rank 1's first ``recv`` (timeout 2 s) times out
waiting for the payload; its second ``recv`` (timeout 30 s) must complete with the values,
long before rank 0 leaves (rank 0 waits for rank 1's reply first).
"""
from __future__ import annotations

import time

import numpy as np

import needle.distributed as dist
from needle.distributed._buffers import pack_header

pg = dist.init_process_group(timeout=60)
values = np.arange(6, dtype=np.float32)
if dist.get_rank() == 0:
    pg.p2p.isend(pack_header(values, "send"), 1, 0).wait(time.monotonic() + 30)
    time.sleep(6.0)
    pg.p2p.isend(values, 1, 1).wait(time.monotonic() + 30)
    reply = np.zeros(1, np.float32)
    dist.recv(reply, 1, tag=1, timeout=30)
    print("REPLY", float(reply[0]), flush=True)
else:
    got = np.zeros(6, np.float32)
    start = time.monotonic()
    try:
        dist.recv(got, 0, timeout=2)
        print("FIRST completed", flush=True)
    except dist.CommError as exc:
        print("FIRST", type(exc).__name__, exc, flush=True)
    dist.recv(got, 0, timeout=30)
    print("SECOND", got.tolist(), round(time.monotonic() - start, 1), flush=True)
    dist.send(np.ones(1, np.float32), 0, tag=1)
dist.destroy_process_group()
