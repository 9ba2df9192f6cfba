"""Model-state bytes of one rank: measured by the allocator, predicted by the memory ledger.

Measured: the device allocator's bytes currently held in the categories ``weight``,
``gradient``, ``master`` and ``optimizer`` (requested bytes, and the 512-byte-rounded block
bytes beside them). Predicted: :func:`needle.memory.estimate` ``(model, precision,
optimizer, zero_stage, dp, rank)`` for this rank's exact share. Read right after a step
(before the gradients are dropped), when the model state is all there is in those
categories: the whole or sharded weights, the whole (ZeRO stage 1) or reduced (stages 2-3)
gradients, the float32 masters and the moments.

Reading :func:`measured` is cheap (the allocator's counters); :func:`predicted` builds a
ledger, so a caller that samples often computes it once: it depends only on the model's
shapes and dtypes, the optimizer and the layout, not on the step.

Example:
    >>> optimizer_kind(type("Adam", (), {})())
    'adam'
"""
from __future__ import annotations

from typing import Any

from .ledger import estimate
from .registry import stats

MODEL_STATE = ("weight", "gradient", "master", "optimizer")


def optimizer_kind(optimizer: Any) -> str:
    """The ledger's name for an optimizer: adam, sgd_momentum or sgd."""
    name = type(optimizer).__name__.lower()
    if name.startswith("adam"):
        return "adam"
    return "sgd_momentum" if float(getattr(optimizer, "momentum", 0.0) or 0.0) else "sgd"


def precision_of(params: list) -> str:
    """``mixed`` when the parameters are float16 or bfloat16, else ``fp32``."""
    return "mixed" if any(str(p.dtype) in ("float16", "bfloat16") for p in params) else "fp32"


def measured(device: Any, baseline: dict | None = None) -> dict[str, dict[str, int]]:
    """``{"requested": {cat: bytes}, "allocated": {cat: bytes}}`` held now on ``device``
    (minus ``baseline``, an earlier result, when given)."""
    cats = stats(device)["by_category"]
    out = {"requested": {c: int(cats[c]["current_requested"]) for c in MODEL_STATE},
           "allocated": {c: int(cats[c]["current"]) for c in MODEL_STATE}}
    if baseline is not None:
        for kind in out:
            for c in MODEL_STATE:
                out[kind][c] -= baseline[kind][c]
    return out


def predicted(module: Any, optimizer: Any, zero_stage: int, dp: int, rank: int,
              precision: str | None = None) -> dict[str, int]:
    """The ledger's bytes for this rank, by category."""
    params = list(module.parameters())
    led = estimate(model=module, precision=precision or precision_of(params),
                   optimizer=optimizer_kind(optimizer), zero_stage=zero_stage, dp=dp,
                   rank=rank if dp > 1 else None, margin=0)
    cats = led.by_category()
    return {c: int(cats[c]) for c in MODEL_STATE}
