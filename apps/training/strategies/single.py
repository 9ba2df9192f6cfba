"""``--strategy single``: one process, no communication (the default for ``--nproc 1``).

``--compile`` runs the training step under ``ndl.compile``: traced once per batch shape,
then replayed as a fused kernel program (docs/compile.md). The parameters are bitwise those
of the eager run; ``summary.json`` gets a ``compile`` block saying how the step replayed.
"""
from __future__ import annotations

import numpy as np

from .base import StepResult, Strategy


class SingleProcess(Strategy):
    """The plain training step of :class:`Strategy`, under its own name, or compiled."""

    name = "single"

    @staticmethod
    def add_arguments(group) -> None:
        group.add_argument("--compile", action="store_true",
                           help="replay the step with ndl.compile (a kernel program after a "
                                "few calls; same parameters bit for bit; fp32, --accumulate 1)")

    @classmethod
    def validate(cls, cfg) -> None:
        from ..config import UsageError

        super().validate(cfg)
        if (cfg.extra or {}).get("compile") and (cfg.precision != "fp32" or cfg.accumulate != 1):
            raise UsageError(f"--compile runs fp32 steps of one micro-batch, got --precision "
                             f"{cfg.precision} --accumulate {cfg.accumulate}")
        if (cfg.extra or {}).get("compile") and getattr(cfg, "clip_grad", None) is not None:
            # whether to clip depends on the norm's value: a branch the traced step cannot hold
            raise UsageError(f"--compile runs steps without gradient clipping, got "
                             f"--clip-grad {cfg.clip_grad}")

    def setup(self, ctx) -> None:
        super().setup(ctx)
        self.compiled = None
        if (self.cfg.extra or {}).get("compile"):
            import needle as ndl

            model, optimizer, loss_fn = self.model, self.optimizer, self.loss_fn

            def step(x, y):  # the default step's operations, in its order, host reads after
                optimizer.reset_grad()
                logits = model(x)
                loss = loss_fn(logits, y)
                loss.backward()
                optimizer.step()
                return loss, logits

            self.compiled = ndl.compile(step)

    def train_step(self, X: np.ndarray, y: np.ndarray) -> StepResult | None:
        if self.compiled is None:
            return super().train_step(X, y)
        self.model.train()
        loss, logits = self.compiled(*self._tensors(X, y))
        n = int(y.shape[0])
        correct = int((logits.numpy().argmax(axis=1) == y.astype(np.int64)).sum())
        if self.on_micro_batch is not None:
            self.on_micro_batch(1)
        self.denominators = {"micro": [n], "local": n}
        self._measure_memory(0)
        return StepResult(float(loss.numpy()) * n, correct, n)

    def close(self) -> None:
        self.compiled = None  # its programs name the model's buffers: free them with the run
        super().close()

    def summary_blocks(self) -> dict:
        blocks = super().summary_blocks()
        if self.compiled is not None:  # the batch shape run most first (the full batches)
            modes = self.compiled.replay_modes()
            blocks["compile"] = {**self.compiled.stats(), **modes[0], "signatures": modes}
        return blocks
