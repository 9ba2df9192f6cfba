"""Reconcile one training step: an independent prediction per row beside the measurement.

Every row predicts a category's bytes from things the allocator never saw (parameter shapes,
the ledger's bytes per parameter, the ops' declarations of what they save, the optimizer's
update rule) and lays the allocator's measurement beside it. The difference is split into named
terms; a row holds when ``0 <= gap <= tolerance`` (``tolerance`` 0: the prediction is exact).

Rows (fp32, one device; ``r(b)`` = ``b`` rounded up to the allocator's 512 B blocks, ``M`` = the
largest ``r(parameter bytes)``, ``A`` = the largest activation block of the step):

==================================  =====================================================  =====
row                                 prediction (terms)                                     tol.
==================================  =====================================================  =====
weight (peak)                       parameters (ledger) + block rounding + the new          0
                                    weight beside the old one during the update (``M``;
                                    0 where the update is fused: in place)
gradient (peak)                     parameter gradients (ledger) + block rounding;         seed +
                                    gap: gradients in flight during backward               (2+b)A
                                                                                           + M
optimizer (peak)                    moments (ledger) + rounding + the new moment beside    0
                                    the old one (``M``, when the state existed before
                                    and the update is not fused)
optimizer_temp (peak)               the update's temporaries: ``t x M``, t = Adam 3,       0
                                    SGD 1, SGD with momentum 3 (1 on its first step),
                                    +1 with weight decay; 0 where the update is fused
                                    (a backend with ``ewise_program``: docs of
                                    ``needle.optim``)
activation (end of forward)         what the ops declare they save for backward           0
                                    (``save_inputs``/``save_output``; constants too, like
                                    dropout masks, but not parameters or the input batch),
                                    each buffer once, + rounding; gap: outputs still held
                                    that no op saves (under autograd's release threshold,
                                    or named by you)
activation (peak)                   the same prediction; gap: forward transients           2A
workspace (peak)                    0 (Python allocators); C++ kernel scratch is reported  0 or
                                    but not predicted                                      None
other (peak)                        the inputs given, ``r`` of their bytes; gap: tensors   A
                                    the step makes outside ops (BatchNorm running stats)
==================================  =====================================================  =====

In flight during backward: the gradient reaching the op being differentiated, the input
gradient it makes (both at most ``A``), the weight gradient it makes (at most ``M``), the seed,
and one partial gradient for each of the ``b`` branch points of the graph (a tensor feeding
several ops, as a residual's input) while backward waits for its other consumers.

Example:
    >>> row = ReconRow("weight", "weight", "peak", 100, (("parameters", 100),), 100, (), 0)
    >>> row.ok, row.gap
    (True, 0)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .caching_allocator import round_size
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
    predicted, named by ``gap_terms``; ``ok`` when ``0 <= gap <= tolerance`` (None: not
    asserted, reported only)."""

    name: str
    category: str
    what: str
    predicted: int
    terms: tuple
    measured: int
    gap_terms: tuple
    tolerance: int | None

    @property
    def gap(self) -> int:
        return self.measured - self.predicted

    @property
    def ok(self) -> bool:
        return self.tolerance is None or 0 <= self.gap <= self.tolerance

    def line(self) -> str:
        terms = " + ".join(f"{n} {b:,}" for n, b in self.terms) or "0"
        gap = "; ".join(f"{n} {b:,}" if b is not None else n for n, b in self.gap_terms)
        tol = "reported" if self.tolerance is None else (
            "exact" if self.tolerance == 0 else f"<= {self.tolerance:,}")
        verdict = "ok" if self.ok else "OUT OF TOLERANCE"
        return (f"{self.name:<30}{self.predicted:>12,}{self.measured:>12,}{self.gap:>10,}  "
                f"{tol:<12}{verdict:<6} = {terms}" + (f" | gap: {gap}" if gap else ""))


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
        return all(r.ok for r in self.rows)

    def __str__(self) -> str:
        head = (f"{'row':<30}{'predicted':>12}{'measured':>12}{'gap':>10}  {'tolerance':<12}"
                f"{'':<6}   terms")
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
    return sum(round_size(b) - b for b in sizes)


def reconcile_step(*, ledger: Ledger, param_bytes: list, optimizer: str, first_step: bool,
                   weight_decay: bool, saved: dict, unsaved: dict, largest_activation: int,
                   input_bytes: list, seed_bytes: int, start: dict, held: dict, end: dict,
                   python_allocator: bool, branches: int = 0,
                   fused_update: bool = False) -> Reconciliation:
    """The rows of the module docstring from predictions and three measurements: per-category
    stats at the start (peaks reset), activation bytes at the end of forward (``held``: the
    by_category dict then) and at the end of the step (``end``)."""
    cats = end["by_category"]
    m = max((round_size(b) for b in param_bytes), default=0)
    a = largest_activation
    n_bytes = sum(param_bytes)
    rounding = _rounding(param_bytes)
    moments = ledger["optimizer moments"]
    k = moments // max(n_bytes, 1) if n_bytes else 0
    # a fused update rewrites θ and the moments in place (needle.optim): nothing beside them
    beside = 0 if fused_update else m
    rows = [
        ReconRow("weight", "weight", "peak", ledger["working weights"] + rounding + beside,
                 (("parameters (ledger)", ledger["working weights"]),
                  ("block rounding", rounding), ("new weight beside the old", beside)),
                 cats["weight"]["peak"], (), 0),
    ]
    grads = ledger["gradients"] + rounding
    rows.append(ReconRow(
        "gradient", "gradient", "peak", grads,
        (("parameter gradients (ledger)", ledger["gradients"]), ("block rounding", rounding)),
        cats["gradient"]["peak"],
        (("gradients in flight during backward", cats["gradient"]["peak"] - grads),),
        round_size(seed_bytes) + (2 + branches) * a + m))
    state_rounding = k * rounding
    beside = 0 if first_step or not k or fused_update else m
    rows.append(ReconRow(
        "optimizer", "optimizer", "peak", moments + state_rounding + beside,
        (("moments (ledger)", moments), ("block rounding", state_rounding),
         ("new moment beside the old", beside)), cats["optimizer"]["peak"], (), 0))
    t = update_temporaries(optimizer, first_step, weight_decay, fused_update)
    rows.append(ReconRow(
        "optimizer_temp", "optimizer_temp", "peak", t * m,
        ((f"update temporaries ({t} x largest parameter)", t * m),),
        cats["optimizer_temp"]["peak"], (), 0))
    declared = sum(saved.values())
    declared_rounding = _rounding(saved.values())
    base_act = start["by_category"]["activation"]["current"]
    held_act = held["activation"]["current"] - base_act
    unsaved_blocks = sum(round_size(b) for b in unsaved.values())
    act_terms = (("saved by the ops (declared)", declared), ("block rounding",
                                                             declared_rounding))
    rows.append(ReconRow(
        "activation (end of forward)", "activation", "held", declared + declared_rounding,
        act_terms, held_act, (("outputs held that no op saves", unsaved_blocks),),
        unsaved_blocks))
    rows.append(ReconRow(
        "activation (peak)", "activation", "peak", declared + declared_rounding, act_terms,
        cats["activation"]["peak"] - base_act,
        (("outputs held that no op saves", unsaved_blocks),
         ("forward transients", None)), unsaved_blocks + 2 * a))
    rows.append(ReconRow(
        "workspace", "workspace", "peak", 0, (), cats["workspace"]["peak"],
        () if python_allocator else (("C++ kernel scratch (not predicted)", None),),
        0 if python_allocator else None))
    inputs = sum(round_size(b) for b in input_bytes)
    rows.append(ReconRow(
        "other", "other", "peak", inputs, (("inputs given", inputs),),
        cats["other"]["peak"] - (start["by_category"]["other"]["current"] - inputs),
        (("made outside ops during the step (BatchNorm running statistics)", None),), a))
    return Reconciliation(tuple(rows))
