"""``--strategy pipeline``: the model cut into ``--nproc`` stages, one per rank.

``--schedule gpipe|1f1b|interleaved|zero-bubble`` runs ``--microbatches M`` per step
(``--virtual-stages V`` chunks per rank with interleaved); the accumulated gradient is that
of the whole batch, so with ``--model mlp`` the losses equal ``--strategy single``'s. Models
with BatchNorm normalise each micro-batch with its own statistics (as a smaller batch would).
``summary.json`` gains a ``pipeline`` block: predicted vs measured bubble and peak activation
bytes per stage (see ``docs/pipeline.md``).
"""
from __future__ import annotations

from ._mesh import MeshStrategy, _add_pipeline_arguments, _check_pipeline_arguments


class Pipeline(MeshStrategy):
    name = "pipeline"

    @staticmethod
    def add_arguments(group) -> None:
        _add_pipeline_arguments(group)

    @classmethod
    def validate(cls, cfg) -> None:
        from ..config import UsageError

        if cfg.nproc < 2:
            raise UsageError(f"--strategy pipeline needs --nproc >= 2 (one stage per rank), "
                             f"got {cfg.nproc}")
        _check_pipeline_arguments(cfg, cfg.nproc)

    def mesh_shape(self) -> tuple[int, int, int]:
        return 1, 1, self.world_size
