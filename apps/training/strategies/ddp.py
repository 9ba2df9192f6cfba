"""``--strategy ddp``: data parallelism with needle's ``DistributedDataParallel``.

Every rank holds the whole model; each computes its share of the global batch and DDP
all-reduces the gradients in buckets during backward, weighting every rank by its number of
examples, so a step equals the single-process step on the whole global batch.
"""
from __future__ import annotations

import numpy as np

from .base import StepResult, Strategy


class DataParallel(Strategy):
    """Data parallelism over a gradient-sync wrapper (a ``SyncedModule``): ``wrap`` is the
    flavour, DDP here, ZeRO in :class:`~.zero.Zero`; the step, the example weighting and the
    data split are the same for every flavour."""

    name = "ddp"

    @staticmethod
    def add_arguments(group) -> None:
        group.add_argument("--bucket-cap-mb", type=float, default=1.0,
                           help="gradient bucket size in MiB (ddp, zero)")

    @classmethod
    def validate(cls, cfg) -> None:
        from ..config import UsageError

        if cfg.nproc < 2:
            raise UsageError(f"--strategy {cfg.strategy} needs --nproc >= 2, got {cfg.nproc}")
        cls._validate_buckets(cfg)

    @staticmethod
    def _validate_buckets(cfg) -> None:
        from ..config import UsageError

        if cfg.extra.get("bucket_cap_mb", 1.0) <= 0:
            raise UsageError(f"--bucket-cap-mb must be positive, got "
                             f"{cfg.extra['bucket_cap_mb']}")

    @property
    def distributed(self) -> bool:
        return True

    def setup(self, ctx) -> None:
        from needle import nn

        self.ctx = ctx
        self.model = self._new_model(ctx)
        # the wrapper also broadcasts rank 0's parameters: every rank starts from them
        self.wrapper, self.optimizer = self.wrap(ctx)
        self.loss_fn = nn.SoftmaxLoss()

    def wrap(self, ctx):
        """(the gradient-sync wrapper of ``self.model``, the optimizer the loop steps)."""
        import needle.distributed as dist

        optimizer = ctx.new_optimizer(self.model.parameters())
        return dist.DistributedDataParallel(
            self.model, bucket_cap_mb=self.cfg.extra.get("bucket_cap_mb", 1.0)), optimizer

    def data_shard(self) -> tuple[int, int]:
        return self.world_size, self.rank

    def train_step(self, X: np.ndarray, y: np.ndarray) -> StepResult | None:
        self.wrapper.set_num_examples(int(y.shape[0]))
        local = self._local_step(X, y, forward=self.wrapper, after_backward=self._synced,
                                 no_sync=self.wrapper.no_sync)
        result = global_step_result(local, self.rank)
        if result is not None:
            self.denominators["global"] = result.examples
        return result

    def _synced(self) -> None:
        """After the backward: DDP installs the averaged gradients now (a sharded flavour
        finishes inside its optimizer's step)."""
        self.wrapper.finish_gradient_sync()
        from needle import memory

        # the averaged gradients DDP installs are this step's gradients: count them so
        for p in self.model.parameters():
            if p.grad is not None:
                memory.attribute(p.grad, "gradient")

    def evaluate(self, X, y):
        return self._local_evaluate(X, y) if self.rank == 0 else None

    def meters(self) -> list:
        """The default step's memory meter plus ``traffic``: this rank's communication
        ledger, predicted vs measured bytes per step (needle/distributed/traffic.py)."""
        from ..metrics import CommunicationLedger

        return [*super().meters(), CommunicationLedger(self.rank)]


def global_step_result(local: tuple[float, int, int], rank: int, root: int = 0):
    """Sum (loss_sum, correct, examples) over all ranks; the result on ``root``, else None."""
    import needle.distributed as dist

    totals = np.array(local, dtype=np.float64)
    with dist.traffic.label("step metrics"):
        dist.all_reduce(totals, op="sum")
    if rank != root:
        return None
    return StepResult(float(totals[0]), int(round(totals[1])), int(round(totals[2])))
