"""Point-to-point: arrays and objects between two ranks, in needle's one message format.

Every message is a small header (kind, dtype, shape; see ``_wire``) followed by the payload,
on the tags ``2t`` and ``2t + 1`` of user tag ``t``:

* ``send``/``isend`` a Tensor, NDArray or NumPy array, and ``recv``/``irecv`` into a buffer of
  the same dtype and shape: the receiver checks the header before any payload byte lands, so
  a mismatch raises CommError naming both sides instead of corrupting memory;
* ``send_array``/``recv_array``: the same message, but the receiver allocates the array the
  header describes (any shape, 0-d and empty included), up to ``max_bytes``;
* ``send_object``/``recv_object``: Python values (``_wire`` lists the types; no pickle);
* ``isend_abort``: a failing sender's reason in place of the message it owed; the receive
  raises :class:`SenderAborted` with it instead of waiting for the timeout.

Tags separate independent streams between the same ranks. Traffic records count the payload;
headers count as overhead.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from . import _nccl, _nccl_p2p, _waits, tracing, traffic
from ._buffers import borrow
from ._errors import CommError, MessageError, PeerError, SenderAborted, rewrap
from ._group import ProcessGroup, resolve
from ._transport import MailboxRecv, unexpected_limit_bytes
from ._wire import (
    ABORT,
    ARRAY,
    HEADER_BYTES,
    KINDS,
    MAX_REASON_BYTES,
    OBJECT,
    Header,
    check_size,
    decode_object,
    dtype_name,
    encode_object,
    pack_header,
    unpack_header,
)
from ._work import PolledWork, Work

_MAX_TAG = 1 << 28


def _check(op: str, group: Any, peer: int, tag: int, what: str) -> ProcessGroup:
    pg = resolve(group, op)
    pg.check_peer(op, peer, what)
    if not isinstance(tag, int) or not 0 <= tag < _MAX_TAG:
        raise CommError(f"{op}: tag out of range, expected 0 <= tag < {_MAX_TAG}, got {tag!r}")
    return pg


def _waiter(pg: ProcessGroup, op: str, peer: int, tag: int, timeout: float | None):
    span = pg.timeout if timeout is None else float(timeout)
    deadline = pg.deadline(timeout)
    # Taken now, on the caller's thread: what a timeout reports for the wait-for graph.
    site = _waits.call_site()
    key = ("send" if "send" in op else "recv", peer, tag)
    seqs = _sequence(pg)
    seqs[key] += 1
    seq = seqs[key]

    def wait(req: Any, what: str, cancel: bool = True) -> None:
        try:
            done = req.wait(deadline)
        except CommError as exc:
            raise rewrap(exc, f"{op}: rank {pg.rank} failed {what} with {pg.describe(peer)} "
                              f"(tag {tag}): {exc}") from None
        if not done:
            if cancel and req.cancel():
                return  # it landed as the deadline passed: taken, not lost to the next call
            culprit = pg.p2p.global_rank(peer)
            graph = _waits.record_timeout(pg.p2p.global_rank(pg.rank), key[0], culprit, tag,
                                          seq, site)
            raise PeerError(f"{op}: rank {pg.rank} timed out after {span:g} s waiting for "
                            f"{pg.describe(peer)} (tag {tag}, {what}, call {seq} at {site})"
                            + (f"; {graph}" if graph else ""), culprit,
                            "deadlock" if graph.startswith("deadlock") else "timeout")

    return wait


def _sequence(pg: ProcessGroup) -> Counter:
    """How many sends/receives this rank started per (direction, peer, tag) on ``pg``."""
    return pg._p2p_seq


def _started(pg: ProcessGroup) -> dict:
    """Messages whose header a timed-out ``recv`` took, by (src, tag): (header, buffer,
    payload receive). Their payload belongs to the next ``recv`` on that (src, tag), which
    would otherwise wait for a header that never comes."""
    return pg._p2p_started


def _await_payload(pg: ProcessGroup, wait: Any, src: int, tag: int, got: Header,
                   target: np.ndarray, body: Any) -> np.ndarray:
    """Wait for the payload into ``target``; on a timeout keep a receive for it (into a
    buffer of needle's, never the caller's) for the next recv on (src, tag)."""
    try:
        wait(body, "payload receive", cancel=False)
        return target
    except PeerError as exc:
        if exc.reason != "timeout":
            raise
        body.cancel()
        if not isinstance(body, MailboxRecv):
            raise  # MPI: a cancelled receive cannot be told from a matched one here
        if body.test():
            return target  # it arrived while the timeout was raised
        stash = np.empty(got.shape, got.dtype)
        _started(pg)[(src, tag)] = (got, stash, pg.p2p.irecv(stash, src, 2 * tag + 1))
        raise PeerError(f"{exc}; the next recv from {pg.describe(src)} with tag {tag} gets "
                        "this message", exc.peer, exc.reason) from None


def _limit(max_bytes: int | None) -> int:
    """The largest payload a header may announce: ``max_bytes``, by default the transport's
    per-sender bound on held messages (NEEDLE_DIST_MAX_UNEXPECTED_MB)."""
    return unexpected_limit_bytes() if max_bytes is None else int(max_bytes)


def _isend(pg: ProcessGroup, op: str, kind: int, arr: np.ndarray, dst: int, tag: int,
           timeout: float | None) -> Work:
    """Post the header and the payload ``arr`` (contiguous; not to be modified until done)."""
    wait = _waiter(pg, op, dst, tag, timeout)
    record = traffic.open_record(pg, "send", "p2p", arr.nbytes, (arr.nbytes, 0), "send: M")
    with traffic.counting(record), tracing.p2p_span("send", pg, dst, tag, arr.nbytes):
        reqs = [pg.p2p.isend(pack_header(arr, op, kind), dst, 2 * tag),
                pg.p2p.isend(arr, dst, 2 * tag + 1)]

    def complete() -> None:
        for req in reqs:
            wait(req, "send")

    return PolledWork(lambda: all(r.test() for r in reqs), complete)


def isend(tensor: Any, dst: int, group: Any = None, tag: int = 0,
          timeout: float | None = None) -> Work:
    """Start sending ``tensor`` to rank ``dst``; returns a Work (``wait()``, ``is_completed()``).

    The data is captured when isend is called for Tensors/NDArrays; a NumPy array must not be
    modified until the Work completes.

    Example:
        >>> import numpy as np, needle.distributed as dist
        >>> def job(rank):
        ...     x = np.full(3, float(rank), np.float32)
        ...     if rank == 0:
        ...         dist.isend(x, dst=1).wait()
        ...     else:
        ...         dist.recv(x, src=0)
        ...     return x.tolist()
        >>> dist.spawn_threads(job, 2)
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    pg = _check("isend", group, dst, tag, "dst")
    dev = _nccl.route(pg, tensor)
    if dev is not None:  # an nccl group: the payload leaves from the device buffer
        return _nccl_p2p.isend(pg, dev[0], dst, tag, timeout)
    arr = borrow(tensor, "isend", readonly=True).arr
    return _isend(pg, "send", ARRAY, arr, dst, tag, timeout)


def send(tensor: Any, dst: int, group: Any = None, tag: int = 0,
         timeout: float | None = None) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until the transport is done with it.

    Raises:
        CommError: on timeout (naming this rank, ``dst`` and the tag) or if ``dst`` left.
    """
    pg = _check("send", group, dst, tag, "dst")
    dev = _nccl.route(pg, tensor)
    if dev is not None:  # queued on the stream; the next NCCL wait checks it
        _nccl_p2p.isend(pg, dev[0], dst, tag, timeout, blocking=True)
        return
    isend(tensor, dst, group, tag, timeout).wait()


def _mismatch(pg: ProcessGroup, op: str, src: int, tag: int, want: np.ndarray,
              got: Header, reason: np.ndarray | None = None) -> CommError:
    if got.kind == ABORT:
        return _aborted(pg, op, src, tag, reason)
    return CommError(
        f"{op}: sender and receiver disagree on rank {pg.rank} receiving from "
        f"{pg.describe(src)} (tag {tag}), expected {dtype_name(want)} {tuple(want.shape)}, "
        f"got {got.describe()}"
    )


def _aborted(pg: ProcessGroup, op: str, src: int, tag: int,
             reason: np.ndarray | None) -> SenderAborted:
    text = "(its reason did not arrive)" if reason is None else \
        reason.tobytes().decode("utf-8", errors="replace")
    return SenderAborted(f"{op}: {pg.describe(src)} aborted instead of sending to rank "
                         f"{pg.rank} (tag {tag}): {text}", text)


def _expects(buf: np.ndarray) -> Header:
    return Header(ARRAY, dtype_name(buf), tuple(buf.shape))


def recv(tensor: Any, src: int, group: Any = None, tag: int = 0,
         timeout: float | None = None) -> None:
    """Receive into ``tensor`` (in place) from rank ``src``.

    Raises:
        CommError: on timeout, if ``src`` left, or if the sender's dtype/shape differ from
            ``tensor``'s (the payload is then discarded and ``tensor`` left untouched).
        SenderAborted: the sender sent its reason for failing instead (``isend_abort``).
    """
    pg = _check("recv", group, src, tag, "src")
    dev = _nccl.route(pg, tensor)
    if dev is not None:
        _nccl_p2p.irecv(pg, dev[0], src, tag, timeout, "recv").wait()
        return
    buf = borrow(tensor, "recv")
    wait = _waiter(pg, "recv", src, tag, timeout)
    header = np.empty(HEADER_BYTES, np.uint8)
    record = traffic.open_record(pg, "recv", "p2p", buf.arr.nbytes, (0, buf.arr.nbytes),
                                 "recv: M")
    with traffic.counting(record), tracing.p2p_span("recv", pg, src, tag, buf.arr.nbytes):
        started = _started(pg).pop((src, tag), None)
        if started is not None:
            got, target = started[0], _await_payload(pg, wait, src, tag, *started)
        else:
            wait(pg.p2p.irecv(header, src, 2 * tag), "header receive")
            got = unpack_header(header, "recv")
            if got != _expects(buf.arr) and got.nbytes > _limit(None):
                raise _mismatch(pg, "recv", src, tag, buf.arr, got, None)
            # a mismatched payload is drained into scratch, keeping the stream in step
            target = buf.arr if got == _expects(buf.arr) else np.empty(got.shape, got.dtype)
            _await_payload(pg, wait, src, tag, got, target,
                           pg.p2p.irecv(target, src, 2 * tag + 1))
        if got != _expects(buf.arr):
            raise _mismatch(pg, "recv", src, tag, buf.arr, got, target)
        if target is not buf.arr:
            buf.arr[...] = target
    buf.commit()


def irecv(tensor: Any, src: int, group: Any = None, tag: int = 0,
          timeout: float | None = None) -> Work:
    """Start receiving into ``tensor`` from rank ``src``; ``tensor`` is written at ``wait()``.

    The payload lands in a staging buffer and is copied into ``tensor`` only once its header
    matched, so a mismatched message never touches ``tensor``.
    """
    pg = _check("irecv", group, src, tag, "src")
    dev = _nccl.route(pg, tensor)
    if dev is not None:
        return _nccl_p2p.irecv(pg, dev[0], src, tag, timeout, "irecv")
    buf = borrow(tensor, "irecv")
    wait = _waiter(pg, "irecv", src, tag, timeout)
    header = np.empty(HEADER_BYTES, np.uint8)
    staging = np.empty_like(buf.arr)
    record = traffic.open_record(pg, "recv", "p2p", buf.arr.nbytes, (0, buf.arr.nbytes),
                                 "recv: M")
    with traffic.counting(record):
        reqs = [pg.p2p.irecv(header, src, 2 * tag), pg.p2p.irecv(staging, src, 2 * tag + 1)]

    def complete() -> None:
        wait(reqs[0], "header receive")
        got = unpack_header(header, "irecv")
        try:
            wait(reqs[1], "payload receive")
        except CommError:
            if got != _expects(buf.arr):
                raise _mismatch(pg, "irecv", src, tag, buf.arr, got) from None
            raise
        if got != _expects(buf.arr):
            raise _mismatch(pg, "irecv", src, tag, buf.arr, got,
                            staging.reshape(-1).view(np.uint8))
        buf.arr[...] = staging
        buf.commit()

    return PolledWork(lambda: all(r.test() for r in reqs), complete)


# ---- messages the receiver allocates from their header --------------------------------------
class _Incoming:
    """The receive of one message of unknown size: the header first, then the payload into a
    buffer allocated from it (after the size check). ``test`` never blocks."""

    def __init__(self, pg: ProcessGroup, op: str, src: int, tag: int, timeout: float | None,
                 max_bytes: int | None):
        self.pg, self.op, self.src, self.tag = pg, op, src, tag
        self.limit = _limit(max_bytes)
        self.wait = _waiter(pg, op, src, tag, timeout)
        self.raw = np.empty(HEADER_BYTES, np.uint8)
        self.record = traffic.open_record(pg, "recv", "p2p", 0, (0, 0), "recv: M")
        with traffic.counting(self.record):
            self.head = pg.p2p.irecv(self.raw, src, 2 * tag)
        self.header: Header | None = None
        self.payload: np.ndarray | None = None
        self.body: Any = None

    def _post_body(self) -> None:
        if self.body is not None:
            return
        header = unpack_header(self.raw, self.op)
        check_size(header, self.op, self.limit,
                   f"the header from {self.pg.describe(self.src)} (tag {self.tag})")
        self.header, self.payload = header, np.empty(header.shape, header.dtype)
        self.record.payload_bytes = self.record.predicted_recv = self.payload.nbytes
        with traffic.counting(self.record):
            self.body = self.pg.p2p.irecv(self.payload, self.src, 2 * self.tag + 1)

    def test(self) -> bool:
        if self.body is None:
            if not self.head.test():
                return False
            self._post_body()
        return self.body.test()

    def cancel(self) -> None:
        """Give up on the message: a header receive still waiting is withdrawn; once a header
        arrived, its payload is still received here, so the next receive on the tag gets a
        whole message."""
        try:
            if self.body is None:
                self.head.cancel()
                if not self.head.test():
                    return
            self._post_body()
        except CommError:
            pass

    def complete(self, kind: int) -> np.ndarray:
        """Wait for the whole message; raise unless it is of ``kind``."""
        with tracing.p2p_span("recv", self.pg, self.src, self.tag, 0) as args:
            self.wait(self.head, "header receive")
            self._post_body()
            self.wait(self.body, "payload receive")
            assert self.header is not None and self.payload is not None
            args["bytes"] = self.payload.nbytes
        if self.header.kind == ABORT:
            raise _aborted(self.pg, self.op, self.src, self.tag, self.payload)
        if self.header.kind != kind:
            got = self.header.describe()
            raise MessageError(f"{self.op}: rank {self.pg.rank} expected an {KINDS[kind]} "
                               f"message from {self.pg.describe(self.src)} (tag {self.tag}), "
                               f"got {got if kind == ARRAY else 'an array ' + got}")
        return self.payload


class MessageWork(PolledWork):
    """The Work of ``irecv_array``/``irecv_object``: ``wait()`` returns the array or object;
    ``cancel()`` gives the receive up (see ``_Incoming.cancel``)."""

    def __init__(self, incoming: _Incoming, kind: int):
        finish = (lambda: incoming.complete(ARRAY)) if kind == ARRAY else (
            lambda: decode_object(incoming.complete(OBJECT), incoming.op))
        super().__init__(incoming.test, finish)
        self.cancel = incoming.cancel


def _array_of(data: Any, op: str) -> np.ndarray:
    if isinstance(data, np.ndarray) or hasattr(data, "numpy") or hasattr(
            data, "realize_cached_data"):
        return borrow(data, op, readonly=True).arr
    return borrow(np.asarray(data), op, readonly=True).arr


def isend_array(arr: Any, dst: int, *, tag: int = 0, group: Any = None,
                timeout: float | None = None) -> Work:
    """Start sending ``arr`` (a NumPy array, anything ``np.asarray`` takes, a Tensor or an
    NDArray; non-contiguous input is sent compacted) to ``dst``; returns a Work. The message
    is the one ``send`` sends: a receiver may take it with ``recv`` into a matching buffer or
    with :func:`recv_array`. A NumPy array must not be modified until the Work completes.
    """
    pg = _check("send_array", group, dst, tag, "dst")
    dev = _nccl.route(pg, arr)
    if dev is not None:  # the same message, its payload by NCCL (see _nccl_p2p)
        return _nccl_p2p.isend(pg, dev[0], dst, tag, timeout)
    return _isend(pg, "send_array", ARRAY, _array_of(arr, "send_array"), dst, tag, timeout)


def send_array(arr: Any, dst: int, *, tag: int = 0, group: Any = None,
               timeout: float | None = None) -> None:
    """Send ``arr`` to rank ``dst``, whose :func:`recv_array` learns dtype and shape from the
    header (see :func:`isend_array`).

    Raises:
        DTypeError: a dtype outside ``_wire.DTYPES``.
        CommError: more than 8 dimensions, a bad ``dst``/``tag``, a timeout, ``dst`` left.

    Example:
        >>> import numpy as np, needle.distributed as dist
        >>> def job(rank):
        ...     if rank == 0:
        ...         dist.send_array(np.arange(6, dtype=np.int64).reshape(2, 3).T, dst=1, tag=3)
        ...         return None
        ...     got = dist.recv_array(src=0, tag=3)
        ...     return got.dtype.name, got.shape, got.tolist()
        >>> dist.spawn_threads(job, 2)[1]
        ('int64', (3, 2), [[0, 3], [1, 4], [2, 5]])
    """
    isend_array(arr, dst, tag=tag, group=group, timeout=timeout).wait()


def irecv_array(src: int, *, tag: int = 0, group: Any = None, timeout: float | None = None,
                max_bytes: int | None = None) -> MessageWork:
    """Start receiving the next array message from ``src`` on ``tag``; ``wait()`` returns it
    (a new NumPy array of the sender's dtype and shape). See :func:`recv_array`."""
    pg = _check("recv_array", group, src, tag, "src")
    return MessageWork(_Incoming(pg, "recv_array", src, tag, timeout, max_bytes), ARRAY)


def recv_array(src: int, *, tag: int = 0, group: Any = None, timeout: float | None = None,
               max_bytes: int | None = None) -> np.ndarray:
    """Receive the next array message from ``src`` on ``tag`` as a new NumPy array, of the dtype
    and shape its header gives (0-d and empty arrays included).

    Args:
        max_bytes: the largest payload accepted (default: NEEDLE_DIST_MAX_UNEXPECTED_MB,
            the transport's bound on what one sender may make this rank hold).

    Raises:
        MessageError: a malformed header, a payload over ``max_bytes`` (refused before
            anything is allocated), or an object message on this tag.
        SenderAborted: the sender sent its reason for failing instead.
        CommError: a bad ``src``/``tag``, a timeout, ``src`` left.
    """
    return irecv_array(src, tag=tag, group=group, timeout=timeout, max_bytes=max_bytes).wait()


def isend_object(obj: Any, dst: int, *, tag: int = 0, group: Any = None,
                 timeout: float | None = None) -> Work:
    """Start sending ``obj`` to ``dst`` (see :func:`send_object`); returns a Work. The object is
    encoded at once: changing it afterwards does not change the message."""
    pg = _check("send_object", group, dst, tag, "dst")
    payload = encode_object(obj, "send_object")
    return _isend(pg, "send_object", OBJECT, payload, dst, tag, timeout)


def send_object(obj: Any, dst: int, *, tag: int = 0, group: Any = None,
                timeout: float | None = None) -> None:
    """Send a Python value to rank ``dst`` for :func:`recv_object`, without pickle: ``None``,
    bool, int, float, str, bytes, and lists, tuples and dicts (str or int keys) of them; NumPy
    scalars arrive as Python numbers (``needle.distributed._wire`` has the rules).

    Raises:
        ObjectTypeError: a value of another type, named with where it sits in ``obj``.
        CommError: a bad ``dst``/``tag``, a timeout, ``dst`` left.

    Example:
        >>> import needle.distributed as dist
        >>> def job(rank):
        ...     if rank == 0:
        ...         dist.send_object({"loss": 0.25, "steps": (1, 2), 3: None}, dst=1)
        ...         return None
        ...     return dist.recv_object(src=0)
        >>> dist.spawn_threads(job, 2)[1]
        {'loss': 0.25, 'steps': (1, 2), 3: None}
    """
    isend_object(obj, dst, tag=tag, group=group, timeout=timeout).wait()


def irecv_object(src: int, *, tag: int = 0, group: Any = None, timeout: float | None = None,
                 max_bytes: int | None = None) -> MessageWork:
    """Start receiving the next object message from ``src``; ``wait()`` returns the object.
    ``is_completed()`` never blocks, so a server can poll many of these."""
    pg = _check("recv_object", group, src, tag, "src")
    return MessageWork(_Incoming(pg, "recv_object", src, tag, timeout, max_bytes), OBJECT)


def recv_object(src: int, *, tag: int = 0, group: Any = None, timeout: float | None = None,
                max_bytes: int | None = None) -> Any:
    """Receive the next object message from ``src`` on ``tag`` (see :func:`send_object`).

    Raises:
        MessageError: a malformed header or encoding, an encoding over ``max_bytes`` (default
            as :func:`recv_array`), or an array message on this tag.
        SenderAborted: the sender sent its reason for failing instead.
        CommError: a bad ``src``/``tag``, a timeout, ``src`` left.
    """
    return irecv_object(src, tag=tag, group=group, timeout=timeout, max_bytes=max_bytes).wait()


def isend_abort(reason: str, dst: int, *, tag: int = 0, group: Any = None,
                timeout: float | None = None) -> Work:
    """Send ``reason`` (cut to ``MAX_REASON_BYTES``) in place of the message owed to ``dst`` on
    ``tag``: whichever receive takes it (``recv``, ``recv_array``, ``recv_object``...) raises
    :class:`SenderAborted` with the text, instead of waiting for its timeout.

    Example:
        >>> import needle.distributed as dist
        >>> def job(rank):
        ...     if rank == 0:
        ...         isend_abort("stage 0 ran out of memory", dst=1).wait()
        ...         return None
        ...     try:
        ...         recv_array(src=0)
        ...     except dist.CommError as exc:
        ...         return type(exc).__name__, exc.reason
        >>> dist.spawn_threads(job, 2)[1]
        ('SenderAborted', 'stage 0 ran out of memory')
    """
    pg = _check("isend_abort", group, dst, tag, "dst")
    text = str(reason).encode("utf-8", errors="replace")[:MAX_REASON_BYTES]
    payload = np.frombuffer(text, dtype=np.uint8).copy()
    return _isend(pg, "isend_abort", ABORT, payload, dst, tag, timeout)
