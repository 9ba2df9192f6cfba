"""Arrays of any dtype and shape between two ranks, plus an abort message, on needle's p2p.

A message is a small int64 *meta* array (kind, dtype, shape) followed by the payload, both
through ``needle.distributed.isend``/``recv`` (so both carry p2p's dtype+shape check, and a
receive never writes out of bounds). The receiver learns the shape from the meta, which is
what a pipeline needs: the last micro-batch may be shorter, a stage's output shape is not
known in advance. An *abort* message carries a text instead: a failing stage sends it in
place of every message it still owed, so that no peer waits for a tensor that will not come.

Sends are nonblocking; their Works go to the group's :class:`Outbox`, and ``flush`` waits
for them (the payload buffers stay alive until then, as nonblocking MPI requires).

Tags: a user tag ``t`` (``0 <= t < 2**25``) uses the p2p tags ``4t .. 4t + 3``: direction
(activation 0, adjoint 1) times two parts (meta, payload).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from .. import p2p
from .._buffers import MAX_NDIM, check_dtype, dtype_name
from .._errors import CommError
from .._group import ProcessGroup, resolve

MAX_TAG = 1 << 25
_DTYPES = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "bool")
_DATA, _ABORT = 1, 2
FORWARD, BACKWARD = 0, 1
_DIRECTION = {FORWARD: "activation", BACKWARD: "adjoint"}


class PipelineAborted(CommError):
    """A peer stage failed and told this rank instead of sending what it owed."""


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


def _p2p_tag(tag: int, direction: int, part: int) -> int:
    return 4 * tag + 2 * direction + part


def send_array(pg: ProcessGroup, arr: np.ndarray, dst: int, tag: int, direction: int,
               timeout: float | None = None) -> None:
    """Start sending ``arr`` (contiguous, owned by the message from now on) to ``dst``."""
    check_dtype("pipeline send", arr)
    if arr.ndim > MAX_NDIM:
        raise CommError(f"pipeline send: at most {MAX_NDIM} dimensions, got {arr.ndim}")
    meta = np.zeros(3 + MAX_NDIM, np.int64)
    meta[:3] = (_DATA, _DTYPES.index(dtype_name(arr)), arr.ndim)
    meta[3:3 + arr.ndim] = arr.shape
    box = outbox(pg)
    box.add(p2p.isend(meta, dst, pg, _p2p_tag(tag, direction, 0), timeout))
    box.add(p2p.isend(np.ascontiguousarray(arr), dst, pg, _p2p_tag(tag, direction, 1), timeout))


def send_abort(pg: ProcessGroup, text: str, dst: int, tag: int, direction: int) -> None:
    """Send an abort in place of the message (``dst``, ``tag``, ``direction``)."""
    payload = np.frombuffer(text.encode()[:4000], dtype=np.uint8).copy()
    meta = np.zeros(3 + MAX_NDIM, np.int64)
    meta[:4] = (_ABORT, _DTYPES.index("uint8"), 1, payload.size)
    box = outbox(pg)
    box.add(p2p.isend(meta, dst, pg, _p2p_tag(tag, direction, 0)))
    box.add(p2p.isend(payload, dst, pg, _p2p_tag(tag, direction, 1)))


def recv_array(pg: ProcessGroup, src: int, tag: int, direction: int,
               timeout: float | None = None) -> np.ndarray:
    """Receive the next message (``src``, ``tag``, ``direction``); raise :class:`PipelineAborted`
    when the sender aborted instead, CommError on timeout (naming both ranks and the tag)."""
    try:
        return _recv_array(pg, src, tag, direction, timeout)
    except PipelineAborted:
        raise
    except CommError as exc:
        raise CommError(f"pipeline: rank {pg.rank} receiving the {_DIRECTION[direction]} of "
                        f"pipeline tag {tag} from {pg.describe(src)}: {exc}") from None


def _recv_array(pg: ProcessGroup, src: int, tag: int, direction: int,
                timeout: float | None) -> np.ndarray:
    meta = np.zeros(3 + MAX_NDIM, np.int64)
    p2p.recv(meta, src, pg, _p2p_tag(tag, direction, 0), timeout)
    kind, code, ndim = (int(x) for x in meta[:3])
    if kind not in (_DATA, _ABORT) or not 0 <= code < len(_DTYPES) or not 0 <= ndim <= MAX_NDIM:
        raise CommError(f"pipeline recv: malformed message from {pg.describe(src)} (tag {tag}), "
                        f"expected a pipeline meta header, got {meta.tolist()}")
    out = np.empty(tuple(int(d) for d in meta[3:3 + ndim]), dtype=_DTYPES[code])
    p2p.recv(out, src, pg, _p2p_tag(tag, direction, 1), timeout)
    if kind == _ABORT:
        raise PipelineAborted(out.tobytes().decode(errors="replace"))
    return out
