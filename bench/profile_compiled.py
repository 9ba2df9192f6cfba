"""Where a compiled training step's time goes: each kernel of the replay, timed from C++.

A compiled step on ``cpu()`` replays a ``_KernelList`` (src/kernel_list_py.h); with profiling
on it times every step of the list. This prints the total per label (kernel kind, op code,
matmul shape and strides, or the Python function a step calls), largest first, beside the
whole step's wall time: the difference is the Python around the replay (binding arguments,
installing results). The workloads are ``bench_training.py``'s.

Run: ``python bench/profile_compiled.py --workload mlp --steps 200``
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_training  # noqa: E402  (loads PyTorch first, as the training bench does)


def profile(workload: str, steps: int) -> tuple[list, float, float]:
    """(label, microseconds per step, count) rows, kernel-list µs and wall µs per step."""
    import needle as ndl

    step, _ = bench_training.needle_step_fn(workload, ndl.cpu(), compiled=True)
    for _ in range(5):
        step()
    modes = step.compiled.replay_modes()
    if not modes or modes[0].get("runner") != "C++":
        raise SystemExit(f"profile_compiled: the {workload} step does not replay from C++: "
                         f"{modes}")
    (entry,) = step.compiled._cache.values()
    kernel_list = entry.program.native
    totals: dict = collections.defaultdict(lambda: [0, 0])
    kernel_list.set_profile(True)
    try:
        for _ in range(steps):
            step()
            for label, ns in kernel_list.timings():
                totals[label][0] += ns
                totals[label][1] += 1
    finally:
        kernel_list.set_profile(False)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - start) / steps * 1e6
    rows = sorted(((label, ns / steps / 1e3, n // steps) for label, (ns, n) in totals.items()),
                  key=lambda row: -row[1])
    return rows, sum(r[1] for r in rows), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp", choices=["mlp", "resnet9", "lstm"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows, kernels, wall = profile(args.workload, args.steps)
    print(f"{args.workload}: {wall:.0f} us per compiled step (unprofiled), "
          f"{kernels:.0f} us in the kernel list (profiled), {len(rows)} labels")
    print(f"{'us/step':>9} {'share':>6} {'count':>5}  label")
    for label, us, count in rows[:args.top]:
        print(f"{us:9.1f} {us / kernels:6.1%} {count:5d}  {label}")


if __name__ == "__main__":
    main()
