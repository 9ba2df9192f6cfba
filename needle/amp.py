"""Mixed precision: ``autocast`` (per-op dtype rules), ``GradScaler`` (dynamic loss scaling)
and ``cast_parameters`` (float16 or bfloat16 working weights). The rule table and the recipe
are in docs/amp.md.

Inside ``autocast(dtype="float16")`` (or ``"bfloat16"``) every op looks up its rule before it
runs (:data:`RULES`, by op class):

* ``lower``: matrix products and convolutions run in the low precision (float32 arguments
  are cast);
* ``float32``: reductions, ``exp``/``log``/powers/``sqrt`` (hence softmax, log-softmax, the
  loss and normalisation statistics, which are built from them) run in float32;
* ``promote`` (every other op: elementwise, shape, indexing): runs in its arguments' dtype,
  the widest one when they differ. Elementwise work after a float16 matmul therefore stays in
  float16; once a float32 statistic enters (``x - mean``) it continues in float32.

A cast is an op (``Cast``) whose gradient casts back, so gradients reach every tensor in its
own dtype. ``GradScaler`` multiplies the loss by ``scale`` so that small float16 gradients do
not flush to zero, checks the gradients for Inf/NaN before each step, skips the step and
halves the scale when it finds one, and doubles the scale after ``growth_interval`` good steps.
Optimizers keep float32 master weights for float16 and bfloat16 parameters (``needle.optim``),
and divide the gradients by the scale in float32 as they read them. bfloat16 has float32's
exponent range, so its gradients need no loss scaling: a ``GradScaler`` is allowed with it but
not needed (``GradScaler(enabled=False)`` keeps one code path).

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle import nn, optim
    >>> np.random.seed(0); model = ndl.amp.cast_parameters(nn.Linear(4, 3))
    >>> opt, scaler = optim.Adam(model.parameters(), lr=1e-3), ndl.amp.GradScaler()
    >>> x, y = ndl.Tensor(np.random.rand(8, 4)), ndl.Tensor(np.arange(8) % 3)
    >>> with ndl.amp.autocast():
    ...     logits = model(x)
    ...     loss = nn.SoftmaxLoss()(logits, y)
    >>> str(logits.dtype), str(loss.dtype)
    ('float16', 'float32')
    >>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    True
    >>> str(model.weight.dtype), str(opt.master[model.weight].dtype), scaler.get_scale()
    ('float16', 'float32', 65536.0)
"""
from __future__ import annotations

import functools
import math
from typing import Any

from ._core.errors import NeedleError
from .autograd import Tensor
from .autograd.grad_mode import STATE
from .memory import attribute as _attribute
from .ops import (
    ops_batch_norm,
    ops_conv,
    ops_linear,
    ops_logarithmic,
    ops_mathematic,
    ops_shape,
    ops_softmax_xent,
)
from .ops.ops_shape import Cast

__all__ = ["autocast", "GradScaler", "cast_parameters", "RULES", "rule_of", "is_autocast_enabled"]

LOWER, FLOAT32, PROMOTE = "lower", "float32", "promote"
_WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_LOW = ("float16", "bfloat16")

RULES: dict[type, str] = {
    # products: the float16 work
    ops_mathematic.MatMul: LOWER,
    ops_conv.Conv: LOWER,
    ops_linear.FusedLinear: LOWER,  # bias too, as PyTorch's linear (nn.Linear composes instead)
    # reductions and numerically sensitive elementwise functions: float32
    ops_shape.Summation: FLOAT32,
    ops_logarithmic.LogSumExp: FLOAT32,
    ops_logarithmic.LogSoftmax: FLOAT32,
    ops_mathematic.Exp: FLOAT32,
    ops_mathematic.Log: FLOAT32,
    ops_mathematic.PowerScalar: FLOAT32,
    ops_mathematic.EWisePow: FLOAT32,
    ops_mathematic.Sqrt: FLOAT32,
    ops_batch_norm.FusedBatchNorm: FLOAT32,  # statistics, as when composed from reductions
    ops_softmax_xent.SoftmaxCrossEntropy: FLOAT32,  # the loss, as logsumexp
    # a cast is what the policy itself emits: never re-cast it
    Cast: "none",
}


def rule_of(op: Any) -> str:
    """The autocast rule of ``op`` (an op instance or class): ``lower``, ``float32``,
    ``promote`` or ``none``.

    Example:
        >>> from needle import ops
        >>> rule_of(ops.MatMul), rule_of(ops.Summation()), rule_of(ops.EWiseAdd)
        ('lower', 'float32', 'promote')
    """
    cls = op if isinstance(op, type) else type(op)
    return RULES.get(cls, PROMOTE)


def _dtype(t: Any) -> str | None:
    return str(t.dtype) if isinstance(t, Tensor) else None


class _Policy:
    """``policy(op, args) -> args``: the per-op casts of one autocast region."""

    __slots__ = ("low",)

    def __init__(self, low: str):
        self.low = low

    def __call__(self, op: Any, args: tuple) -> tuple:
        rule = RULES.get(type(op), PROMOTE)
        if rule == "none":
            return args
        dtypes = [_dtype(a) for a in args]
        present = {d for d in dtypes if d is not None}
        if not present:
            return args
        if rule == LOWER:
            target = {d: (self.low if d == "float32" else d) for d in present}
        elif rule == FLOAT32:
            target = {d: ("float32" if _WIDTH.get(d, 4) < 4 else d) for d in present}
        else:
            target = {d: d for d in present}
        if len(set(target.values())) > 1:  # still mixed: promote to the widest
            widest = max(target.values(), key=lambda d: _WIDTH.get(d, 4))
            target = {d: widest for d in present}
        if all(target[d] == d for d in present):
            return args
        return tuple(a if d is None or target[d] == d else Cast(target[d])(a)
                     for a, d in zip(args, dtypes, strict=True))


class autocast:  # noqa: N801 - lowercase like the PyTorch name users expect
    """Run ops in the region with the mixed-precision rules (module docstring, docs/amp.md).

    Thread-local and nestable (``autocast(enabled=False)`` turns it off inside); also a
    decorator. Call ``backward()`` inside or outside: gradients keep each tensor's dtype.

    Args:
        dtype: the low precision, ``"float16"`` or ``"bfloat16"``.
        enabled: False makes the region a plain one.

    Raises:
        NeedleError: for another dtype.

    Example:
        >>> import numpy as np, needle as ndl
        >>> a = ndl.Tensor(np.ones((2, 3)))
        >>> with ndl.amp.autocast():
        ...     str((a @ ndl.Tensor(np.ones((3, 2)))).dtype), str(a.sum().dtype)
        ('float16', 'float32')
        >>> with ndl.amp.autocast(dtype="bfloat16"):
        ...     str((a @ ndl.Tensor(np.ones((3, 2)))).dtype)
        'bfloat16'
    """

    def __init__(self, dtype: str = "float16", enabled: bool = True):
        if str(dtype) not in _LOW:
            raise NeedleError(f"autocast: unsupported low precision, expected one of {_LOW}, "
                              f"got {dtype!r}")
        self.dtype, self.enabled = str(dtype), bool(enabled)
        self._saved: list = []

    def __enter__(self) -> "autocast":
        self._saved.append(STATE.cast_policy)
        STATE.cast_policy = _Policy(self.dtype) if self.enabled else None
        return self

    def __exit__(self, *exc) -> None:
        STATE.cast_policy = self._saved.pop()

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with autocast(self.dtype, self.enabled):
                return fn(*args, **kwargs)

        return wrapper


def is_autocast_enabled() -> bool:
    """Whether ops on this thread run under an autocast policy now."""
    return STATE.cast_policy is not None


def cast_parameters(module: Any, dtype: str = "float16") -> Any:
    """Convert every parameter of ``module`` to ``dtype`` in place (identity kept); buffers
    such as BatchNorm's running statistics stay float32. Returns ``module``.

    Build the optimizer after this call (or load its state): its float32 master copies are
    made from the parameters' float16 (or bfloat16) values.

    Example:
        >>> import numpy as np
        >>> from needle import nn
        >>> np.random.seed(0); m = cast_parameters(nn.BatchNorm1d(3))
        >>> str(m.weight.dtype), str(m.running_mean.dtype)
        ('float16', 'float32')
    """
    for p in module.parameters():
        data = p.realize_cached_data()
        if str(data.dtype) != dtype:
            p.cached_data = data.astype(dtype)
            _attribute(p, "weight")
    return module


class GradScaler:
    """Dynamic loss scaling for float16 gradients (bfloat16 ones need none; a scaler still
    works with them).

    ``scale(loss)`` multiplies the loss by the current scale; ``step(optimizer)`` checks every
    gradient for Inf/NaN and either skips the step (weights and optimizer state untouched) or
    runs it with the gradients divided by the scale (in the optimizer's float32 arithmetic);
    ``update()`` then halves the scale after a skipped step (``backoff_factor``) or multiplies
    it by ``growth_factor`` after ``growth_interval`` consecutive good steps.

    The optimizer is asked through ``grads_finite()`` and ``set_grad_scale(scale)`` (and its
    ``params`` and ``step()``): ``needle.optim.Optimizer`` documents them, and a wrapper that
    stands in for an optimizer (DDP's, ZeRO's) provides them, answering ``grads_finite`` for
    the synchronized gradients, the same on every rank.

    Args:
        init_scale: the first scale (a power of two keeps scaling exact).
        growth_factor, backoff_factor, growth_interval: the schedule above.
        enabled: False makes every method a pass-through (fp32 runs share one code path).

    Example:
        >>> import numpy as np, needle as ndl
        >>> from needle import optim
        >>> p = ndl.Tensor(np.ones(2), dtype="float16"); opt = optim.SGD([p], lr=0.1)
        >>> scaler = GradScaler(init_scale=4.0)
        >>> p.grad = ndl.Tensor(np.array([np.inf, 1.0]), dtype="float16")
        >>> scaler.step(opt), p.numpy().tolist()          # skipped: weights unchanged
        (False, [1.0, 1.0])
        >>> scaler.update(); scaler.get_scale(), scaler.skipped_steps
        (2.0, 1)
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and int(growth_interval) >= 1):
            raise NeedleError(
                f"GradScaler: bad schedule, expected init_scale > 0, growth_factor > 1, "
                f"0 < backoff_factor < 1, growth_interval >= 1, got {init_scale}, "
                f"{growth_factor}, {backoff_factor}, {growth_interval}")
        self.enabled = bool(enabled)
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self.skipped_steps = 0
        self.steps = 0  # update() calls
        self._per_optimizer: dict[int, dict] = {}

    # ----- the step ---------------------------------------------------------------------------
    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def scale(self, loss: Tensor) -> Tensor:
        """``loss * scale`` in float32 (a float16 or bfloat16 loss is cast up first)."""
        if not self.enabled:
            return loss
        if str(loss.dtype) in _LOW:
            loss = Cast("float32")(loss)
        return loss * self._scale

    def _record(self, optimizer: Any) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"unscaled": False,
                                                              "found_inf": None})

    def unscale_(self, optimizer: Any) -> None:
        """Divide the gradients by the scale now (e.g. before clipping them); ``step`` then
        uses them as they are. The gradients keep their dtype: float16 gradients are better
        left to ``step``, which unscales in float32."""
        if not self.enabled:
            return
        rec = self._record(optimizer)
        if rec["unscaled"]:
            raise NeedleError("GradScaler.unscale_: already called for this optimizer since "
                              "the last update(), expected one call per step")
        rec["found_inf"] = not optimizer.grads_finite()
        rec["unscaled"] = True
        inv = 1.0 / self._scale
        for p in optimizer.params:
            if p.grad is not None:
                p.grad = Tensor.make_const(p.grad.realize_cached_data() * inv)

    def step(self, optimizer: Any) -> bool:
        """Run ``optimizer.step()`` unless a gradient is Inf/NaN; True when it ran."""
        if not self.enabled:
            optimizer.step()
            return True
        rec = self._record(optimizer)
        if rec["found_inf"] is None:
            rec["found_inf"] = not optimizer.grads_finite()
        if rec["found_inf"]:
            return False
        if rec["unscaled"]:
            optimizer.step()
            return True
        optimizer.set_grad_scale(self._scale)
        try:
            optimizer.step()
        finally:
            optimizer.set_grad_scale(None)
        return True

    def update(self) -> None:
        """Adjust the scale after this iteration's ``step`` calls (see the class docstring)."""
        if not self.enabled or not self._per_optimizer:
            return
        found = any(rec["found_inf"] for rec in self._per_optimizer.values())
        self._per_optimizer.clear()
        self.steps += 1
        if found:
            self.skipped_steps += 1
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self._scale *= self.growth_factor
            self._growth_tracker = 0
        if not math.isfinite(self._scale):
            raise NeedleError(f"GradScaler.update: the scale overflowed, expected a finite "
                              f"scale, got {self._scale}")

    # ----- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Scale, schedule, growth tracker and counters (what an exact resume needs)."""
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "growth_tracker": self._growth_tracker, "skipped_steps": self.skipped_steps,
                "steps": self.steps, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise NeedleError(f"GradScaler.load_state_dict: missing {sorted(missing)}, "
                              f"expected a GradScaler.state_dict(), got keys {sorted(state)}")
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        for key in ("growth_factor", "backoff_factor"):
            setattr(self, key, float(state.get(key, getattr(self, key))))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.steps = int(state.get("steps", 0))
        self.enabled = bool(state.get("enabled", self.enabled))
        self._per_optimizer.clear()
