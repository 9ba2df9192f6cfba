"""Device meshes: groups along each axis, and a dp x tp x pp training step that equals the
serial step (thread ranks; real processes in test_pipeline_mp.py)."""
from __future__ import annotations

import pytest

import needle.distributed as dist

from . import _mesh_checks as checks

pytestmark = pytest.mark.timeout(300)


def test_groups_along_each_axis():
    def job(rank):
        mesh = dist.init_device_mesh((2, 2, 2))
        return (mesh.coordinate, mesh.get_group("dp").ranks, mesh.get_group("tp").ranks,
                mesh["pp"].ranks, mesh.size("tp"), mesh.local_rank("pp"))

    res = dist.spawn_threads(job, 8)
    # rank = (d * tp + t) * pp + s: rank 5 is d=1, t=0, s=1
    assert res[5] == ((1, 0, 1), [1, 5], [5, 7], [4, 5], 2, 1)
    assert res[0] == ((0, 0, 0), [0, 4], [0, 2], [0, 1], 2, 0)


def test_bad_meshes_are_refused():
    def job(rank):
        with pytest.raises(dist.CommError, match="expected sizes whose product is 4"):
            dist.init_device_mesh((2, 1, 1))
        with pytest.raises(dist.CommError, match="names are required"):
            dist.init_device_mesh((2, 2))
        mesh = dist.init_device_mesh((2, 2), names=("dp", "pp"))
        with pytest.raises(dist.CommError, match="unknown axis"):
            mesh.get_group("tp")
        return rank

    dist.spawn_threads(job, 4)


@pytest.mark.parametrize("shape", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2)])
def test_small_meshes_step_like_one_process(shape):
    world = shape[0] * shape[1] * shape[2]
    dist.spawn_threads(checks.check_mesh_step, world, world, shape)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_2x2x2_mesh_step_equals_the_serial_step(schedule):
    losses = dist.spawn_threads(checks.check_mesh_step, 8, 8, (2, 2, 2), schedule, 3,
                                timeout=240)
    assert len(set(losses)) == 1
