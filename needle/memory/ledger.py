"""The memory ledger: predicted bytes per term of a training step, and a comparison with the
allocator's measured per-category peaks.

Terms (bytes per parameter; ``mixed`` = 16-bit working copies with an fp32 master):

==================  ======  =====
term                mixed   fp32
==================  ======  =====
working weights     2       4
gradients           2       4
master weights      4       0
optimizer moments   4 each  4 each   (adam/adamw: 2, sgd_momentum: 1, sgd: 0)
==================  ======  =====

Sharding (ZeRO over ``dp`` data-parallel workers): stage 1 divides master weights and moments
by ``dp``, stage 2 also gradients, stage 3 also working weights. Tensor and pipeline
parallelism divide every model-state term by ``tp * pp``. Each term is measured in its own
allocator category: ``weight``, ``gradient``, ``master`` and ``optimizer`` (the moments).
Activations = ``prod(batch_shape) * width * ceil(num_layers / pp) * activation_arrays_per_layer *
bytes_per_activation`` (kept whole on each of the ``tp`` workers, a conservative choice);
``margin`` is a fraction of state + activations. Shares that do not divide evenly round up
(the largest shard is what must fit), unless ``rank`` names one worker: then the sharded
terms are that worker's exact share under ZeRO's rule (every parameter, flattened, is cut into
``dp`` contiguous pieces, rank r holding elements ``[r*n // dp, (r+1)*n // dp)``; with only
``num_params`` the model counts as one flat parameter).

Example:
    >>> led = estimate(num_params=1_000_000, batch_shape=(2, 128), width=64, num_layers=4,
    ...                activation_arrays_per_layer=10)
    >>> led.model_state_bytes, led.activation_bytes, led.total_bytes
    (16000000, 1310720, 21638400)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ._errors import MemoryArgumentError
from .categories import CATEGORIES

__all__ = ["LedgerRow", "Ledger", "estimate", "Comparison", "ComparisonRow", "compare",
           "shard_elements"]

_BYTES = {  # precision -> (weights, gradients, master, per moment)
    "mixed": (2, 2, 4, 4),
    "fp32": (4, 4, 0, 4),
}
_MOMENTS = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class LedgerRow:
    """One term: bytes, the allocator category it is measured in, and how it was computed."""

    term: str
    bytes: int
    category: str | None
    formula: str


@dataclass(frozen=True)
class Ledger:
    """An estimate: one :class:`LedgerRow` per term, in a fixed order."""

    rows: tuple[LedgerRow, ...]
    num_params: int

    def row(self, term: str) -> LedgerRow:
        """The row named ``term``."""
        for r in self.rows:
            if r.term == term:
                return r
        raise MemoryArgumentError(
            f"ledger: unknown term, expected one of {[r.term for r in self.rows]}, got {term!r}")

    def __getitem__(self, term: str) -> int:
        return self.row(term).bytes

    @property
    def model_state_bytes(self) -> int:
        """Weights + gradients + master weights + optimizer moments."""
        return sum(self[t] for t in ("working weights", "gradients", "master weights",
                                     "optimizer moments"))

    @property
    def activation_bytes(self) -> int:
        return self["activations"]

    @property
    def subtotal_bytes(self) -> int:
        """Everything but the margin."""
        return self.model_state_bytes + self.activation_bytes

    @property
    def total_bytes(self) -> int:
        return self.subtotal_bytes + self["margin"]

    def by_category(self) -> dict[str, int]:
        """Estimated bytes per allocator category (master weights are ``master``)."""
        out = {c: 0 for c in CATEGORIES}
        for r in self.rows:
            if r.category is not None:
                out[r.category] += r.bytes
        return out

    def __str__(self) -> str:
        lines = [f"{'term':<20}{'bytes':>18}  formula"]
        lines += [f"{r.term:<20}{r.bytes:>18,}  {r.formula}" for r in self.rows]
        lines.append(f"{'total':<20}{self.total_bytes:>18,}")
        return "\n".join(lines)


def _count_params(model) -> int:
    try:
        params = list(model.parameters())
    except AttributeError as exc:
        raise MemoryArgumentError(
            f"estimate: bad model, expected an object with .parameters(), got {model!r}") from exc
    return sum(math.prod(p.shape) for p in params)


def _param_sizes(model) -> list[int]:
    return [math.prod(p.shape) for p in model.parameters()]


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or value < 1:
        raise MemoryArgumentError(f"estimate: bad {name}, expected an int >= 1, got {value!r}")


def _ceil(x: Fraction) -> int:
    return math.ceil(x)


def shard_elements(sizes, dp: int, rank: int) -> int:
    """Elements of parameters of ``sizes`` that ZeRO rank ``rank`` of ``dp`` holds: each
    parameter (flattened) is cut into ``dp`` contiguous pieces whose sizes differ by at most one.

    Example:
        >>> [shard_elements([10, 3], 4, r) for r in range(4)]
        [2, 4, 3, 4]
    """
    return sum((rank + 1) * n // dp - rank * n // dp for n in sizes)


def _state_rows(n: int, precision: str, optimizer: str, zero_stage: int, dp: int,
                split: int, shard: int | None) -> list[LedgerRow]:
    """``shard``: this worker's sharded element count (None: the largest share, rounded up)."""
    w, g, m, per_moment = _BYTES[precision]
    k = _MOMENTS[optimizer]
    sharded = {  # term -> divided by dp?
        "working weights": zero_stage >= 3, "gradients": zero_stage >= 2,
        "master weights": zero_stage >= 1, "optimizer moments": zero_stage >= 1,
    }
    per_param = {"working weights": w, "gradients": g, "master weights": m,
                 "optimizer moments": k * per_moment}
    category = {"working weights": "weight", "gradients": "gradient",
                "master weights": "master", "optimizer moments": "optimizer"}
    rows = []
    for term, b in per_param.items():
        if sharded[term] and dp > 1 and shard is not None:
            rows.append(LedgerRow(term, _ceil(Fraction(b * shard, split)), category[term],
                                  f"{b} B x {shard:,} params (this rank's share of "
                                  f"{n:,} / {dp})" + (f" / {split}" if split > 1 else "")))
            continue
        denom = split * (dp if sharded[term] else 1)
        formula = f"{b} B x {n:,} params" + (f" / {denom}" if denom > 1 else "")
        rows.append(LedgerRow(term, _ceil(Fraction(b * n, denom)), category[term], formula))
    return rows


def _activation_row(batch_shape, width, num_layers, arrays, bytes_per, pp,
                    activation_bytes) -> LedgerRow:
    if activation_bytes is not None:
        return LedgerRow("activations", int(activation_bytes), "activation", "given")
    if batch_shape is None:
        return LedgerRow("activations", 0, "activation", "not estimated (no batch_shape)")
    missing = [k for k, v in (("width", width), ("num_layers", num_layers),
                              ("activation_arrays_per_layer", arrays)) if v is None]
    if missing:
        raise MemoryArgumentError(
            f"estimate: batch_shape given without {missing}, expected all of width, num_layers, "
            f"activation_arrays_per_layer, got None")
    shape = (batch_shape,) if isinstance(batch_shape, int) else tuple(batch_shape)
    layers = -(-num_layers // pp)
    total = math.prod(shape) * width * layers * arrays * bytes_per
    dims = " x ".join(str(d) for d in shape)
    return LedgerRow("activations", total, "activation",
                     f"{dims} x {width} x {layers} layers x {arrays} arrays x {bytes_per} B")


def estimate(model=None, *, num_params: int | None = None, batch_shape=None,
             precision: str = "mixed", optimizer: str = "adam", zero_stage: int = 0,
             dp: int = 1, tp: int = 1, pp: int = 1, activation_arrays_per_layer: int | None = None,
             num_layers: int | None = None, width: int | None = None,
             bytes_per_activation: int | None = None, activation_bytes: int | None = None,
             margin: float = 0.25, rank: int | None = None) -> Ledger:
    """Predict the bytes one worker needs for a training step.

    Args:
        model: anything with ``.parameters()`` yielding objects with ``.shape``.
        num_params: parameter count (instead of ``model``).
        batch_shape: local micro-batch shape without the width, e.g. ``(sequences, positions)``.
        precision: ``"mixed"`` or ``"fp32"``.
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd_momentum"`` or ``"sgd"``.
        zero_stage: 0-3, sharding over ``dp`` workers. ``tp``, ``pp``: parallel degrees.
        activation_arrays_per_layer, num_layers, width: the activation model.
        bytes_per_activation: default 2 for mixed, 4 for fp32.
        activation_bytes: a known activation total (e.g. from a trace) instead of the model.
        margin: planning allowance as a fraction of the subtotal.
        rank: a ZeRO rank (0 <= rank < dp): its exact share of the sharded terms instead of
            the largest share rounded up (see the module docstring).

    Returns:
        A :class:`Ledger`.

    Raises:
        MemoryArgumentError: inconsistent or unknown arguments.
    """
    if (model is None) == (num_params is None):
        raise MemoryArgumentError(
            f"estimate: expected exactly one of model and num_params, got model={model!r}, "
            f"num_params={num_params!r}")
    n = _count_params(model) if model is not None else num_params
    sizes = _param_sizes(model) if model is not None else [n]
    if not isinstance(n, int) or n < 0:
        raise MemoryArgumentError(f"estimate: bad num_params, expected an int >= 0, got {n!r}")
    if precision not in _BYTES:
        raise MemoryArgumentError(
            f"estimate: unknown precision, expected one of {list(_BYTES)}, got {precision!r}")
    if optimizer not in _MOMENTS:
        raise MemoryArgumentError(
            f"estimate: unknown optimizer, expected one of {list(_MOMENTS)}, got {optimizer!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise MemoryArgumentError(
            f"estimate: bad zero_stage, expected 0, 1, 2 or 3, got {zero_stage!r}")
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        _check_positive(name, value)
    if rank is not None and (not isinstance(rank, int) or not 0 <= rank < dp):
        raise MemoryArgumentError(
            f"estimate: bad rank, expected an int with 0 <= rank < dp = {dp}, got {rank!r}")
    if not 0 <= margin:
        raise MemoryArgumentError(f"estimate: bad margin, expected >= 0, got {margin!r}")
    bytes_per = bytes_per_activation or (2 if precision == "mixed" else 4)
    shard = None if rank is None else shard_elements(sizes, dp, rank)
    rows = _state_rows(n, precision, optimizer, zero_stage, dp, tp * pp, shard)
    rows.append(_activation_row(batch_shape, width, num_layers, activation_arrays_per_layer,
                                bytes_per, pp, activation_bytes))
    subtotal = sum(r.bytes for r in rows)
    frac = Fraction(str(margin)) if isinstance(margin, float) else Fraction(margin)
    rows.append(LedgerRow("margin", _ceil(frac * subtotal), None, f"{margin} x subtotal"))
    return Ledger(tuple(rows), n)


@dataclass(frozen=True)
class ComparisonRow:
    """Estimate beside measurement for one category (or a total)."""

    name: str
    estimated: int
    measured_peak: int
    rounding: int
    difference: int
    residual: int
    explanation: str


@dataclass(frozen=True)
class Comparison:
    rows: tuple[ComparisonRow, ...]

    def row(self, name: str) -> ComparisonRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise MemoryArgumentError(
            f"compare: unknown row, expected one of {[r.name for r in self.rows]}, got {name!r}")

    def __str__(self) -> str:
        head = (f"{'category':<22}{'estimated':>14}{'measured':>14}{'rounding':>12}"
                f"{'residual':>12}  explanation")
        body = [f"{r.name:<22}{r.estimated:>14,}{r.measured_peak:>14,}{r.rounding:>12,}"
                f"{r.residual:>12,}  {r.explanation}" for r in self.rows]
        return "\n".join([head, *body])


def _explain(name: str, estimated: int, rounding: int, residual: int) -> str:
    if estimated == 0 and rounding + residual > 0:
        return {"workspace": "not estimated: kernel workspaces",
                "other": "not estimated: input batch and untracked temporaries"}.get(
                    name, "not estimated by the ledger")
    if residual > 0:
        return "temporaries alive at the peak beyond the estimate"
    if residual < 0:
        return "estimated bytes never live at once (freed early or not saved)"
    return "allocator rounding to 512 B blocks" if rounding else "exact"


def _row(name: str, estimated: int, peak: int, peak_requested: int) -> ComparisonRow:
    rounding = peak - peak_requested
    residual = peak_requested - estimated
    return ComparisonRow(name, estimated, peak, rounding, peak - estimated, residual,
                         _explain(name, estimated, rounding, residual))


def compare(ledger: Ledger, stats: dict) -> Comparison:
    """Lay the estimate beside the allocator's measured per-category peaks.

    Each category row: ``difference = measured_peak - estimated`` split into ``rounding``
    (block bytes above the requested bytes at the category's peak) and ``residual``
    (requested bytes beyond the estimate), with an explanation. Then the sum of category peaks
    and the overall peak (categories peak at different moments, so the second is smaller).

    Example:
        >>> led = estimate(num_params=100, precision="fp32", optimizer="sgd", margin=0)
        >>> from needle.memory.categories import CATEGORIES
        >>> cats = {c: dict(current=0, peak=0, current_requested=0, peak_requested=0)
        ...         for c in CATEGORIES}
        >>> cats["weight"].update(peak=512, peak_requested=400)
        >>> compare(led, {"peak_bytes": 512, "peak_requested_bytes": 400,
        ...               "by_category": cats}).row("weight").explanation
        'allocator rounding to 512 B blocks'
    """
    estimated = ledger.by_category()
    rows = []
    empty = {"peak": 0, "peak_requested": 0}
    for cat in CATEGORIES:  # a category the stats lack (an older reader's dict) measured 0
        m = stats["by_category"].get(cat, empty)
        rows.append(_row(cat, estimated[cat], m["peak"], m["peak_requested"]))
    summed = ComparisonRow(
        "sum of category peaks", ledger.subtotal_bytes, sum(r.measured_peak for r in rows),
        sum(r.rounding for r in rows), sum(r.difference for r in rows),
        sum(r.residual for r in rows), "upper bound: categories peak at different moments")
    total = _row("peak (all at once)", ledger.subtotal_bytes, stats["peak_bytes"],
                 stats["peak_requested_bytes"])
    margin_left = ledger.total_bytes - stats["peak_bytes"]
    verdict = "within the margin" if margin_left >= 0 else "over the estimate with margin"
    with_margin = ComparisonRow("estimate with margin", ledger.total_bytes, stats["peak_bytes"],
                                0, -margin_left, 0, verdict)
    return Comparison((*rows, summed, total, with_margin))
