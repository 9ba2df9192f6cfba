"""What the model-parallel strategies share: a dp x tp x pp mesh of ranks and one step.

The model is built whole on every rank from ``--seed`` (so every rank agrees on it), cut
into ``pp x v`` pipeline chunks (``needle.distributed.pipeline.split_sequential``), each
chunk sharded over the tensor-parallel group (``tensor_parallel.parallelize_sequential``);
data-parallel replicas average their gradients, weighted by their number of examples.
With ``pp == 1`` a step is a plain forward/backward of the (sharded) model; otherwise the
pipeline runtime runs the chosen schedule over ``--microbatches``.

The reporting rank is world rank 0, the mesh's (0, 0, 0): sums over the step reach it with
one all-reduce in which only the ranks of the last pipeline stage with tensor-parallel rank 0
take part (every tensor-parallel rank computes the same loss).
"""
from __future__ import annotations

import numpy as np

from .. import trace
from .base import StepResult, Strategy, gathered_state_digest


def _add_pipeline_arguments(group) -> None:
    group.add_argument("--microbatches", type=int, default=4,
                       help="micro-batches per step (pipeline, 3d)")
    group.add_argument("--schedule", default="1f1b",
                       help="gpipe, 1f1b, interleaved or zero-bubble (pipeline, 3d)")
    group.add_argument("--virtual-stages", type=int, default=2,
                       help="model chunks per rank with --schedule interleaved")
    group.add_argument("--balance", default="params",
                       help="how layers are cut into stages: params (parameter counts) or "
                            "measure (time each layer on rank 0)")
    group.add_argument("--layers-per-stage", default=None, metavar="N,N,...",
                       help="cut the model into stages (chunks) of these many layers "
                            "instead of --balance")


def _check_pipeline_arguments(cfg, pp: int) -> None:
    from needle.distributed.pipeline import SCHEDULES

    from ..config import UsageError, layers_per_stage

    extra = cfg.extra
    schedule = extra.get("schedule", "1f1b")
    if schedule not in SCHEDULES:
        raise UsageError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    m = extra.get("microbatches", 4)
    if m < 1:
        raise UsageError(f"--microbatches must be positive, got {m}")
    if cfg.batch_size < m:
        raise UsageError(f"--batch-size {cfg.batch_size} is smaller than --microbatches {m}")
    if extra.get("balance", "params") not in ("params", "measure"):
        raise UsageError(f"--balance must be params or measure, got {extra['balance']!r}")
    v = extra.get("virtual_stages", 2)
    counts = layers_per_stage(cfg.extra.get("layers_per_stage"))
    chunks = pp * (v if schedule == "interleaved" else 1)
    if counts is not None and len(counts) != chunks:
        raise UsageError(f"--layers-per-stage needs one count per stage ({chunks}), got "
                         f"{extra['layers_per_stage']!r}")
    if schedule == "interleaved" and (v < 1 or m % pp):
        raise UsageError(f"--schedule interleaved needs --virtual-stages >= 1 and "
                         f"--microbatches a multiple of the {pp} pipeline stages, got "
                         f"--virtual-stages {v} --microbatches {m}")


class MeshStrategy(Strategy):
    """A strategy over a (dp, tp, pp) mesh; subclasses say which shape."""

    distributed_min = 2
    mixed_precision_and_accumulation = False  # micro-batches are the pipeline's own

    def mesh_shape(self) -> tuple[int, int, int]:
        raise NotImplementedError

    @property
    def distributed(self) -> bool:
        return True

    # ---- setup ---------------------------------------------------------------------------
    def setup(self, ctx) -> None:
        import needle.distributed as dist
        from needle import memory, nn
        from needle.distributed import pipeline, tensor_parallel

        self.ctx = ctx
        self.dp, self.tp, self.pp = self.mesh_shape()
        self.mesh = dist.init_device_mesh((self.dp, self.tp, self.pp))
        self.loss_fn = nn.SoftmaxLoss()
        memory.stats(ctx.device)  # attribute memory by category from the first buffer on
        full = ctx.new_model()
        extra = self.cfg.extra
        self.schedule_name = extra.get("schedule", "1f1b") if self.pp > 1 else None
        v = extra.get("virtual_stages", 2) if self.schedule_name == "interleaved" else 1
        chunks = self.pp * v
        from ..config import UsageError, layers_per_stage

        counts = layers_per_stage(extra.get("layers_per_stage"))
        if counts is not None and sum(counts) != len(full.modules):
            raise UsageError(f"--layers-per-stage {extra['layers_per_stage']} covers "
                             f"{sum(counts)} layers, expected the {len(full.modules)} layers "
                             f"of --model {self.cfg.model}")
        if counts is not None and chunks > 1:
            bounds = np.cumsum([0, *counts]).tolist()
            pieces = [nn.Sequential(*full.modules[a:b])
                      for a, b in zip(bounds, bounds[1:], strict=False)]
        else:
            pieces = pipeline.split_sequential(full, chunks, self._layer_costs(full)) \
                if chunks > 1 else [full]
        s = self.mesh.local_rank("pp")
        self.my_chunks = list(range(s, chunks, self.pp))
        tp_group = self.mesh.get_group("tp")
        self.modules = {k: tensor_parallel.parallelize_sequential(pieces[k], tp_group)
                        if self.tp > 1 else pieces[k] for k in self.my_chunks}
        # what names the whole model's state, kept without the unsharded model itself (other
        # stages' layers and the unsharded copies would stay allocated on this rank)
        self.skeleton = [(name, tuple(t.shape), str(t.dtype)) for name, t in full.named_tensors()]
        self.chunk_names = {k: _chunk_names(full, pieces[k], self.modules[k])
                            for k in self.my_chunks}
        self.layers_per_stage = [len(piece.modules) for piece in pieces]
        self.has_batchnorm = any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))
                                 for m in full._children())
        params = [p for k in self.my_chunks for p in self.modules[k].parameters()]
        self.optimizer = ctx.new_optimizer(params)
        self.schedule = None
        del full, pieces  # the rank now holds its own chunks only
        if self.pp > 1:
            stages = [pipeline.PipelineStage(self.modules[k], k, chunks,
                                             group=self.mesh.get_group("pp"), device=ctx.device)
                      for k in self.my_chunks]
            cls = pipeline.schedule_class(self.schedule_name)
            self.schedule = cls(stages if v > 1 else stages[0], extra.get("microbatches", 4),
                                loss_fn=self.loss_fn, record=True)
        self._report = None

    def _layer_costs(self, full):
        """Per-layer costs for cutting the model, identical on every rank."""
        from needle.distributed import broadcast, pipeline

        layers = list(full.modules)
        if self.cfg.extra.get("balance", "params") == "params":
            return pipeline.parameter_costs(layers)
        costs = np.zeros(len(layers), np.float64)
        if self.rank == 0:
            from needle.autograd import Tensor

            sample = np.random.RandomState(0).rand(self.cfg.batch_size, self.ctx.in_features)
            costs[:] = pipeline.measure_costs(
                layers, Tensor(sample.astype(np.float32), device=self.ctx.device))
        broadcast(costs, src=0)  # timings differ between ranks: use rank 0's everywhere
        return costs.tolist()

    # ---- roles ---------------------------------------------------------------------------
    def data_shard(self) -> tuple[int, int]:
        return self.dp, self.mesh.local_rank("dp")

    @property
    def _counts_loss(self) -> bool:
        """Whether this rank's loss enters the step's sums (one rank per replica does)."""
        last = self.pp == 1 or self.mesh.local_rank("pp") == self.pp - 1
        return last and self.mesh.local_rank("tp") == 0

    def _train(self, mode: bool) -> None:
        for module in self.modules.values():
            module.train(mode)

    # ---- a step --------------------------------------------------------------------------
    def train_step(self, X: np.ndarray, y: np.ndarray) -> StepResult | None:
        self._train(True)
        self.optimizer.reset_grad()
        loss, logits = self._forward_backward(X, y)
        if self.dp > 1:
            self._average_gradients(len(y))
        with trace.span("optimizer", "compute"):
            if getattr(self.cfg, "clip_grad", None) is not None:
                self.clip_gradients(self.cfg.clip_grad)
            self.optimizer.step()
        local = (0.0, 0, 0)
        if self._counts_loss:
            correct = int((logits.argmax(axis=1) == y.astype(np.int64)).sum())
            local = (loss * len(y), correct, len(y))
        return self._sum_to_reporter(local)

    def _forward_backward(self, X, y):
        from needle.autograd import Tensor

        if self.schedule is not None:
            loss = self.schedule.step(X, y)
            logits = np.concatenate([o.numpy() for o in self.schedule.outputs]) \
                if self.schedule.outputs else None
            return loss, logits
        device = self.ctx.device
        model = self.modules[0]
        out = model(Tensor(X, device=device, requires_grad=False))
        loss = self.loss_fn(out, Tensor(y, device=device, requires_grad=False))
        loss.backward()
        return float(loss.numpy()), out.numpy()

    def clip_gradients(self, max_norm: float) -> float:
        """Clip by the whole model's norm: squared sums added over the tp group (shards; the
        replicated parameters counted by tp rank 0) and the pp group (other stages' layers);
        the dp replicas hold the same averaged gradients, so dp is left out."""
        import needle.distributed as dist
        from needle.distributed import tensor_parallel

        tp = self.mesh.get_group("tp")
        replicated = [p for k in self.my_chunks
                      for p in tensor_parallel.replicated_parameters(self.modules[k])]
        return dist.clip_grad_norm(self.optimizer.params, max_norm,
                                   group=[tp, self.mesh.get_group("pp")],
                                   replicated=replicated, replicated_group=tp)

    def _average_gradients(self, n_local: int) -> None:
        """Data parallelism: g = sum_r n_r g_r / sum_r n_r over the dp group."""
        from needle.distributed.mesh import average_gradients

        average_gradients(self.optimizer.params, self.mesh.get_group("dp"), n_local)

    def _sum_to_reporter(self, local) -> StepResult | None:
        import needle.distributed as dist

        totals = np.array(local, dtype=np.float64)
        dist.all_reduce(totals)
        if self.rank != 0:
            return None
        return StepResult(float(totals[0]), int(round(totals[1])), int(round(totals[2])))

    # ---- evaluation and outputs ----------------------------------------------------------
    def evaluate(self, X: np.ndarray, y: np.ndarray):
        import needle.distributed as dist
        from needle.autograd import Tensor, no_grad

        self._train(False)
        if self.schedule is not None:
            logits = self.schedule.forward(X)
        else:
            with no_grad():
                logits = self.modules[0](Tensor(X, device=self.ctx.device,
                                                requires_grad=False)).numpy()
        sums = np.zeros(2)
        if self._counts_loss and self.mesh.local_rank("dp") == 0:
            with no_grad():
                loss = self.loss_fn(Tensor(logits, device=self.ctx.device),
                                    Tensor(y, device=self.ctx.device, requires_grad=False))
            sums[:] = (float(loss.numpy()), float((logits.argmax(axis=1) == y).mean()))
        dist.all_reduce(sums)
        return (float(sums[0]), float(sums[1])) if self.rank == 0 else None

    @property
    def template(self):
        """A fresh unsharded model (on the reporting rank, to name the gathered state): built
        under ``fork_rng`` so that no random stream moves."""
        import needle as ndl

        with ndl.random.fork_rng():
            return self.ctx.new_model()

    def model_state(self) -> dict | None:
        """The whole model on rank 0 (collective): every chunk with its tensor-parallel shards
        gathered (parameters and sharded BatchNorm statistics), then one all-reduce of a flat
        vector of every tensor that one rank per chunk fills (data-parallel replica 0,
        tensor-parallel rank 0: a replica's buffers are its own, and replica 0's are the
        model, as under ddp)."""
        import needle.distributed as dist

        named = self.skeleton
        sizes = [int(np.prod(shape)) for _, shape, _ in named]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        where = {name: i for i, (name, _, _) in enumerate(named)}
        flat = np.zeros(int(starts[-1]), np.float64)
        fills = self.mesh.local_rank("dp") == 0 and self.mesh.local_rank("tp") == 0
        for k in self.my_chunks:
            values = self._chunk_state(k)  # collective over the tensor-parallel group
            if fills:
                for key, array in values.items():
                    i = where[key]
                    flat[starts[i]:starts[i + 1]] = np.asarray(array, np.float64).ravel()
        dist.all_reduce(flat)
        if self.schedule is not None and self.mesh.local_rank("dp") == 0 \
                and self.mesh.local_rank("tp") == 0:
            self._report = self.schedule.report(root=0)
        if self.rank != 0:
            return None
        return {name: flat[starts[i]:starts[i + 1]].reshape(shape).astype(dtype)
                for i, (name, shape, dtype) in enumerate(named)}

    def _chunk_state(self, k: int) -> dict[str, np.ndarray]:
        """Chunk ``k``'s full values by the unsharded model's names (collective over the
        tensor-parallel group when it is sharded)."""
        from needle.distributed import tensor_parallel

        names = self.chunk_names[k]
        values = {name: t.numpy() for t, name in names["kept"]}
        if self.tp == 1:
            return values
        full = tensor_parallel.gather_full_parameters(self.modules[k])
        values.update(zip(names["parameters"], full, strict=True))
        for sharded, prefix in names["batchnorms"]:
            for buffer in ("running_mean", "running_var"):
                values[f"{prefix}{buffer}"] = tensor_parallel.gather_shards(
                    getattr(sharded, buffer), 0, sharded.group)
        return values

    def meters(self) -> list:
        """``memory``: this rank's model state (its chunks' weights, gradients and optimizer
        state) beside the ledger's prediction for those chunks, measured once at the end;
        ``traffic``: this rank's communication ledger, predicted vs measured bytes."""
        from ..metrics import CommunicationLedger, ModelStateMemory, PeakMemory

        return [ModelStateMemory(self.memory_probe, self.rank, self.world_size,
                                 when="after the last step and evaluation", at_end=True,
                                 peak=PeakMemory(self.predict_peak, self.ctx.device)),
                CommunicationLedger(self.rank)]

    def predict_peak(self, X: np.ndarray, y: np.ndarray, first: bool) -> dict:
        """This rank's peak of the step on ``X, y`` (``apps/training/peak.py``)."""
        from .. import peak

        if self.dp > 1:
            return peak.unpredicted("data-parallel replicas of a mesh (3d --dp > 1): their "
                                    "gradient averaging is not modelled")
        if self.pp > 1:
            return peak.predict_pipeline(self, X, y, first)
        return peak.predict_tensor_parallel(self, X, y, first)

    def memory_probe(self):
        """This rank's chunks as one model (read at the end of the run)."""
        import gc

        from needle import nn

        from ..metrics import ModelState

        gc.collect()  # the unsharded model built at set-up is garbage by now
        chunks = nn.Sequential(*[self.modules[k] for k in self.my_chunks])
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return ModelState(self.ctx.device, chunks, inner, 0)

    def summary_blocks(self) -> dict:
        """``mesh`` and, with pipeline stages, ``pipeline`` (``memory`` and ``traffic`` are
        the metrics')."""
        blocks = {"mesh": {"dp": self.dp, "tp": self.tp, "pp": self.pp,
                           "layers_per_stage": self.layers_per_stage}}
        if self._report is not None:
            block = self._report.as_dict()
            block["batchnorm_per_microbatch"] = self.has_batchnorm
            blocks["pipeline"] = block
        return blocks

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's chunks (its tensor-parallel shards) and its optimizer's state."""
        return {"modules": {str(k): self.modules[k].state_dict() for k in self.my_chunks},
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for k in self.my_chunks:
            self.modules[k].load_state_dict(state["modules"][str(k)])
        self.optimizer.load_state_dict(state["optimizer"])

    def state_sha256(self) -> str | None:
        return gathered_state_digest(self.state_dict(), self.rank)


def _chunk_names(full, piece, module) -> dict:
    """How chunk ``module`` (``piece`` of ``full``, tensor-parallel or not) maps onto the
    unsharded model's names: ``kept`` (its tensors that are the unsharded ones, with their
    names), ``parameters`` (the names of ``piece.parameters()``, the order the gathered
    full parameters come in) and ``batchnorms`` (each sharded BatchNorm with the name prefix
    of its unsharded statistics)."""
    name_of = {id(t): name for name, t in full.named_tensors()}
    kept = [(t, name_of[id(t)]) for _, t in module.named_tensors() if id(t) in name_of]
    params = [name_of[id(p)] for p in piece.parameters()]
    batchnorms = [(sharded, name_of[id(original.running_mean)][:-len("running_mean")])
                  for original, sharded in _sharded_batchnorms(piece, module)]
    return {"kept": kept, "parameters": params, "batchnorms": batchnorms}


def _sharded_batchnorms(original, converted):
    """``(unsharded BatchNorm1d, its ShardedBatchNorm1d)`` pairs of a model and its
    tensor-parallel copy (``parallelize_sequential`` keeps the tree's shape)."""
    from needle import nn
    from needle.distributed import tensor_parallel

    if isinstance(converted, tensor_parallel.ShardedBatchNorm1d):
        yield original, converted
    elif isinstance(original, nn.Sequential):
        for a, b in zip(original.modules, converted.modules, strict=True):
            yield from _sharded_batchnorms(a, b)
    elif isinstance(original, nn.Residual):
        yield from _sharded_batchnorms(original.fn, converted.fn)
