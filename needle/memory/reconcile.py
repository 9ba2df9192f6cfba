"""Reconcile one training step: an independent prediction per row beside the measurement.

Every row predicts a category's bytes from things the allocator never saw and lays the
allocator's measurement beside it. The difference is split into named terms; a row holds when
``-low <= gap <= tolerance``. No tolerance is ever computed from a measurement: it is 0 (exact),
a bound from the graph's structure, or the allocator-rounding bound of the shape-only trace.

Two kinds of prediction:

* the ledger and the rules (parameter shapes, bytes per parameter, the optimizer's update);
* the shape-only trace (:mod:`needle.memory.shape_trace`): the same step run before the
  measured one with buffers that have sizes and no bytes, through a simulated allocator with
  the real one's rounding; the kernels' scratch from :mod:`needle.memory.kernel_scratch`. Its
  tolerance ``T`` is 1 MiB per large-pool block (> 1 MiB) live at once in the category, both
  ways, since only where a large block lands is up to the real allocator's cache; 0 when all
  blocks are small.

Rows (fp32, one device; ``r(b)`` = ``b`` in blocks as a fresh segment serves it: rounded up to
512 B, and a large block (> 1 MiB) whole when its segment's rest is 1 MiB or less,
:func:`~needle.memory.caching_allocator.fresh_block_size`; ``M`` = the largest ``r(parameter
bytes)``, ``A`` = the largest activation block of the step; ``L`` = 1 MiB per large parameter
block, the most a cached block can land away from ``r``, both ways; ``T`` as above):

==================================  =====================================================  =====
row                                 prediction (terms)                                     tol.
==================================  =====================================================  =====
weight (peak)                       parameters (ledger) + block rounding + the new          L
                                    weight beside the old one during the update (``M``;
                                    0 where the update is fused: in place)
gradient (peak, above the start)    parameter gradients (ledger) + block rounding + the    T+L
                                    traced peak above the final gradients; without a
                                    trace: gap bounded by gradients in flight               seed +
                                                                                           (2+b)A+M
optimizer (peak)                    moments (ledger) + rounding + the new moment beside    kL
                                    the old one (``M``, when the state existed before
                                    and the update is not fused)
optimizer_temp (peak)               the update's temporaries: ``t x M``, t = Adam 3,       tL
                                    SGD 1, SGD with momentum 3 (1 on its first step),
                                    +1 with weight decay; 0 where the update is fused
activation (end of forward)         traced: the buffers saved for backward + the outputs   T
                                    held that no op saves (under autograd's release
                                    threshold, or still named), in blocks
activation (peak)                   traced: the above + the transients beyond it           T
workspace (peak)                    traced kernel scratch (the C++ matmul's thread-local   T
                                    packing buffers; 0 on the Python allocators)
other (peak, above the start)       what the traced step makes outside ops (BatchNorm      T
                                    running statistics); without a trace: at most ``A``    A
==================================  =====================================================  =====

With small parameters (every block <= 1 MiB) L = 0 and the ledger rows are exact.

A row that cannot be predicted says why and has no tolerance: it is reported as *not
predicted*, never as a match (activation and workspace without a trace; workspace when kernel
scratch is held from before the step, since the C++ packing buffers are thread-local and keep
their largest size; a kernel whose scratch no model describes, e.g. the convolutions).

In flight during backward: the gradient reaching the op being differentiated, the input
gradient it makes (both at most ``A``), the weight gradient it makes (at most ``M``), the seed,
and one partial gradient for each of the ``b`` branch points of the graph (a tensor feeding
several ops, as a residual's input) while backward waits for its other consumers.

Example:
    >>> row = ReconRow("weight", "weight", "peak", 100, (("parameters", 100),), 100, (), 0)
    >>> row.ok, row.gap, row.status
    (True, 0, 'ok')
    >>> ReconRow("workspace", "workspace", "peak", 0, (), 512, (("why", None),), None).status
    'not predicted'
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .caching_allocator import MIN_LARGE_SPLIT, SMALL_LIMIT, fresh_block_size, round_size
from .ledger import Ledger

__all__ = ["ReconRow", "Reconciliation", "UPDATE_TEMPORARIES", "update_temporaries",
           "declared_saved", "buffer_key", "branch_points", "reconcile_step"]

# Parameter-sized arrays an optimizer's update keeps alive at once (needle/optim.py).
UPDATE_TEMPORARIES = {"adam": 3, "adamw": 3, "sgd": 1, "sgd_momentum": 3}


def update_temporaries(optimizer: str, first_step: bool, weight_decay: bool,
                       fused: bool = False) -> int:
    """How many parameter-sized temporaries ``optimizer``'s update holds at most; none when
    the update is ``fused`` (one ``ewise_program`` per parameter, on backends that have it).

    Example:
        >>> update_temporaries("sgd_momentum", True, False), update_temporaries("adam", False, True)
        (1, 4)
        >>> update_temporaries("adam", False, True, fused=True)
        0
    """
    if fused:
        return 0
    t = UPDATE_TEMPORARIES[optimizer]
    if optimizer == "sgd_momentum" and first_step:
        t = 1  # the first momentum is g·(1 - momentum) alone
    return t + (1 if weight_decay else 0)


@dataclass(frozen=True)
class ReconRow:
    """One reconciled quantity: ``predicted`` is the sum of ``terms``; ``gap`` = measured −
    predicted, named by ``gap_terms``; ``ok`` when ``-low <= gap <= tolerance``. With
    ``tolerance`` None the row is *not predicted* (``gap_terms`` say why): not a match, and
    not a failure either."""

    name: str
    category: str
    what: str
    predicted: int
    terms: tuple
    measured: int
    gap_terms: tuple
    tolerance: int | None
    low: int = 0

    @property
    def gap(self) -> int:
        return self.measured - self.predicted

    @property
    def checked(self) -> bool:
        return self.tolerance is not None

    @property
    def ok(self) -> bool:
        return self.tolerance is None or -self.low <= self.gap <= self.tolerance

    @property
    def status(self) -> str:
        if self.tolerance is None:
            return "not predicted"
        return "ok" if self.ok else "OUT OF TOLERANCE"

    def line(self) -> str:
        terms = " + ".join(f"{n} {b:,}" for n, b in self.terms) or "0"
        gap = "; ".join(f"{n} {b:,}" if b is not None else n for n, b in self.gap_terms)
        if self.tolerance is None:
            tol = "none"
        elif self.tolerance == 0 and self.low == 0:
            tol = "exact"
        else:
            tol = (f"+-{self.tolerance:,}" if self.low == self.tolerance
                   else f"<= {self.tolerance:,}")
        predicted = "-" if self.tolerance is None and not self.terms else f"{self.predicted:,}"
        gap_text = "-" if predicted == "-" else f"{self.gap:,}"
        return (f"{self.name:<30}{predicted:>12}{self.measured:>12,}{gap_text:>10}  "
                f"{tol:<12}{self.status:<14} = {terms}" + (f" | gap: {gap}" if gap else ""))


@dataclass(frozen=True)
class Reconciliation:
    rows: tuple

    def row(self, name: str) -> ReconRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"reconciliation: no row {name!r}, expected one of "
                       f"{[r.name for r in self.rows]}")

    @property
    def ok(self) -> bool:
        """No row out of its tolerance (rows not predicted are neither: see ``unpredicted``)."""
        return all(r.ok for r in self.rows)

    @property
    def unpredicted(self) -> tuple:
        """Names of the rows that could not be predicted."""
        return tuple(r.name for r in self.rows if not r.checked)

    def __str__(self) -> str:
        head = (f"{'row':<30}{'predicted':>12}{'measured':>12}{'gap':>10}  {'tolerance':<12}"
                f"{'':<14}   terms")
        return "\n".join([head, *(r.line() for r in self.rows)])


# ---- what the graph declares it saves --------------------------------------------------------
def _arrays(data):
    return data if isinstance(data, tuple) else (data,)


def _buffer(array):
    """(key, requested bytes) of the buffer behind a backend array, None for non-buffers.

    Views share their base's handle object, so the handle's identity is the buffer's."""
    handle = getattr(array, "_handle", None)
    if handle is None:
        return None
    return id(handle), int(handle.size) * np.dtype(str(handle.dtype)).itemsize


def buffer_key(tensor):
    """The key :func:`declared_saved` uses for the buffer behind ``tensor`` (or None)."""
    buf = _buffer(tensor.realize_cached_data())
    return None if buf is None else buf[0]


def branch_points(root) -> int:
    """Non-leaf nodes behind ``root`` that feed more than one op (a residual's input): each
    holds a partial gradient while backward waits for its other consumers."""
    consumers: dict = {}
    seen: set = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for inp in node.inputs:
            if inp.op is not None and inp.requires_grad:
                consumers[id(inp)] = consumers.get(id(inp), 0) + 1
            stack.append(inp)
    return sum(1 for n in consumers.values() if n > 1)


def declared_saved(root, exclude=()) -> tuple[dict, dict, int]:
    """Buffers the recorded graph behind ``root`` holds, before backward.

    Returns ``(saved, unsaved, largest)``: ``saved`` maps buffer key -> requested bytes for the
    buffers some op declares it saves (``save_inputs``/``save_output``, and the arrays the op
    object holds, ``Op.held_arrays``) plus ``root`` itself;
    ``unsaved`` the other non-leaf buffers the graph still holds (not released: under
    autograd's release threshold, or still named); ``largest`` the largest rounded block of any
    non-leaf output, released ones included. The buffers in ``exclude`` (parameters, the input
    batch: not activations) are left out; other leaves an op saves (a dropout mask, one-hot
    targets) count as saved.
    """
    exclude = set(exclude)
    saved: dict = {}
    held: dict = {}
    leaves: set = set()
    largest = 0
    seen: set = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for array in _arrays(node.cached_data):
            if node.op is not None:  # released outputs keep shape and dtype: sizes of all
                nbytes = int(np.prod(array.shape)) * np.dtype(str(array.dtype)).itemsize
                largest = max(largest, round_size(nbytes))
            buf = _buffer(array)
            if buf is None:
                continue
            if node.op is None:
                leaves.add(buf[0])
                continue
            held[buf[0]] = buf[1]
        op = node.op
        if op is not None:
            idx = getattr(op, "save_inputs", None)
            chosen = node.inputs if idx is None else [node.inputs[i] for i in idx]
            if getattr(op, "save_output", False) or node is root:
                chosen = list(chosen) + [node]
            for t in chosen:
                if t.op is None and t.requires_grad:
                    continue  # parameters and other trainable leaves are not activations
                for array in _arrays(t.cached_data):
                    buf = _buffer(array)
                    if buf is not None:
                        saved[buf[0]] = buf[1]
            for array in op.held_arrays() if hasattr(op, "held_arrays") else ():
                buf = _buffer(array)  # a fused op's own intermediates (Op.held_arrays)
                if buf is not None:
                    saved[buf[0]] = buf[1]
        stack.extend(node.inputs)
    saved = {k: v for k, v in saved.items() if k not in exclude}
    unsaved = {k: v for k, v in held.items() if k not in saved and k not in leaves}
    return saved, unsaved, largest


# ---- the rows ---------------------------------------------------------------------------------
def _rounding(sizes) -> int:
    return sum(fresh_block_size(b) - b for b in sizes)


def _not_predicted(name: str, category: str, what: str, measured: int, why: str) -> ReconRow:
    return ReconRow(name, category, what, 0, (), measured, ((why, None),), None)


def _workspace_row(prediction, measured: int, before: int) -> ReconRow:
    name = "workspace"
    if prediction is None:
        return _not_predicted(name, name, "peak", measured, "no shape-only trace (pass build=)")
    if not prediction.scratch_modelled:
        return _not_predicted(name, name, "peak", measured,
                              f"no scratch model for the {prediction.device} kernels")
    if prediction.unmodelled:
        return _not_predicted(name, name, "peak", measured, "the scratch of "
                              + ", ".join(prediction.unmodelled) + " is not modelled")
    if before:
        return _not_predicted(
            name, name, "peak", measured,
            f"{before:,} B of kernel scratch held before the step (thread-local packing "
            f"buffers keep their largest size while their thread lives; the trace starts "
            f"with none, as a fresh process does)")
    peak = prediction.peak(name)
    kept = prediction.end["by_category"][name]["current"]
    tol = prediction.tolerance(name)
    return ReconRow(name, name, "peak", peak,
                    (("thread-local packing buffers (traced)", kept),
                     ("transient scratch (traced)", peak - kept)), measured, (), tol, tol)


# long: one row per category, each with its terms; splitting it would scatter the table
def reconcile_step(*, ledger: Ledger, param_bytes: list, optimizer: str, first_step: bool,
                   weight_decay: bool, largest_activation: int, seed_bytes: int, start: dict,
                   held: dict, end: dict, branches: int = 0, fused_update: bool = False,
                   prediction=None) -> Reconciliation:
    """The rows of the module docstring from predictions and three measurements: per-category
    stats at the start (peaks reset), activation bytes at the end of forward (``held``: the
    by_category dict then) and at the end of the step (``end``). ``prediction``: the step's
    :class:`~needle.memory.shape_trace.StepPrediction` (None: rows that need it are not
    predicted, or bounded)."""
    cats = end["by_category"]
    first = start["by_category"]
    # blocks as a fresh segment serves them; each large one (> 1 MiB) may land up to 1 MiB
    # either way from a cached block: ``big`` bytes of tolerance per large parameter block
    m = max((fresh_block_size(b) for b in param_bytes), default=0)
    big = MIN_LARGE_SPLIT if m > SMALL_LIMIT else 0
    large = MIN_LARGE_SPLIT * sum(1 for b in param_bytes if round_size(b) > SMALL_LIMIT)
    a = largest_activation
    n_bytes = sum(param_bytes)
    rounding = _rounding(param_bytes)
    moments = ledger["optimizer moments"]
    k = moments // max(n_bytes, 1) if n_bytes else 0
    # a fused update rewrites θ and the moments in place (needle.optim): nothing beside them
    beside = 0 if fused_update else m
    tol = large + (big if beside else 0)
    rows = [
        ReconRow("weight", "weight", "peak", ledger["working weights"] + rounding + beside,
                 (("parameters (ledger)", ledger["working weights"]),
                  ("block rounding", rounding), ("new weight beside the old", beside)),
                 cats["weight"]["peak"], (), tol, tol),
    ]
    grads = ledger["gradients"] + rounding
    grad_terms = (("parameter gradients (ledger)", ledger["gradients"]),
                  ("block rounding", rounding))
    grad_peak = cats["gradient"]["peak"] - first["gradient"]["current"]  # the step's own
    if prediction is not None:
        traced = prediction.end["by_category"]["gradient"]
        above = traced["peak"] - traced["current"]
        tol = prediction.tolerance("gradient") + large
        rows.append(ReconRow(
            "gradient", "gradient", "peak", grads + above,
            grad_terms + (("peak above the final gradients (traced)", above),),
            grad_peak, (), tol, tol))
    else:
        rows.append(ReconRow(
            "gradient", "gradient", "peak", grads, grad_terms, grad_peak,
            (("gradients in flight during backward", grad_peak - grads),),
            round_size(seed_bytes) + (2 + branches) * a + m + large))
    state_rounding = k * rounding
    beside = 0 if first_step or not k or fused_update else m
    tol = k * large + (big if beside else 0)
    rows.append(ReconRow(
        "optimizer", "optimizer", "peak", moments + state_rounding + beside,
        (("moments (ledger)", moments), ("block rounding", state_rounding),
         ("new moment beside the old", beside)), cats["optimizer"]["peak"], (), tol, tol))
    t = update_temporaries(optimizer, first_step, weight_decay, fused_update)
    rows.append(ReconRow(
        "optimizer_temp", "optimizer_temp", "peak", t * m,
        ((f"update temporaries ({t} x largest parameter)", t * m),),
        cats["optimizer_temp"]["peak"], (), t * big, t * big))
    base_act = first["activation"]["current"]
    held_act = held["activation"]["current"] - base_act
    peak_act = cats["activation"]["peak"] - base_act
    if prediction is None:
        why = "no shape-only trace (pass build=)"
        rows.append(_not_predicted("activation (end of forward)", "activation", "held",
                                   held_act, why))
        rows.append(_not_predicted("activation (peak)", "activation", "peak", peak_act, why))
    else:
        kept = prediction.held("activation")
        saved = sum(s.block for s in prediction.saved)
        peak = prediction.peak("activation")
        tol = prediction.tolerance("activation")
        rows.append(ReconRow(
            "activation (end of forward)", "activation", "held", kept,
            (("saved for backward (traced)", saved),
             ("outputs held that no op saves (traced)", kept - saved)), held_act, (), tol, tol))
        rows.append(ReconRow(
            "activation (peak)", "activation", "peak", peak,
            (("held at the end of forward (traced)", kept),
             ("transients beyond it (traced)", peak - kept)), peak_act, (), tol, tol))
    rows.append(_workspace_row(prediction, cats["workspace"]["peak"],
                               first["workspace"]["current"]))
    other = cats["other"]["peak"] - first["other"]["current"]  # above the inputs, held before
    why = "made outside ops during the step (BatchNorm running statistics)"
    if prediction is not None:
        tol = prediction.tolerance("other")
        rows.append(ReconRow("other", "other", "peak", prediction.peak("other"),
                             ((why + " (traced)", prediction.peak("other")),), other, (),
                             tol, tol))
    else:
        rows.append(ReconRow("other", "other", "peak", 0, (), other, ((why, None),), a))
    return Reconciliation(tuple(rows))
