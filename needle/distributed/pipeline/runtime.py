"""The one runtime that executes every schedule's action list, and the schedule classes.

``step(inputs, targets)`` cuts the batch into ``m`` micro-batches (sizes differ by at most
one), runs this rank's actions of the :class:`~.schedules.Plan` in order, and leaves in each
parameter's ``.grad`` the gradient of the full batch's loss: each micro-batch's loss is
scaled by ``n_i / n`` (``loss_reduction="mean"``, the loss function averages over its
micro-batch) or by 1 (``"sum"``), so the accumulated gradient is that of one process on the
whole batch. Gradients accumulate into ``.grad`` as ``backward`` does: reset them between
steps (``optimizer.reset_grad()``).

Failure: an exception on one rank makes it send an *abort* in place of every message it still
owed, then re-raise. A peer waiting for one of those messages raises ``PipelineAborted`` (a
``PeerError`` blaming the rank that failed first) naming the failed stage, rank and action, and
passes the abort on, so the whole pipeline stops at once instead of waiting for timeouts;
anything else still ends in the group's timeout.

Example (two thread ranks, a 2-layer model split in two, 1F1B with 4 micro-batches):
    >>> import numpy as np, needle.distributed as dist
    >>> from needle import nn
    >>> from needle.distributed.pipeline import PipelineStage, Schedule1F1B
    >>> def job(rank):
    ...     np.random.seed(0)
    ...     full = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ...     stage = PipelineStage(full.modules[rank], rank, 2)
    ...     pipe = Schedule1F1B(stage, 4, loss_fn=nn.SoftmaxLoss())
    ...     x = np.ones((8, 3), np.float32); y = np.zeros(8, np.uint8)
    ...     loss = pipe.step(x, y)
    ...     return None if loss is None else round(loss, 4)
    >>> dist.spawn_threads(job, 2)[1] is not None
    True
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from needle.autograd import Tensor, no_grad

from .. import tracing
from .._errors import CommError, PeerError, ShapeError
from . import wire
from .autograd_p2p import Link, LocalSlot, recv_forward, send_forward
from .schedules import Action, Plan, ScheduleError, make_plan, with_communication
from .split_backward import SplitBackward
from .stage import PipelineStage

# Pipeline traffic uses user tags from here up (see wire.py), clear of small user tags.
TAG_BASE = 1 << 24


class _MicroBatch:
    """What one stage keeps about one micro-batch between its actions."""

    __slots__ = ("x", "y", "token", "loss", "split", "in_link", "out_link", "in_like")

    def __init__(self) -> None:
        self.x = self.y = self.token = self.loss = self.split = None
        self.in_link = self.out_link = None
        self.in_like: tuple | None = None  # (shape, dtype) of the received input


class PipelineSchedule:
    """Base of the schedule classes: build the plan, run it, record it.

    Args:
        stages: this rank's :class:`PipelineStage` (a list of them when interleaving).
        n_microbatches: micro-batches per step ``m``.
        loss_fn: ``loss_fn(output, target) -> scalar Tensor``, needed on the last stage's rank.
        loss_reduction: "mean" (loss_fn averages over its micro-batch) or "sum".
        record: time every action and sample ``needle.memory`` (a barrier starts each step,
            so that the ranks' clocks share an origin); :meth:`report` needs it.
        timeout: seconds any receive may wait (default: the group's timeout).
        costs: ``dict(forward=, backward=, weight=, comm=)`` for building the zero-bubble plan.
    """

    name = ""

    def __init__(self, stages: Any, n_microbatches: int, loss_fn: Any = None, *,
                 loss_reduction: str = "mean", record: bool = False,
                 timeout: float | None = None, costs: dict | None = None):
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise ScheduleError(f"{type(self).__name__}: expected PipelineStage(s), got "
                                f"{[type(s).__name__ for s in stages]}")
        pg = stages[0].group
        num_stages = stages[0].num_stages
        if any(s.group is not pg or s.num_stages != num_stages for s in stages):
            raise ScheduleError(f"{type(self).__name__}: every stage must share one group and "
                                "one num_stages")
        if loss_reduction not in ("mean", "sum"):
            raise ScheduleError(f"{type(self).__name__}: loss_reduction must be 'mean' or "
                                f"'sum', got {loss_reduction!r}")
        self.group, self.rank = pg, pg.rank
        self.plan = self._make_plan(pg.size, n_microbatches, num_stages // pg.size, costs or {})
        mine = self.plan.stages_of(self.rank)
        given = sorted(s.stage_index for s in stages)
        if given != mine:
            raise ScheduleError(f"{type(self).__name__}: rank {self.rank} must hold stages "
                                f"{mine} of {self.plan.describe()}, got {given}")
        self.stages = {s.stage_index: s for s in stages}
        if num_stages - 1 in self.stages and loss_fn is None:
            raise ScheduleError(f"{type(self).__name__}: the last stage needs a loss_fn")
        self.loss_fn, self.loss_reduction = loss_fn, loss_reduction
        self.record, self.timeout = record, timeout
        self._params = {k: s.parameters() for k, s in self.stages.items()}
        self._local = LocalSlot()
        self.history: deque = deque(maxlen=64)  # recorded steps (see report)
        self.outputs: list[Any] = []  # last stage: the last step's outputs, per micro-batch
        self._links: dict[tuple, Link] = {}

    # ---- plan ------------------------------------------------------------------------------
    def _make_plan(self, ranks: int, m: int, virtual: int, costs: dict) -> Plan:
        if virtual != 1:
            raise ScheduleError(f"{type(self).__name__}: one stage per rank, got "
                                f"{virtual} per rank (use ScheduleInterleaved1F1B)")
        return make_plan(self.name, ranks, m, **costs)

    @property
    def num_microbatches(self) -> int:
        return self.plan.num_microbatches

    # ---- links -------------------------------------------------------------------------
    def _link(self, edge: int, microbatch: int, towards_next: bool) -> Link:
        """The link of the graph edge between stage ``edge`` and ``edge + 1`` for one
        micro-batch, seen from this rank (peer: the rank on the other side)."""
        key = (edge, microbatch, towards_next)
        link = self._links.get(key)
        if link is None:
            peer = self.plan.rank_of(edge + 1 if towards_next else edge)
            tag = TAG_BASE + microbatch * self.plan.num_stages + edge
            local = self._local if peer == self.rank else None
            link = Link(self.group, peer, tag, self.timeout, local=local)
            self._links[key] = link
        return link

    # ---- data --------------------------------------------------------------------------
    def _split(self, what: str, data: Any, needed: bool) -> list[np.ndarray] | None:
        if not needed:
            return None
        if data is None:
            raise ShapeError(f"{type(self).__name__}.step: this rank holds the "
                             f"{'first' if what == 'inputs' else 'last'} stage, expected "
                             f"{what}, got None")
        arr = data.numpy() if hasattr(data, "numpy") else np.asarray(data)
        m = self.plan.num_microbatches
        if arr.ndim == 0 or arr.shape[0] < m:
            raise ShapeError(f"{type(self).__name__}.step: {what} must hold at least one "
                             f"example per micro-batch, expected >= {m} rows, got shape "
                             f"{arr.shape}")
        # micro-batch i holds rows [n*i//m, n*(i+1)//m): sizes differ by at most one, the
        # larger ones last, the cut gradient accumulation (--accumulate) uses, so a pipeline
        # computes a single process's accumulated step micro-batch for micro-batch
        cuts = [arr.shape[0] * i // m for i in range(m + 1)]
        return [arr[lo:hi] for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]

    # ---- the step ----------------------------------------------------------------------
    def step(self, inputs: Any = None, targets: Any = None) -> float | None:
        """Run one pipelined forward and backward over ``inputs``/``targets`` (needed on the
        ranks of the first/last stage; others may pass None). Returns the batch's loss on the
        last stage's rank, None elsewhere."""
        last = self.plan.num_stages - 1
        actions = self.plan.actions[self.rank]
        self._begin()
        try:
            self._inputs = self._split("inputs", inputs, 0 in self.stages)
            self._targets = self._split("targets", targets, last in self.stages)
            self._scale = self._scales()
            for index, action in enumerate(actions):
                self._position = index
                self._timed(action)
            self._position = len(actions)
            wire.outbox(self.group).flush()
        except BaseException as exc:
            self._abort(exc)
            raise
        finally:
            self._finish()
        return self._loss if last in self.stages else None

    def _begin(self) -> None:
        self._mb: dict[tuple[int, int], _MicroBatch] = {}
        for link in self._links.values():
            link.reset()
        self._local.items.clear()
        self._loss = 0.0
        self._sent: set[tuple[str, int, int]] = set()
        self._position = 0
        self.outputs = []
        self._events: list[tuple] = []
        self._memory = None
        if self.record:
            from needle import memory

            self._memory = memory
            from ..collectives import barrier

            barrier(group=self.group, timeout=self.timeout)
            self._act_base = self._activation_bytes()
        self._t0 = time.perf_counter()

    def _finish(self) -> None:
        self._mb = {}
        self._inputs = self._targets = None
        if self.record and self._events:
            self.history.append({"events": self._events, "base": self._act_base})

    def _scales(self) -> list[float]:
        if self._targets is None:
            return []
        n = sum(len(t) for t in self._targets)
        if self.loss_reduction == "sum":
            return [1.0] * len(self._targets)
        return [len(t) / n for t in self._targets]

    def _activation_bytes(self) -> int:
        device = next(iter(self.stages.values())).device
        return int(self._memory.stats(device)["by_category"]["activation"]["current"])

    def _timed(self, a: Action) -> None:
        start = time.perf_counter() - self._t0
        with tracing.span(a.kind, "pipeline", stage=a.stage, microbatch=a.microbatch):
            getattr(self, "_do_" + a.kind)(a, self._mb.setdefault((a.stage, a.microbatch),
                                                                  _MicroBatch()))
        if self.record:
            end = time.perf_counter() - self._t0
            act = self._activation_bytes() if a.kind in ("F", "B", "W") else -1
            self._events.append((a.kind, a.stage, a.microbatch, start, end, act))

    # ---- actions -----------------------------------------------------------------------
    def _do_RECV_F(self, a: Action, mb: _MicroBatch) -> None:  # noqa: N802 - action names
        stage = self.stages[a.stage]
        mb.in_link = self._link(a.stage - 1, a.microbatch, towards_next=False)
        # requires grad even for a module in eval mode (frozen BatchNorm still passes
        # gradients); forward() runs under no_grad, where nothing is recorded anyway
        mb.x = recv_forward(0, link=mb.in_link, device=stage.device)
        mb.in_like = (tuple(mb.x.shape), str(mb.x.dtype))

    def _stage_input(self, a: Action, mb: _MicroBatch) -> Any:
        if a.stage != 0:
            return mb.x
        # a split backward needs an input that requires grad, so that the stage's own
        # activations count as activation-side (see split_backward.py)
        return Tensor(self._inputs[a.microbatch], device=self.stages[0].device,
                      requires_grad=self.plan.split_backward)

    def _do_F(self, a: Action, mb: _MicroBatch) -> None:  # noqa: N802
        stage = self.stages[a.stage]
        mb.x = self._stage_input(a, mb)
        y = stage.module(mb.x)
        if a.stage == self.plan.num_stages - 1:
            target = Tensor(self._targets[a.microbatch], device=stage.device,
                            requires_grad=False)
            loss = self.loss_fn(y, target)
            self._loss += float(loss.numpy()) * self._scale[a.microbatch]
            self.outputs.append(y.detach())
            mb.loss = loss * self._scale[a.microbatch]
        else:
            mb.y = y

    def _do_SEND_F(self, a: Action, mb: _MicroBatch) -> None:  # noqa: N802
        mb.out_link = self._link(a.stage, a.microbatch, towards_next=True)
        mb.token = send_forward(mb.y, 0, link=mb.out_link)
        mb.y = None  # the token's graph keeps what backward needs
        self._sent.add(("SEND_F", a.stage, a.microbatch))

    def _do_RECV_B(self, a: Action, mb: _MicroBatch) -> None:  # noqa: N802
        mb.out_link.prefetch()

    def _do_B(self, a: Action, mb: _MicroBatch) -> None:  # noqa: N802
        root = mb.loss if mb.loss is not None else mb.token
        if not getattr(root, "requires_grad", False):
            return  # nothing in this stage needs a gradient (its SEND_B then sends zeros)
        if self.plan.split_backward:
            mb.split = SplitBackward(root, self._params[a.stage])
            mb.split.input_grad()
        else:
            root.backward()
            mb.loss = mb.token = mb.x = None

    def _do_SEND_B(self, a: Action, mb: _MicroBatch) -> None:  # noqa: N802
        if not mb.in_link.sent_adjoint:
            # backward never reached the stage's input (the stage ignores it): its gradient
            # is zero, and the previous stage still waits for it
            shape, dtype = mb.in_like
            mb.in_link.send(np.zeros(shape, dtype=dtype), wire.BACKWARD)
        self._sent.add(("SEND_B", a.stage, a.microbatch))

    def _do_W(self, a: Action, mb: _MicroBatch) -> None:  # noqa: N802
        if mb.split is not None:
            mb.split.weight_grad()
        mb.split = mb.loss = mb.token = mb.x = None

    # ---- failure -----------------------------------------------------------------------
    def _origin(self, exc: BaseException) -> int:
        """The global rank whose failure stops the pipeline: a peer this rank's error blames
        (an abort it passes on, a rank that is gone), else this rank itself."""
        peer = getattr(exc, "peer", None)
        return int(peer) if isinstance(exc, PeerError) and peer is not None else \
            self.group.ranks[self.rank]

    def _abort(self, exc: BaseException) -> None:
        """Send an abort in place of every message this rank still owes (best effort)."""
        actions = self.plan.actions[self.rank]
        failed = actions[min(self._position, len(actions) - 1)] if actions else None
        if isinstance(exc, wire.PipelineAborted):
            text = str(exc)
        else:
            text = (f"pipeline: stage {failed.stage if failed else '?'} (rank {self.rank}) "
                    f"failed in {failed} of {self.plan.describe()}: "
                    f"{type(exc).__name__}: {exc}")
        for a in actions:
            if a.kind not in ("SEND_F", "SEND_B") or (a.kind, a.stage, a.microbatch) in self._sent:
                continue
            mb = self._mb.get((a.stage, a.microbatch))
            if a.kind == "SEND_B" and mb is not None and mb.in_link is not None \
                    and mb.in_link.sent_adjoint:
                continue
            edge = a.stage if a.kind == "SEND_F" else a.stage - 1
            link = self._link(edge, a.microbatch, towards_next=a.kind == "SEND_F")
            direction = wire.FORWARD if a.kind == "SEND_F" else wire.BACKWARD
            try:
                if link.local is None:
                    wire.send_abort(self.group, text, link.peer, link.tag, direction,
                                    self._origin(exc))
            except Exception:  # noqa: BLE001 - the original error is what the user needs
                pass

    # ---- forward only (evaluation) ------------------------------------------------------
    def forward(self, inputs: Any = None) -> np.ndarray | None:
        """Forward every micro-batch through the pipeline without recording a graph (set the
        modules to ``eval()`` first for inference). Returns the outputs, concatenated in
        micro-batch order, on the last stage's rank; None elsewhere."""
        last = self.plan.num_stages - 1
        p, m = self.plan.num_ranks, self.plan.num_microbatches
        order = [("F", s, i) for i in range(m) for s in self.plan.stages_of(self.rank)]
        actions = with_communication([order if r == self.rank else [] for r in range(p)],
                                     self.plan.num_stages)[self.rank]
        self._begin()
        outputs = []
        try:
            self._inputs = self._split("inputs", inputs, 0 in self.stages)
            with no_grad():
                for index, a in enumerate(actions):
                    self._position = index
                    mb = self._mb.setdefault((a.stage, a.microbatch), _MicroBatch())
                    if a.kind == "F" and a.stage == last:
                        x = self._stage_input(a, mb)
                        outputs.append(self.stages[a.stage].module(x).numpy())
                    elif a.kind == "F":
                        mb.x = self._stage_input(a, mb)
                        mb.y = self.stages[a.stage].module(mb.x)
                    else:
                        getattr(self, "_do_" + a.kind)(a, mb)
            wire.outbox(self.group).flush()
        except BaseException as exc:
            self._abort_forward(exc, actions)
            raise
        finally:
            self._mb = {}
            self._inputs = None
        return np.concatenate(outputs) if last in self.stages else None

    def _abort_forward(self, exc: BaseException, actions: tuple) -> None:
        text = str(exc) if isinstance(exc, wire.PipelineAborted) else (
            f"pipeline: rank {self.rank} failed in forward: {type(exc).__name__}: {exc}")
        for a in actions[self._position:]:
            if a.kind == "SEND_F" and ("SEND_F", a.stage, a.microbatch) not in self._sent:
                link = self._link(a.stage, a.microbatch, towards_next=True)
                if link.local is None:
                    try:
                        wire.send_abort(self.group, text, link.peer, link.tag, wire.FORWARD,
                                        self._origin(exc))
                    except Exception:  # noqa: BLE001
                        pass

    # ---- measurement -------------------------------------------------------------------
    def report(self, root: int = 0, skip_first: bool = True) -> Any:
        """Measured vs predicted bubble and activation memory of the recorded steps.

        Collective over the pipeline group; returns a :class:`~.report.PipelineReport` on
        group rank ``root`` and None elsewhere. See ``report.py``.
        """
        from .report import gather_report

        return gather_report(self, root, skip_first)


class ScheduleGPipe(PipelineSchedule):
    """All forwards, then all backwards: each stage holds all ``m`` micro-batches."""

    name = "gpipe"


class Schedule1F1B(PipelineSchedule):
    """One forward, one backward: stage ``r`` holds at most ``p - r`` micro-batches."""

    name = "1f1b"


class ScheduleInterleaved1F1B(PipelineSchedule):
    """1F1B over ``v`` model chunks per rank (pass this rank's ``v`` stages: ``r, r + p, ...``);
    the bubble shrinks about ``v``-fold; ``m`` must be a multiple of ``p``."""

    name = "interleaved"

    def _make_plan(self, ranks: int, m: int, virtual: int, costs: dict) -> Plan:
        return make_plan(self.name, ranks, m, virtual_stages=virtual, **costs)


class ScheduleZeroBubble(PipelineSchedule):
    """Backward split into B (input gradient, sent at once) and W (weight gradient, run where
    1F1B would idle); see ``schedules.zero_bubble_order`` and ``split_backward.py``."""

    name = "zero-bubble"


SCHEDULE_CLASSES = {cls.name: cls for cls in (ScheduleGPipe, Schedule1F1B,
                                              ScheduleInterleaved1F1B, ScheduleZeroBubble)}


def schedule_class(name: str) -> type[PipelineSchedule]:
    """The schedule class for a name ("gpipe", "1f1b", "interleaved", "zero-bubble")."""
    from .schedules import canonical_name

    return SCHEDULE_CLASSES[canonical_name(name)]


__all__ = ["PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble", "schedule_class", "CommError"]
