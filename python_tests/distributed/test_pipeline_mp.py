"""Pipeline, tensor and mesh parallelism on real processes through the launcher (mpi, tcp)."""
from __future__ import annotations

import pytest

from .test_multiprocess import launch

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _ok(out, mode: str, n: int, backend: str) -> None:
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    for rank in range(n):
        assert f"[rank {rank}] PIPELINE OK {mode} rank {rank} of {n} on {backend}" in out.stdout


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_every_schedule_equals_numpy_and_a_failing_stage_is_named(backend):
    out = launch(2, backend, "check_pipeline.py", "schedules", timeout=200)
    _ok(out, "schedules", 2, backend)
    assert "[rank 1] failure: raised" in out.stdout
    assert "[rank 0] failure: pipeline: stage 1 (rank 1) failed in F1.1" in out.stdout


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_1f1b_holds_fewer_activations_than_gpipe(backend):
    out = launch(2, backend, "check_pipeline.py", "memory", timeout=200)
    _ok(out, "memory", 2, backend)


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_tensor_parallel_layers_on_processes(backend):
    out = launch(2, backend, "check_pipeline.py", "tp", timeout=200)
    _ok(out, "tp", 2, backend)


@pytest.mark.slow
def test_mesh_step_on_four_processes():
    # 4 ranks oversubscribe 2 cores: slow but correct (tp x pp = 2 x 2)
    out = launch(4, "tcp", "check_pipeline.py", "mesh", "1", "2", "2", timeout=250)
    _ok(out, "mesh", 4, "tcp")


@pytest.mark.parametrize("backend", ["mpi", "tcp"])
@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_stages_that_gave_up_are_consequences_of_the_failed_rank(backend, mode):
    """The middle of three stages fails mid-step; its neighbours give up (an abort, or a lost
    connection). Whichever rank's report the launcher reads first, the headline names rank 1
    and the others are listed as failing because of it."""
    out = launch(3, backend, "pipeline_fault.py", mode, "1", timeout=120)
    lines = [x for x in out.stderr.splitlines() + out.stdout.splitlines()
             if x.startswith("launch: rank")]
    assert out.returncode == (1 if mode == "raise" else 137), out.stdout[-3000:] + out.stderr
    first = "raised ValueError: boom" if mode == "raise" else "killed by signal 9"
    assert lines[0].startswith(f"launch: rank 1 failed first: {first}"), lines
    if mode == "kill" and backend == "mpi":
        return  # mpiexec kills the other ranks at once: they never report
    why = "failed because peer rank 1 " + ("failed: PipelineAborted" if mode == "raise"
                                            else "is gone")
    for rank in (0, 2):
        assert any(x.startswith(f"launch: rank {rank} {why}") for x in lines), lines
