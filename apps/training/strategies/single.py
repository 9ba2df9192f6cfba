"""``--strategy single``: one process, no communication (the default for ``--nproc 1``).

``--compile`` runs the training step under ``ndl.compile``: traced once per batch shape,
then replayed as a fused kernel program (docs/compile.md). The parameters are bitwise those
of the eager run; ``summary.json`` gets a ``compile`` block saying how the step replayed.

``--data-shares R`` computes each step as R data-parallel replicas would: the batch cut into
the replicas' shares (``data.replica_share``), each share's gradient computed alone, then
combined in the data-parallel arithmetic (each times its weight n_r / N in its own dtype,
summed in share order). Share r draws from its own random stream, as replica r does (every
replica starts from the same seeded state), and the model keeps share 0's BatchNorm running
statistics, as the data-parallel strategies keep rank 0's. The parameters and buffers are
then bitwise those of ddp, zero and the synchronous parameter server on R = 2 ranks, Dropout
and BatchNorm included (docs/training.md says why R = 2).
"""
from __future__ import annotations

import numpy as np

from .base import StepResult, Strategy


class SingleProcess(Strategy):
    """The plain training step of :class:`Strategy`, under its own name, or compiled."""

    name = "single"

    @staticmethod
    def add_arguments(group) -> None:
        group.add_argument("--data-shares", type=int, default=1, metavar="R",
                           help="compute each step's gradient as R data-parallel replicas "
                                "do (bitwise ddp's on 2 ranks for models without BatchNorm "
                                "or Dropout)")
        group.add_argument("--compile", action="store_true",
                           help="replay the step with ndl.compile (a kernel program after a "
                                "few calls; same parameters bit for bit; fp32, --accumulate 1)")

    @classmethod
    def validate(cls, cfg) -> None:
        from ..config import UsageError

        super().validate(cfg)
        shares = (cfg.extra or {}).get("data_shares", 1)
        if shares < 1 or shares > cfg.batch_size:
            raise UsageError(f"--data-shares must be in [1, --batch-size {cfg.batch_size}], "
                             f"got {shares}")
        if shares > 1 and (cfg.extra or {}).get("compile"):
            raise UsageError(f"--compile runs the step as one share, got --data-shares {shares}")
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
        self.share_streams: list | None = None  # shares 1..R-1's random states
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
        shares = int((self.cfg.extra or {}).get("data_shares", 1))
        if self.compiled is None and shares > 1:
            return self._shared_step(X, y, shares)
        if self.compiled is None:
            return super().train_step(X, y)
        self.model.train()
        loss, logits = self.compiled(*self._tensors(X, y))
        n = int(y.shape[0])
        correct = int((logits.numpy().argmax(axis=1) == y.astype(np.int64)).sum())
        if self.on_micro_batch is not None:
            self.on_micro_batch(1)
        self.denominators = {"micro": [n], "local": n}
        return StepResult(float(loss.numpy()) * n, correct, n)

    def _shared_step(self, X: np.ndarray, y: np.ndarray, shares: int) -> StepResult:
        """One step as ``shares`` data-parallel replicas compute it (see the module doc)."""
        from needle import memory, random
        from needle.autograd import Tensor

        from ..data import replica_share

        every = np.arange(y.shape[0])
        params = self.optimizer.params
        if self.share_streams is None:  # every replica starts from the same seeded state
            self.share_streams = [random.get_state() for _ in range(shares - 1)]
        total: list | None = None
        loss_sum, correct, micro, counted = 0.0, 0, [], 0
        for r in range(shares):
            rows = replica_share(every, shares, r)
            self.optimizer.reset_grad()
            if r == 1:  # share 0's stream and statistics are the model's (rank 0's)
                stream0 = random.get_state()
                buffers0 = {name: t.numpy().copy() for name, t in self.model.named_buffers()}
            if r > 0:
                random.set_state(self.share_streams[r - 1])
            ls, c, parts = self._backward(X[rows], y[rows], counted=counted)
            if r > 0:
                self.share_streams[r - 1] = random.get_state()
            counted += len(parts)
            loss_sum, correct = loss_sum + ls, correct + c
            micro.append([hi - lo for lo, hi in parts])
            weight = rows.size / y.shape[0]
            grads = [p.grad.numpy() if p.grad is not None else np.zeros(p.shape, str(p.dtype))
                     for p in params]
            weighted = [g * g.dtype.type(weight) for g in grads]
            total = weighted if total is None else [a + b for a, b in
                                                    zip(total, weighted, strict=True)]
        random.set_state(stream0)
        self.model.load_state_dict(buffers0, strict=False)
        for p, g in zip(params, total or [], strict=True):
            p.grad = Tensor(g, device=p.device, dtype=str(p.dtype), requires_grad=False)
            memory.attribute(p.grad, "gradient")
        self._update()
        n = int(y.shape[0])
        self.denominators = {"micro": micro, "local": n, "shares": shares}
        return StepResult(loss_sum, correct, n)

    def state_dict(self) -> dict:
        """The default state, plus the random states of shares 1..R-1 (share 0's is the
        process's own, which the checkpoint saves with every stream)."""
        state = super().state_dict()
        if self.share_streams is not None:
            state["share_streams"] = list(self.share_streams)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "share_streams" in state:
            from needle.random import RNGState

            self.share_streams = [RNGState(s) for s in state["share_streams"]]

    def close(self) -> None:
        self.compiled = None  # its programs name the model's buffers: free them with the run
        super().close()

    def summary_blocks(self) -> dict:
        blocks = super().summary_blocks()
        if self.compiled is not None:  # the batch shape run most first (the full batches)
            modes = self.compiled.replay_modes()
            blocks["compile"] = {**self.compiled.stats(), **modes[0], "signatures": modes}
        return blocks
