"""The optimizer a training loop sees under ZeRO: ``step()`` is the whole sharded step.

It wraps the optimizer built over this rank's shard parameters. ``step()`` finishes the
gradient reduce-scatter, updates the shard and publishes the weights; ``grad_scale`` and
``grads_finite`` let ``amp.GradScaler`` unscale in float32 and skip a step on every rank
when any rank's gradient piece overflowed. Other attributes (``lr``, ``state_dict``, ...)
are the inner optimizer's.
"""
from __future__ import annotations

from typing import Any


class ZeroOptimizer:
    """Facade over the shard optimizer of a :class:`ZeroDataParallel` (see the module doc)."""

    def __init__(self, zero: Any, inner: Any):
        self.zero, self.optimizer = zero, inner

    @property
    def params(self) -> list:
        """This rank's shard parameters (what the inner optimizer updates)."""
        return self.optimizer.params

    @property
    def grad_scale(self) -> float | None:
        return self.optimizer.grad_scale

    @grad_scale.setter
    def grad_scale(self, value: float | None) -> None:
        self.optimizer.grad_scale = value

    def step(self) -> None:
        self.zero.step()

    def reset_grad(self) -> None:
        self.zero.zero_grad()

    zero_grad = reset_grad

    def finish_gradient_sync(self) -> None:
        self.zero.finish_gradient_sync()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the shard gradients by the whole model's norm (collective; see
        ``ZeroDataParallel.clip_grad_norm``)."""
        return self.zero.clip_grad_norm(max_norm)

    def grads_finite(self) -> bool:
        """Whether every rank's reduced gradient pieces are finite (collective: the same
        answer on every rank); what ``amp.GradScaler`` asks before a step."""
        return self.zero.grads_finite()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
