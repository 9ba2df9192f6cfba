"""``--strategy zero``: data parallelism with ZeRO (``needle.distributed.ZeroDataParallel``).

Every rank computes its share of the global batch, as with ddp; ``--zero-stage 1|2|3`` says
what each rank keeps only its 1/N share of: the optimizer state and master weights (1), also
the gradients (2), also the weights (3, gathered per layer around its forward and backward).
A step equals the ddp step on the same data. ``summary.json`` gains ``zero`` (stage, traffic
per step predicted and measured beside ddp's) and every rank's model-state bytes in
``memory``. Checkpoints hold each rank's pieces; ``--resume`` at another ``--nproc`` reshards.
"""
from __future__ import annotations

from .base import Strategy, gathered_state_digest
from .ddp import DataParallel


class Zero(DataParallel):
    """ddp's step with the ZeRO flavour of gradient-sync wrapper (see the module doc)."""

    name = "zero"
    can_reshard = True

    @staticmethod
    def add_arguments(group) -> None:
        group.add_argument("--zero-stage", type=int, default=2,
                           help="what is sharded: 1 optimizer state, 2 also gradients, "
                                "3 also weights (bucket size: --bucket-cap-mb)")

    @classmethod
    def validate(cls, cfg) -> None:
        from ..config import UsageError

        stage = cfg.extra.get("zero_stage", 2)
        if stage not in (1, 2, 3):
            raise UsageError(f"--zero-stage must be 1, 2 or 3, got {stage}")
        if stage == 3 and cfg.check_replicas:
            raise UsageError("--check-replicas compares replicated state, and --zero-stage 3 "
                             "shards all of it (weights, gradients, optimizer state)")
        cls._validate_buckets(cfg)

    @property
    def stage(self) -> int:
        return int(self.cfg.extra.get("zero_stage", 2))

    @property
    def zero(self):
        return self.wrapper

    def wrap(self, ctx):
        import needle.distributed as dist

        self.traffic = None  # the metrics' counter of bytes sent (meters)
        # also broadcasts rank 0's parameters before sharding them; the optimizer is built
        # over this rank's shards only
        zero = dist.ZeroDataParallel(
            self.model, optimizer=ctx.new_optimizer, stage=self.stage,
            bucket_cap_mb=self.cfg.extra.get("bucket_cap_mb", 1.0))
        return zero, zero.optimizer

    def meters(self) -> list:
        """The default step's memory meter, and the bytes this rank's ZeRO collectives send
        per step (read by :meth:`summary_blocks`)."""
        from ..metrics import CounterRate

        self.traffic = CounterRate(lambda: self.zero.bytes_sent)
        return [*Strategy.meters(self), self.traffic]

    def memory_probe(self):
        state = super().memory_probe()
        return None if state is None else state._replace(zero_stage=self.stage)

    def _synced(self) -> None:
        """Nothing after the backward: the reduce-scatter finishes inside the step."""

    def clip_gradients(self, max_norm: float) -> float:
        # each rank holds only its pieces of the reduced gradients: their squared sums are
        # added over the ranks (collective), so every rank clips by the whole model's norm
        return self.zero.clip_grad_norm(max_norm)

    def replicated_state(self) -> tuple[list, list[str], str | None]:
        from ..debugging import named_arrays

        # stages 1-2 republish every whole weight from its owner's piece at each step, so a
        # corrupted copy on another rank lasts until the next step: a check catches it only
        # in that window (--check-replicas 1 sees every one)
        tensors = [(e.name, e.param.numpy()) for e in self.zero.entries]
        return (tensors + named_arrays(self.scaler.state_dict(), "scaler"),
                ["parameters", "loss scaler"], "optimizer state and master weights (each rank "
                "holds its own shard of them)")

    def evaluate(self, X, y):
        # collective in stage 3 (each module's weights are gathered): every rank evaluates
        out = self._local_evaluate(X, y)
        return out if self.rank == 0 else None

    def model_state(self) -> dict | None:
        """Rank 0's model: parameters gathered from every rank's shard (collective in stage
        3), buffers (BatchNorm statistics) its own, as under ddp."""
        from ..model_state import named_state

        params = self.zero.full_parameters()  # collective in stage 3
        return named_state(self.model, params) if self.rank == 0 else None

    def summary_blocks(self) -> dict:
        blocks = super().summary_blocks()
        predicted = self.zero.predicted_traffic(int(getattr(self.cfg, "accumulate", 1)))
        blocks["zero"] = {
            "stage": self.stage, "world_size": self.world_size,
            "bucket_cap_mb": self.cfg.extra.get("bucket_cap_mb", 1.0),
            "traffic_bytes_per_step": {
                "predicted": predicted["total"],
                "measured": self.traffic.per_step() if self.traffic is not None else None,
                "reduce_scatter": predicted["reduce_scatter"],
                "all_gather": predicted["all_gather"],
                "ddp_all_reduce": predicted["ddp_all_reduce"],
                "ratio_to_ddp": predicted["total"] / max(predicted["ddp_all_reduce"], 1)},
            "note": "bytes rank 0 sends per step; ring: every segment but one per collective"}
        return blocks

    # ---- checkpoints ---------------------------------------------------------------------
    def _buffers(self) -> dict:
        params = {id(p) for p in self.model.parameters()}
        return {name: t.numpy() for name, t in self.model.named_tensors()
                if id(t) not in params}

    def state_dict(self) -> dict:
        """This rank's pieces (weights, moments, master weights), its own buffers (BatchNorm
        statistics) and the scaler."""
        return {"zero": self.zero.state_dict(), "buffers": self._buffers(),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.load_sharded_state([state], state)

    def load_sharded_state(self, states: list[dict], mine: dict) -> None:
        """Restore from every rank's state of a saved run (any number of ranks): the pieces
        of all of them, the buffers and scaler of ``mine`` (this rank's, or the rank it
        continues)."""
        self.zero.load_state_dict([s["zero"] for s in states])
        self.model.load_state_dict(mine["buffers"], strict=False)
        self.scaler.load_state_dict(mine["scaler"])

    def state_sha256(self) -> str | None:
        return gathered_state_digest(self.state_dict(), self.rank)
