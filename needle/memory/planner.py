"""Liveness-based buffer planning: place a graph's intermediates in one arena.

A pure function of sizes and lifetimes: no device, no autograd. A tensor is live on the closed
step interval ``[def_index, last_use]``; two tensors whose intervals intersect must not share
bytes (so an op's inputs and outputs never alias). Sizes are rounded up to ``alignment``.

Heuristic (``strategy="greedy_by_size"``, the one TFLite's and NNVM's arena planners use): sort
tensors by size, largest first (ties: earlier definition, then smaller id), and put each at the
lowest offset where it overlaps no already placed tensor whose lifetime intersects its own.
``"first_fit"`` places in definition order instead. ``"two_sided"`` applies when no more than
two tensors are ever live together (a chain): the conflict graph is then bipartite, and putting
one colour at offset 0 and the other flush with the top of an arena of ``lower_bound_bytes``
is exact. ``"auto"`` (default) runs every applicable strategy and keeps the smallest arena
(the earliest in that order on ties), so chains always reach the lower bound.

Example:
    >>> p = plan([(100, 0, 1), (100, 1, 2), (100, 2, 3)], alignment=1)
    >>> p.peak_bytes, p.naive_bytes, p.lower_bound_bytes
    (200, 300, 200)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ._errors import MemoryArgumentError, MemoryPlanError

__all__ = ["TensorSpec", "OpNode", "Graph", "Plan", "plan", "lower_bound", "STRATEGIES"]

PHASES = ("forward", "backward", "other")  # other: outside any op (optimiser, data)
KINDS = ("input", "parameter", "intermediate", "output")
STRATEGIES = ("auto", "greedy_by_size", "first_fit", "two_sided")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a traced graph.

    ``kind`` says who owns its memory: only ``intermediate`` tensors are planned; inputs,
    parameters and outputs live outside the arena.
    """

    id: int
    nbytes: int
    def_index: int
    last_use: int
    producer: str | None = None
    consumers: tuple[str, ...] = ()
    phase: str = "forward"
    kind: str = "intermediate"


@dataclass(frozen=True)
class OpNode:
    """One step of a traced graph: the op's name, the tensor ids it read and made, and its
    phase (names and ids only, so a graph keeps no op or array alive)."""

    index: int
    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    phase: str = "forward"


@dataclass(frozen=True)
class Graph:
    """Tensors with their lifetimes, and (when traced) the ops that produce and use them."""

    tensors: tuple[TensorSpec, ...]
    ops: tuple[OpNode, ...] = ()

    def __post_init__(self) -> None:
        _validate(self.tensors)

    @classmethod
    def from_lifetimes(cls, lifetimes: Iterable[Sequence[int]]) -> "Graph":
        """``[(nbytes, def_index, last_use), ...]`` → a graph of intermediates with ids 0..n-1."""
        specs = []
        for i, item in enumerate(lifetimes):
            if len(item) != 3:
                raise MemoryArgumentError(
                    f"plan: bad lifetime #{i}, expected (nbytes, def_index, last_use), "
                    f"got {item!r}")
            specs.append(TensorSpec(i, *(int(v) for v in item)))
        return cls(tuple(specs))

    @classmethod
    def from_ops(cls, ops: Sequence[OpNode], nbytes: dict[int, int],
                 kinds: dict[int, str] | None = None) -> "Graph":
        """Derive every tensor's lifetime, producer and consumers from an op sequence.

        Tensors never produced by an op are inputs defined at step 0 unless ``kinds`` says
        otherwise; a tensor no op reads lives until its definition step (outputs: to the end).
        """
        kinds = dict(kinds or {})
        info: dict[int, dict] = {}
        for node in ops:
            for t in node.outputs:
                info.setdefault(t, {"def": node.index, "last": node.index, "cons": [],
                                    "prod": node.name, "phase": node.phase})
            for t in node.inputs:
                row = info.setdefault(t, {"def": 0, "last": 0, "cons": [], "prod": None,
                                          "phase": node.phase})
                row["last"] = max(row["last"], node.index)
                row["cons"].append(node.name)
        end = max((n.index for n in ops), default=0)
        specs = []
        for t, row in sorted(info.items()):
            kind = kinds.get(t, "intermediate" if row["prod"] is not None else "input")
            last = end if kind == "output" else row["last"]
            specs.append(TensorSpec(t, int(nbytes[t]), row["def"], last, row["prod"],
                                    tuple(row["cons"]), row["phase"], kind))
        return cls(tuple(specs), tuple(ops))

    def planned(self) -> tuple[TensorSpec, ...]:
        """The tensors that go into the arena."""
        return tuple(t for t in self.tensors if t.kind == "intermediate")


def _validate(tensors: Sequence[TensorSpec]) -> None:
    seen = set()
    for t in tensors:
        if t.id in seen:
            raise MemoryPlanError(f"plan: duplicate tensor id, expected unique ids, got {t.id}")
        seen.add(t.id)
        if t.nbytes < 0 or t.def_index < 0 or t.last_use < t.def_index:
            raise MemoryPlanError(
                f"plan: bad tensor {t.id}, expected nbytes >= 0 and 0 <= def_index <= last_use, "
                f"got nbytes={t.nbytes}, def_index={t.def_index}, last_use={t.last_use}")
        if t.phase not in PHASES or t.kind not in KINDS:
            raise MemoryPlanError(
                f"plan: bad tensor {t.id}, expected phase in {PHASES} and kind in {KINDS}, "
                f"got phase={t.phase!r}, kind={t.kind!r}")


@dataclass(frozen=True)
class Plan:
    """Result of :func:`plan`: arena size, bounds, and each tensor's offset and (aligned) size."""

    peak_bytes: int
    naive_bytes: int
    lower_bound_bytes: int
    assignments: dict[int, int]
    sizes: dict[int, int]
    strategy: str
    graph: Graph = field(repr=False)

    def run(self, *inputs):
        """Execute the traced call again with every intermediate in one arena.

        Needs a graph from :func:`needle.memory.trace`; returns what the call returns. See
        :mod:`needle.memory.replay`.
        """
        from .replay import run_plan  # lazy: replay needs a device, the planner does not

        return run_plan(self, *inputs)

    def __str__(self) -> str:
        return (f"Plan({len(self.assignments)} tensors, arena {self.peak_bytes} B, lower bound "
                f"{self.lower_bound_bytes} B, naive {self.naive_bytes} B, {self.strategy})")


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def lower_bound(intervals: Sequence[tuple[int, int, int]]) -> int:
    """Largest total size live at one step, for ``(size, def_index, last_use)`` triples.

    Example:
        >>> lower_bound([(5, 0, 2), (7, 1, 1), (9, 3, 4)])
        12
    """
    # Sweep: +size at def, -size after last use; at equal steps apply ends first.
    points = sorted([(d, 1, s) for s, d, _ in intervals]
                    + [(e + 1, 0, -s) for s, _, e in intervals])
    live = best = 0
    for _, _, delta in points:
        live += delta
        best = max(best, live)
    return best


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def _place(order, size, life) -> dict[int, int]:
    """Lowest-offset placement of ids in ``order`` (the core of greedy-by-size and first-fit)."""
    offsets: dict[int, int] = {}
    placed: list[int] = []
    for t in order:
        busy = sorted((offsets[u], size[u]) for u in placed if _overlaps(life[t], life[u]))
        cursor = 0
        for start, length in busy:
            if start >= cursor + size[t]:
                break
            cursor = max(cursor, start + length)
        offsets[t] = cursor
        placed.append(t)
    return offsets


def _two_sided(ids, size, life, height: int) -> dict[int, int] | None:
    """Exact placement when at most two tensors are live together; ``None`` otherwise."""
    by_start = sorted(ids, key=lambda t: (life[t][0], t))
    neighbours: dict[int, list[int]] = {t: [] for t in ids}
    active: list[int] = []
    for t in by_start:
        active = [u for u in active if life[u][1] >= life[t][0]]
        if len(active) >= 2:
            return None
        for u in active:
            neighbours[t].append(u)
            neighbours[u].append(t)
        active.append(t)
    # An interval graph with no triangle is a forest: 2-colour it by walking each tree.
    colour: dict[int, int] = {}
    for root in by_start:
        if root in colour:
            continue
        colour[root], stack = 0, [root]
        while stack:
            t = stack.pop()
            for u in neighbours[t]:
                if u not in colour:
                    colour[u] = 1 - colour[t]
                    stack.append(u)
    return {t: 0 if colour[t] == 0 else height - size[t] for t in ids}


def _arena(offsets: dict[int, int], size: dict[int, int]) -> int:
    return max((offsets[t] + size[t] for t in offsets), default=0)


def plan(graph, *, alignment: int = 256, strategy: str = "auto") -> Plan:
    """Assign every intermediate of ``graph`` an offset in one arena.

    Args:
        graph: a :class:`Graph`, or ``[(nbytes, def_index, last_use), ...]``.
        alignment: sizes are rounded up to a multiple of this (offsets stay multiples of it).
        strategy: one of :data:`STRATEGIES` (see the module docstring).

    Returns:
        A :class:`Plan`; ``peak_bytes >= lower_bound_bytes`` always, with equality on chains.

    Raises:
        MemoryArgumentError: bad ``alignment`` or ``strategy``.
        MemoryPlanError: malformed tensors.

    Example:
        >>> plan([(64, i, i + 1) for i in range(10)], alignment=64).peak_bytes
        128
    """
    if not isinstance(alignment, int) or alignment < 1:
        raise MemoryArgumentError(f"plan: bad alignment, expected an int >= 1, got {alignment!r}")
    if strategy not in STRATEGIES:
        raise MemoryArgumentError(
            f"plan: unknown strategy, expected one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(graph, Graph):
        graph = Graph.from_lifetimes(graph)
    specs = graph.planned()
    size = {t.id: _align(t.nbytes, alignment) for t in specs}
    life = {t.id: (t.def_index, t.last_use) for t in specs}
    ids = [t.id for t in specs]
    bound = lower_bound([(size[t], *life[t]) for t in ids])
    candidates = []
    if strategy in ("auto", "greedy_by_size"):
        order = sorted(ids, key=lambda t: (-size[t], life[t][0], t))
        candidates.append(("greedy_by_size", _place(order, size, life)))
    if strategy in ("auto", "first_fit"):
        order = sorted(ids, key=lambda t: (life[t][0], -size[t], t))
        candidates.append(("first_fit", _place(order, size, life)))
    if strategy in ("auto", "two_sided"):
        offsets = _two_sided(ids, size, life, bound)
        if offsets is None and strategy == "two_sided":
            raise MemoryPlanError(
                "plan: two_sided needs at most two tensors live at once, expected a chain, "
                "got three or more live together")
        if offsets is not None:
            candidates.append(("two_sided", offsets))
    name, offsets = min(candidates, key=lambda c: _arena(c[1], size))
    return Plan(_arena(offsets, size), sum(size.values()), bound, offsets, size, name, graph)
