"""Arrays of any dtype and shape between two ranks, plus an abort message, on needle's p2p.

Each message is one ``needle.distributed`` array message (``p2p.isend_array`` /
``p2p.recv_array``: a header with dtype and shape, then the payload), so the receiver learns
the shape from the message itself, which is what a pipeline needs: the last micro-batch may be
shorter, a stage's output shape is not known in advance. An *abort* (``p2p.isend_abort``)
carries a text instead: a failing stage sends it in place of every message it still owed, so
that no peer waits for a tensor that will not come. The text starts with the global rank that
failed first (``"1|pipeline: stage 1 (rank 1) failed ..."``), and a stage that passes an abort
on keeps that rank: the receiver's :class:`PipelineAborted` is a ``PeerError`` blaming it, so
the launcher reports the stages that gave up as consequences of that rank, not as causes.

Sends are nonblocking; their Works go to the group's :class:`Outbox`, and ``flush`` waits
for them (the payload buffers stay alive until then, as nonblocking MPI requires).

Tags: a user tag ``t`` (``0 <= t < 2**25``) is the p2p tag ``2t + direction`` (activation 0,
adjoint 1).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from .. import _nccl_p2p, p2p
from .._errors import CommError, PeerError, SenderAborted, rewrap
from .._group import ProcessGroup, resolve

MAX_TAG = 1 << 25
FORWARD, BACKWARD = 0, 1
_DIRECTION = {FORWARD: "activation", BACKWARD: "adjoint"}


class PipelineAborted(PeerError):
    """A peer stage failed and told this rank instead of sending what it owed.

    ``peer`` is the global rank that failed first (``reason`` "failed"): the sender itself, or
    the rank whose abort the sender passed on.
    """

    def __init__(self, message: str, peer: int, reason: str = "failed"):
        super().__init__(message, peer, reason)


class Outbox:
    """Works of nonblocking sends that still have to complete (one per process group)."""

    def __init__(self) -> None:
        self.works: list[Any] = []

    def add(self, work: Any) -> None:
        self.works.append(work)
        if len(self.works) > 256:  # keep the list short in long runs without a flush
            self.works = [w for w in self.works if not w.is_completed()]

    def flush(self) -> None:
        """Wait for every pending send; raise the first failure (after waiting for all)."""
        works, self.works = self.works, []
        first = None
        for w in works:
            try:
                w.wait()
            except CommError as exc:
                first = first or exc
        if first is not None:
            raise first


_OUTBOXES: "weakref.WeakKeyDictionary[ProcessGroup, Outbox]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # thread ranks share this module


def outbox(group: Any) -> Outbox:
    pg = resolve(group, "pipeline")
    with _LOCK:
        box = _OUTBOXES.get(pg)
        if box is None:
            box = _OUTBOXES[pg] = Outbox()
    return box


def wait_sends(group: Any = None) -> None:
    """Wait until every pipeline send of this rank on ``group`` has completed.

    Example:
        >>> import needle.distributed as dist
        >>> dist.spawn_threads(lambda rank: wait_sends(), 2)
        [None, None]
    """
    outbox(group).flush()


def check_tag(op: str, tag: int) -> None:
    if not isinstance(tag, int) or not 0 <= tag < MAX_TAG:
        raise CommError(f"{op}: tag out of range, expected 0 <= tag < {MAX_TAG}, got {tag!r}")


def _p2p_tag(tag: int, direction: int) -> int:
    return 2 * tag + direction


def send_array(pg: ProcessGroup, arr: np.ndarray, dst: int, tag: int, direction: int,
               timeout: float | None = None) -> None:
    """Start sending ``arr`` (contiguous, owned by the message from now on) to ``dst``."""
    outbox(pg).add(p2p.isend_array(arr, dst, tag=_p2p_tag(tag, direction), group=pg,
                                   timeout=timeout))


def send_abort(pg: ProcessGroup, text: str, dst: int, tag: int, direction: int,
               origin: int) -> None:
    """Send an abort in place of the message (``dst``, ``tag``, ``direction``); ``origin`` is
    the global rank that failed first."""
    outbox(pg).add(p2p.isend_abort(f"{origin}|{text}", dst, tag=_p2p_tag(tag, direction),
                                   group=pg))


def _aborted(pg: ProcessGroup, src: int, reason: str) -> PipelineAborted:
    head, sep, text = reason.partition("|")
    if sep and head.isdigit():
        return PipelineAborted(text, int(head))
    return PipelineAborted(reason, pg.ranks[src])  # an abort from outside the pipeline


def recv_array(pg: ProcessGroup, src: int, tag: int, direction: int,
               timeout: float | None = None, device: Any = None) -> Any:
    """Receive the next message (``src``, ``tag``, ``direction``); raise :class:`PipelineAborted`
    when the sender aborted instead, CommError on timeout (naming both ranks and the tag).
    A NumPy array, or on an ``nccl`` group with a ``cuda()`` ``device``, an NDArray there
    (the payload by NCCL, no host copy)."""
    try:
        if getattr(pg, "nccl", None) is not None and getattr(device, "name", None) == "cuda":
            return _nccl_p2p.irecv_array(pg, src, _p2p_tag(tag, direction), timeout,
                                         device).wait()
        return p2p.recv_array(src, tag=_p2p_tag(tag, direction), group=pg, timeout=timeout)
    except SenderAborted as exc:
        raise _aborted(pg, src, exc.reason) from None
    except CommError as exc:  # a PeerError stays one: the launcher blames its peer
        raise rewrap(exc, f"pipeline: rank {pg.rank} receiving the {_DIRECTION[direction]} of "
                          f"pipeline tag {tag} from {pg.describe(src)}: {exc}") from None
