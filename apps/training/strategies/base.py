"""What every training strategy provides, with the single-process behaviour as the default.

The loop (``apps/training/loop.py``) calls, on every rank: ``setup`` once, ``data_shard``,
``meters`` (what ``apps/training/metrics.py`` measures around the steps), ``train_step`` once
per optimizer step with this replica's share of the global batch, ``evaluate`` after each
epoch, ``model_state``, ``collect_reports`` and (on the reporting rank) ``summary_blocks``
at the end. Methods that are collective in a strategy
(evaluation of a sharded model, say) are called on every rank in the same order, so a
strategy may communicate inside any of them.

The default step (single, ddp, zero) also does mixed precision (``--precision fp16-mixed``:
float16 parameters, ``amp.autocast``, a ``GradScaler``, float32 master weights in the
optimizer) and gradient accumulation (``--accumulate G``: the replica's share is cut into G
micro-batches whose sizes may differ by one; micro-batch i's mean loss is weighted by
``n_i / n`` so the accumulated gradient is the replica's mean gradient, and data-parallel
ranks are then weighted by their ``n`` over the global batch). It records the denominators;
the model-state bytes beside the ledger's prediction are the metrics' (``meters``), read
between steps, so the step itself measures nothing.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from .. import trace


@dataclass
class StepResult:
    """One optimizer step as the reporting rank sees it (sums over the whole global batch)."""

    loss_sum: float  # sum over the examples of the per-example loss
    correct: int
    examples: int

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.examples, 1)


def state_digest(state) -> str:
    """SHA-256 over a nested state dict: keys in sorted order, arrays by dtype, shape, bytes."""
    import hashlib

    digest = hashlib.sha256()

    def visit(value, path: str) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                visit(value[key], f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{path}/{i}")
        else:
            array = np.asarray(value)
            digest.update(f"{path}:{array.dtype}:{array.shape}:".encode())
            digest.update(np.ascontiguousarray(array).tobytes() if array.dtype != object
                          else repr(value).encode())

    visit(state, "")
    return digest.hexdigest()


def gathered_state_digest(local_state, rank: int, root: int = 0) -> str | None:
    """For a sharded state: every rank's :func:`state_digest`, gathered in rank order and
    hashed together on ``root`` (collective; None on the other ranks)."""
    import hashlib

    import needle.distributed as dist

    every = dist.gather_object(state_digest(local_state), dst=root)
    if rank != root:
        return None
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in every)).hexdigest()


def micro_batches(n: int, parts: int) -> list[tuple[int, int]]:
    """``(lo, hi)`` of the ``parts`` micro-batches of ``n`` examples (sizes differ by at most
    one; empty ones are dropped)."""
    cuts = [n * i // parts for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:], strict=False) if hi > lo]


def evaluate_model(model, X: np.ndarray, y: np.ndarray, device, mixed: bool = False
                   ) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` in eval mode on ``X, y``, 256 examples at a time
    (under ``amp.autocast`` for a mixed-precision model): how every strategy that holds the
    whole model evaluates, and how a saved ``model.ndl`` is re-checked."""
    from needle import amp, nn
    from needle.autograd import Tensor, no_grad

    model.eval()
    loss_fn = nn.SoftmaxLoss()
    total_loss, correct = 0.0, 0
    bf16 = any(str(p.dtype) == "bfloat16" for p in model.parameters())
    low = "bfloat16" if bf16 else "float16"
    with no_grad(), amp.autocast(low, enabled=mixed):
        for start in range(0, X.shape[0], 256):
            Xb = Tensor(X[start:start + 256], device=device, requires_grad=False)
            yb = Tensor(y[start:start + 256], device=device, requires_grad=False)
            logits = model(Xb)
            n = int(Xb.shape[0])
            total_loss += float(loss_fn(logits, yb).numpy()) * n
            correct += int((logits.numpy().argmax(axis=1) == y[start:start + n]).sum())
    return total_loss / X.shape[0], correct / X.shape[0]


class Strategy:
    """Single process: the model, its optimizer, plain forward/backward/step."""

    name = "single"
    # whether --precision fp16-mixed and --accumulate G apply (the default step below)
    mixed_precision_and_accumulation = True
    # whether --resume may load a checkpoint saved by another number of ranks
    can_reshard = False

    def __init__(self, cfg, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model = None
        self.optimizer = None
        self.scaler = None
        self.on_micro_batch = None  # set by the loop: fault injection between micro-batches
        self.denominators: dict = {}

    # ---- command line --------------------------------------------------------------------
    @staticmethod
    def add_arguments(group) -> None:
        """Add this strategy's own options to the parser group (none by default)."""

    @classmethod
    def validate(cls, cfg) -> None:
        from ..config import UsageError

        if cfg.nproc != 1:
            raise UsageError(f"--strategy {cfg.strategy} runs one process, got --nproc "
                             f"{cfg.nproc} (use --strategy ddp for data parallelism)")

    @property
    def distributed(self) -> bool:
        """Whether this strategy needs a process group (then --nproc starts the ranks)."""
        return False

    @classmethod
    def ranks(cls, cfg) -> int:
        """How many ranks the job starts (``--nproc``; the parameter server adds servers)."""
        return cfg.nproc

    # A strategy whose rank does not run the step loop sets ``serving`` and provides
    # ``run_server(X, Xt, yt, device)`` (the parameter server's server ranks).
    serving = False

    def start_step(self) -> int:
        """Steps already done when this rank starts (a restarted worker's clock)."""
        return 0

    # ---- the run -------------------------------------------------------------------------
    @property
    def mixed(self) -> bool:
        return getattr(self.cfg, "precision", "fp32") != "fp32"

    @property
    def low_dtype(self) -> str:
        """The parameters' dtype under mixed precision (autocast's low precision)."""
        bf16 = getattr(self.cfg, "precision", "fp32") == "bf16-mixed"
        return "bfloat16" if bf16 else "float16"

    def setup(self, ctx) -> None:
        self.ctx = ctx
        self.model = self._new_model(ctx)
        self.optimizer = ctx.new_optimizer(self.model.parameters())
        from needle import nn

        self.loss_fn = nn.SoftmaxLoss()

    def _new_model(self, ctx):
        """The model, float16 parameters under mixed precision; the scaler beside it."""
        from needle import amp, memory

        memory.stats(ctx.device)  # attribute memory by category from the first buffer on
        model = ctx.new_model()
        if self.mixed:
            amp.cast_parameters(model, self.low_dtype)
        # bfloat16 has float32's exponent range: its gradients need no loss scaling
        self.scaler = amp.GradScaler(enabled=self.mixed and self.low_dtype == "float16")
        return model

    def data_shard(self) -> tuple[int, int]:
        """(number of data-parallel replicas, the replica this rank feeds)."""
        return 1, 0

    @property
    def is_reporter(self) -> bool:
        """Whether this rank prints, keeps the history and writes the outputs."""
        return self.rank == 0

    def _tensors(self, X: np.ndarray, y: np.ndarray):
        from needle.autograd import Tensor

        device = self.ctx.device
        return (Tensor(X, device=device, requires_grad=False),
                Tensor(y, device=device, requires_grad=False))

    def _local_step(self, X: np.ndarray, y: np.ndarray, forward=None, after_backward=None,
                    no_sync=None):
        """Forward and backward of every micro-batch (``no_sync`` around all but the last),
        (after_backward), the scaled optimizer step; local sums (see the module doc)."""
        self.optimizer.reset_grad()
        loss_sum, correct, parts = self._backward(X, y, forward, no_sync)
        self._update(after_backward)
        n = int(y.shape[0])
        self.denominators = {"micro": [hi - lo for lo, hi in parts], "local": n}
        return loss_sum, correct, n

    def _backward(self, X: np.ndarray, y: np.ndarray, forward=None, no_sync=None,
                  counted: int = 0) -> tuple[float, int, list]:
        """Forward and backward of ``X, y``'s micro-batches, gradients accumulated into
        ``p.grad`` with weights n_i / n; (loss sum, correct, micro-batch bounds).
        ``counted``: micro-batches already run in this step (for fault injection)."""
        from needle import amp

        self.model.train()
        forward = self._checkpointed(forward or self.model)
        n = int(y.shape[0])
        parts = micro_batches(n, max(1, int(getattr(self.cfg, "accumulate", 1))))
        loss_sum, correct = 0.0, 0
        for i, (lo, hi) in enumerate(parts):
            Xb, yb = self._tensors(X[lo:hi], y[lo:hi])
            last = i == len(parts) - 1
            with nullcontext() if last or no_sync is None else no_sync():
                with amp.autocast(self.low_dtype, enabled=self.mixed), \
                        trace.span("forward", "compute"):
                    logits = forward(Xb)
                    loss = self.loss_fn(logits, yb)
                weighted = loss if len(parts) == 1 else loss * ((hi - lo) / n)
                with trace.span("backward", "compute"):
                    self.scaler.scale(weighted).backward()
            loss_sum += float(loss.numpy()) * (hi - lo)
            correct += int((logits.numpy().argmax(axis=1) == y[lo:hi].astype(np.int64)).sum())
            del logits, loss, weighted
            if self.on_micro_batch is not None:
                self.on_micro_batch(counted + i + 1)
        return loss_sum, correct, parts

    def _checkpointed(self, forward):
        """``forward``, or with ``--activation-checkpoints`` the model run as checkpoint
        regions of consecutive layers (``needle.checkpoint.checkpoint_sequential``)."""
        spec = getattr(self.cfg, "activation_checkpoints", None)
        if not spec:
            return forward
        from needle.checkpoint import CheckpointPlan, checkpoint_sequential

        from ..config import UsageError, parse_checkpoints

        segments, layers = parse_checkpoints(spec), len(getattr(self.model, "modules", ()))
        if sum(n for n, _ in segments) != layers:
            raise UsageError(f"--activation-checkpoints {spec} covers "
                             f"{sum(n for n, _ in segments)} layers, expected the {layers} "
                             f"layers of --model {self.cfg.model}")
        bounds = np.cumsum([0] + [n for n, _ in segments]).tolist()
        plan = CheckpointPlan("given", tuple(zip(bounds, bounds[1:], strict=False)),
                              tuple(c for _, c in segments), 0, 0.0, 0)
        model = self.model
        return lambda x: checkpoint_sequential(model, plan, x)

    def _update(self, after_backward=None) -> None:
        """(after_backward), gradient clipping, the scaled optimizer step."""
        if after_backward is not None:
            with trace.span("gradient sync", "communication"):
                after_backward()
        with trace.span("optimizer", "compute"):
            if getattr(self.cfg, "clip_grad", None) is not None:
                # PyTorch's order: unscale once, clip the true gradients, then a step that
                # does not unscale again (GradScaler.step knows unscale_ ran; no-op in fp32)
                self.scaler.unscale_(self.optimizer)
                self.clip_gradients(self.cfg.clip_grad)
            self.scaler.step(self.optimizer)
            self.scaler.update()

    # ---- metrics -------------------------------------------------------------------------
    def meters(self) -> list:
        """What the loop measures between steps (``apps/training/metrics.py``): for the
        default step, the model-state memory (``summary.json``'s ``memory``)."""
        from ..metrics import ModelStateMemory, PeakMemory

        if not self.mixed_precision_and_accumulation:
            return []
        return [ModelStateMemory(self.memory_probe, self.rank, self.world_size,
                                 peak=PeakMemory(self.predict_peak, self.ctx.device))]

    def predict_peak(self, X: np.ndarray, y: np.ndarray, first: bool) -> dict:
        """This rank's peak of the step on ``X, y`` (``first``: the run's first step), from
        shapes (``apps/training/peak.py``); ``predicted`` None with ``why`` where it is not
        modelled."""
        from ..peak import predict_default_step

        return predict_default_step(self, X, y, first)

    def memory_probe(self):
        """This rank's :class:`~training.metrics.ModelState` (None before set-up)."""
        from ..metrics import ModelState

        if self.model is None:
            return None
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return ModelState(self.ctx.device, self.model, inner, 0)

    def clip_gradients(self, max_norm: float) -> float:
        """Clip this step's gradients by the whole model's L2 norm (``--clip-grad``); the
        norm before clipping. Here every rank holds whole gradients (single; ddp after its
        sync), so the local norm is the global one; sharding strategies override this."""
        from needle import optim

        return optim.clip_grad_norm(self.optimizer.params, max_norm)

    def train_step(self, X: np.ndarray, y: np.ndarray) -> StepResult | None:
        return StepResult(*self._local_step(X, y))

    def _local_evaluate(self, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        return evaluate_model(self.model, X, y, self.ctx.device, self.mixed)

    def evaluate(self, X: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
        return self._local_evaluate(X, y)

    @property
    def template(self):
        """The model whose names and ``parameters()`` order :meth:`model_state` uses (the
        single-process model of ``--model``)."""
        return self.model

    def model_state(self) -> dict | None:
        """The whole trained model's state (parameters and buffers, single-process names) on
        the reporting rank, None on the others; collective where the model is sharded.

        Data-parallel replicas each update their own BatchNorm running statistics (training
        mode normalises with the batch's own statistics, so they never feed back); the
        model is the reporting rank's, as PyTorch's DDP, which broadcasts rank 0's buffers
        before every forward, also keeps."""
        from ..model_state import named_state

        if not self.is_reporter:
            return None
        return named_state(self.model, [p.numpy() for p in self.model.parameters()])

    def replicated_state(self) -> tuple[list, list[str], str | None]:
        """What data-parallel replicas hold identically (``--check-replicas``): ``(name,
        array)`` pairs, the kinds compared, and what is not compared (None: nothing)."""
        from ..debugging import named_arrays

        named = {id(p): n for n, p in self.model.named_parameters()}
        names = [named.get(id(p), f"parameter {i}") for i, p in enumerate(self.model.parameters())]
        tensors = [(n, p.numpy()) for n, p in zip(names, self.model.parameters(), strict=True)]
        tensors += named_arrays(self.optimizer.state_dict(), "optimizer", names)
        tensors += named_arrays(self.scaler.state_dict(), "scaler")
        return tensors, ["parameters", "optimizer state", "loss scaler"], None

    def collect_reports(self) -> None:
        """Anything the strategy itself gathers at the end of the run (called on every rank;
        may be collective). The meters' results are gathered by the metrics, not here."""

    def summary_blocks(self) -> dict:
        """``scaler`` and ``accumulation`` (the default step's blocks; ``memory`` is the
        metrics')."""
        if not self.mixed_precision_and_accumulation or self.scaler is None:
            return {}
        scaler = self.scaler.state_dict()
        return {
            "scaler": {"enabled": self.scaler.is_enabled(),
                       "skipped_steps": scaler["skipped_steps"],
                       "final_scale": self.scaler.get_scale(), "steps": scaler["steps"]},
            "accumulation": {"micro_batches": int(getattr(self.cfg, "accumulate", 1)),
                             "denominators": self.denominators},
        }

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's part of the training state (model with buffers, optimizer with its
        master weights, loss scaler)."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def state_sha256(self) -> str | None:
        """A digest of the whole training state (buffers and optimizer state included) on
        the reporting rank, so two runs can be compared beyond their parameters."""
        return state_digest(self.state_dict())

    def close(self) -> None:
        """Release what setup acquired (called on every rank, also after an error)."""
