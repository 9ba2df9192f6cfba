"""apps/train.py with a stopwatch around each optimizer step (for bench_time_model.py).

    NEEDLE_STEP_TIMES=times.json python bench/_timed_train.py --strategy ddp --nproc 2 ...

Runs apps/train.py's ``main`` unchanged (the launcher re-runs this file on every rank), and
rank 0 writes the wall time of every ``strategy.train_step`` call to ``$NEEDLE_STEP_TIMES``.
"""
from __future__ import annotations

import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "apps"))
sys.path.insert(0, _ROOT)

import train  # noqa: E402

_run = train.run


def _timed_run(cfg, strategy, rank: int = 0, world_size: int = 1):
    times: list[float] = []
    step = strategy.train_step

    def timed(X, y):
        start = time.perf_counter()
        result = step(X, y)
        times.append(time.perf_counter() - start)
        return result

    strategy.train_step = timed
    try:
        return _run(cfg, strategy, rank, world_size)
    finally:
        path = os.environ.get("NEEDLE_STEP_TIMES")
        if rank == 0 and path:
            with open(path, "w") as f:
                json.dump(times, f)


train.run = _timed_run

if __name__ == "__main__":
    sys.exit(train.main())
