"""Run by test_pipeline_mp.py on real processes: ``check_pipeline.py MODE [ARGS]``.

MODE schedules: every schedule's gradients equal NumPy's, a failing stage is named;
memory: 1F1B's measured activation peak on stage 0 is below GPipe's (m = 4 > p = 2);
tp: the worked example, sharded models and attention equal the unsharded ones;
mesh D T P: one SGD step on a D x T x P mesh equals the serial step.
"""
from __future__ import annotations

import os
import sys

import needle.autograd  # noqa: F401 - before needle.nn: works around a circular import

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from distributed import _mesh_checks, _pipeline_checks, _tp_checks  # noqa: E402

import needle.distributed as dist  # noqa: E402

dist.init_process_group(timeout=60)
rank, world = dist.get_rank(), dist.get_world_size()
mode = sys.argv[1]
if mode == "schedules":
    for name, m, v in (("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 5, 1), ("zero-bubble", 4, 1),
                       ("interleaved", 4, 2)):
        _pipeline_checks.check_schedule(rank, world, name, m, v)
    dist.barrier()
    print(f"failure: {_pipeline_checks.check_failing_stage(rank, world)[:200]}")
elif mode == "memory":
    peaks = _pipeline_checks.activation_peaks(rank, world)
    if rank == 0:
        gpipe = peaks["gpipe"].peak_activation_bytes["measured"]
        one = peaks["1f1b"].peak_activation_bytes["measured"]
        for report in peaks.values():
            print(report.text().replace("\n", " | "))
        assert one[0] < gpipe[0], (one, gpipe)
        # the simulator fed the measured per-micro-batch bytes predicts the peaks it measures
        for report in peaks.values():
            for got, want in zip(report.peak_activation_bytes["measured"],
                                 report.peak_activation_bytes["predicted"], strict=True):
                assert abs(got - want) <= 0.25 * got, (got, want)
elif mode == "tp":
    _tp_checks.check_worked_example(rank, world)
    _tp_checks.check_parallel_sequential(rank, world)
    _tp_checks.check_attention(rank, world, causal=True, cross=False)
elif mode == "mesh":
    shape = tuple(int(x) for x in sys.argv[2:5])
    _mesh_checks.check_mesh_step(rank, world, shape)
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"PIPELINE OK {mode} rank {rank} of {world} on {dist.get_backend()}")
