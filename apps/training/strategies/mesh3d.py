"""``--strategy 3d --dp D --tp T --pp P``: data x tensor x pipeline parallelism on D·T·P ranks.

Ranks form a (D, T, P) mesh (``needle.distributed.init_device_mesh``; rank = (d·T + t)·P + s).
Each data-parallel replica reads its share of every global batch; inside a replica the model
is cut into P pipeline stages (``--schedule``, ``--microbatches``), each stage sharded over T
tensor-parallel ranks; replicas average gradients weighted by their examples. ``--nproc``
defaults to D·T·P (it must equal it when given).
"""
from __future__ import annotations

from ._mesh import MeshStrategy, _check_pipeline_arguments


class Mesh3D(MeshStrategy):
    name = "3d"

    @staticmethod
    def add_arguments(group) -> None:
        for axis, what in (("dp", "data-parallel replicas"), ("tp", "tensor-parallel ranks"),
                           ("pp", "pipeline stages")):
            group.add_argument(f"--{axis}", type=int, default=1, help=f"{what} (--strategy 3d)")

    @classmethod
    def validate(cls, cfg) -> None:
        from ..config import UsageError

        dp, tp, pp = (cfg.extra.get(a, 1) for a in ("dp", "tp", "pp"))
        if min(dp, tp, pp) < 1:
            raise UsageError(f"--dp, --tp and --pp must be positive, got {dp}, {tp}, {pp}")
        if cfg.nproc == 1:
            cfg.nproc = dp * tp * pp  # --nproc left at its default: start the whole mesh
        if cfg.nproc != dp * tp * pp or cfg.nproc < 2:
            n = cfg.nproc
            hint = (f"with --nproc {n} set one of --dp {n}, --tp {n}, --pp {n}, or a product "
                    f"of them equal to {n}" if n >= 2 else "set --nproc 2 or more")
            raise UsageError(f"--strategy 3d needs --nproc = dp x tp x pp >= 2, expected "
                             f"{dp * tp * pp}, got --nproc {n}: {hint}")
        _check_pipeline_arguments(cfg, pp)

    def mesh_shape(self) -> tuple[int, int, int]:
        extra = self.cfg.extra
        return extra.get("dp", 1), extra.get("tp", 1), extra.get("pp", 1)
