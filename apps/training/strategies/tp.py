"""``--strategy tp``: tensor parallelism over ``--nproc`` ranks.

Every ``Linear, [ReLU | Dropout | BatchNorm1d ...], Linear`` run of the model becomes a
column-parallel / row-parallel pair (one all-reduce forward, one backward), a remaining
``Linear`` whose width divides becomes column-parallel with gathered output, the rest is
replicated (``needle.distributed.tensor_parallel.parallelize_sequential``). Every rank sees
every batch. With ``--model mlp`` the losses equal ``--strategy single``'s; with dropout
between a pair, each rank draws the mask of its own features.
"""
from __future__ import annotations

from ._mesh import MeshStrategy


class TensorParallel(MeshStrategy):
    name = "tp"

    @classmethod
    def validate(cls, cfg) -> None:
        from ..config import UsageError

        if cfg.nproc < 2:
            raise UsageError(f"--strategy tp needs --nproc >= 2, got {cfg.nproc}")

    def mesh_shape(self) -> tuple[int, int, int]:
        return 1, self.world_size, 1
