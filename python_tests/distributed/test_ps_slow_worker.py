"""Parameter server dead-worker detection with a slow but alive worker (thread ranks).

A worker that computes for several ``dead_after`` periods between its pull and its push,
while its heartbeat thread keeps beating, is never declared dead: the sync round waits for it
and averages both workers' gradients. (A silent worker, declared dead, is test_ps.py's.)
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import needle as ndl
import needle.distributed as dist

from .test_ps import LR, TARGETS, THETA0, Worker, _param

DEAD_AFTER = 1.0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_slower_than_dead_after_with_heartbeats_is_alive():
    def job(rank):
        p = _param()
        ps = dist.ParameterServer([p], servers=1, mode="sync", heartbeat=0.02,
                                  dead_after=DEAD_AFTER,
                                  optimizer=lambda ps_: ndl.optim.SGD(ps_, lr=LR))
        if ps.is_server:
            return ps.serve()
        me = Worker(ps, rank - 1, p)
        me.pull()
        if rank == 2:  # computes for 3 x dead_after; only its heartbeats reach the server
            time.sleep(3 * DEAD_AFTER)
        me.push()
        me.pull()
        ps.finish()
        return me.theta

    stats, theta0, theta1 = dist.spawn_threads(job, 3, timeout=60)
    assert stats["workers_lost"] == 0, stats["events"]
    assert stats["updates_applied"] == 1
    # one round with both gradients, each of 0.5 |theta - a_w|^2 at THETA0
    want = THETA0 - LR * ((THETA0 - TARGETS[0]) + (THETA0 - TARGETS[1])) / 2
    np.testing.assert_allclose(theta0, want, rtol=1e-12)
    np.testing.assert_allclose(theta1, want, rtol=1e-12)
