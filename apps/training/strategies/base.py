"""What every training strategy provides, with the single-process behaviour as the default.

The loop (``apps/training/loop.py``) calls, on every rank: ``setup`` once, ``data_shard``,
``train_step`` once per optimizer step with this replica's share of the global batch,
``evaluate`` after each epoch, ``full_parameters`` and ``summary_blocks`` at the end.
Methods that are collective in a strategy (evaluation of a sharded model, say) are called on
every rank in the same order, so a strategy may communicate inside any of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    mine = np.frombuffer(bytes.fromhex(state_digest(local_state)), dtype=np.uint8).copy()
    every = [np.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if rank != root:
        return None
    return hashlib.sha256(b"".join(d.tobytes() for d in every)).hexdigest()


class Strategy:
    """Single process: the model, its optimizer, plain forward/backward/step."""

    name = "single"

    def __init__(self, cfg, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model = None
        self.optimizer = None

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

    # ---- the run -------------------------------------------------------------------------
    def setup(self, ctx) -> None:
        self.ctx = ctx
        self.model = ctx.new_model()
        self.optimizer = ctx.new_optimizer(self.model.parameters())
        from needle import nn

        self.loss_fn = nn.SoftmaxLoss()

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

    def _local_step(self, X: np.ndarray, y: np.ndarray, forward=None, after_backward=None):
        """forward, loss, backward, (after_backward), optimizer step; local sums."""
        self.model.train()
        Xb, yb = self._tensors(X, y)
        logits = (forward or self.model)(Xb)
        loss = self.loss_fn(logits, yb)
        self.optimizer.reset_grad()
        loss.backward()
        if after_backward is not None:
            after_backward()
        self.optimizer.step()
        n = int(y.shape[0])
        correct = int((logits.numpy().argmax(axis=1) == y.astype(np.int64)).sum())
        return float(loss.numpy()) * n, correct, n

    def train_step(self, X: np.ndarray, y: np.ndarray) -> StepResult | None:
        return StepResult(*self._local_step(X, y))

    def _local_evaluate(self, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        from needle.autograd import no_grad

        self.model.eval()
        total_loss, correct = 0.0, 0
        with no_grad():
            for start in range(0, X.shape[0], 256):
                Xb, yb = self._tensors(X[start:start + 256], y[start:start + 256])
                logits = self.model(Xb)
                n = int(Xb.shape[0])
                total_loss += float(self.loss_fn(logits, yb).numpy()) * n
                correct += int((logits.numpy().argmax(axis=1) == y[start:start + n]).sum())
        return total_loss / X.shape[0], correct / X.shape[0]

    def evaluate(self, X: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
        return self._local_evaluate(X, y)

    def full_parameters(self) -> list[np.ndarray] | None:
        return [p.numpy() for p in self.model.parameters()]

    def summary_blocks(self) -> dict:
        return {}

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's part of the training state (model with buffers, optimizer)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def state_sha256(self) -> str | None:
        """A digest of the whole training state (buffers and optimizer state included) on
        the reporting rank, so two runs can be compared beyond their parameters."""
        return state_digest(self.state_dict())

    def close(self) -> None:
        """Release what setup acquired (called on every rank, also after an error)."""
