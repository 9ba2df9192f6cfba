"""Point-to-point: send, recv, isend, irecv of Tensors, NDArrays and NumPy arrays.

Every message is preceded by a small header (dtype and shape). The receiver checks it against
its own buffer before any payload byte lands there, so a mismatch raises CommError naming both
sides instead of corrupting memory. Tags separate independent streams between the same ranks.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import traffic
from ._buffers import HEADER_BYTES, borrow, dtype_name, pack_header, unpack_header
from ._errors import CommError, PeerError, rewrap
from ._group import ProcessGroup, resolve
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

    def wait(req: Any, what: str) -> None:
        try:
            done = req.wait(deadline)
        except CommError as exc:
            raise rewrap(exc, f"{op}: rank {pg.rank} failed {what} with {pg.describe(peer)} "
                              f"(tag {tag}): {exc}") from None
        if not done:
            req.cancel()
            raise PeerError(f"{op}: rank {pg.rank} timed out after {span:g} s waiting for "
                            f"{pg.describe(peer)} (tag {tag}, {what})",
                            pg.p2p.global_rank(peer), "timeout")

    return wait


def _describe(dtype: str, shape: tuple) -> str:
    return f"{dtype} {tuple(shape)}"


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
    arr = borrow(tensor, "isend", readonly=True).arr
    wait = _waiter(pg, "send", dst, tag, timeout)
    record = traffic.open_record(pg, "send", "p2p", arr.nbytes, (arr.nbytes, 0), "send: M")
    with traffic.counting(record):
        reqs = [pg.p2p.isend(pack_header(arr, "send"), dst, 2 * tag),
                pg.p2p.isend(arr, dst, 2 * tag + 1)]

    def complete() -> None:
        for req in reqs:
            wait(req, "send")

    return PolledWork(lambda: all(r.test() for r in reqs), complete)


def send(tensor: Any, dst: int, group: Any = None, tag: int = 0,
         timeout: float | None = None) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until the transport is done with it.

    Raises:
        CommError: on timeout (naming this rank, ``dst`` and the tag) or if ``dst`` left.
    """
    isend(tensor, dst, group, tag, timeout).wait()


def _mismatch(pg: ProcessGroup, op: str, src: int, tag: int, want: np.ndarray,
              got: tuple[str, tuple]) -> CommError:
    return CommError(
        f"{op}: sender and receiver disagree on rank {pg.rank} receiving from "
        f"{pg.describe(src)} (tag {tag}), expected {_describe(dtype_name(want), want.shape)}, "
        f"got {_describe(*got)}"
    )


def recv(tensor: Any, src: int, group: Any = None, tag: int = 0,
         timeout: float | None = None) -> None:
    """Receive into ``tensor`` (in place) from rank ``src``.

    Raises:
        CommError: on timeout, if ``src`` left, or if the sender's dtype/shape differ from
            ``tensor``'s (the payload is then discarded and ``tensor`` left untouched).
    """
    pg = _check("recv", group, src, tag, "src")
    buf = borrow(tensor, "recv")
    wait = _waiter(pg, "recv", src, tag, timeout)
    header = np.empty(HEADER_BYTES, np.uint8)
    record = traffic.open_record(pg, "recv", "p2p", buf.arr.nbytes, (0, buf.arr.nbytes),
                                 "recv: M")
    with traffic.counting(record):
        wait(pg.p2p.irecv(header, src, 2 * tag), "header receive")
        got = unpack_header(header, "recv")
        if got != (dtype_name(buf.arr), tuple(buf.arr.shape)):
            drain = np.empty(int(np.prod(got[1], dtype=np.int64)), dtype=np.dtype(got[0]))
            wait(pg.p2p.irecv(drain, src, 2 * tag + 1), "payload receive")
            raise _mismatch(pg, "recv", src, tag, buf.arr, got)
        wait(pg.p2p.irecv(buf.arr, src, 2 * tag + 1), "payload receive")
    buf.commit()


def irecv(tensor: Any, src: int, group: Any = None, tag: int = 0,
          timeout: float | None = None) -> Work:
    """Start receiving into ``tensor`` from rank ``src``; ``tensor`` is written at ``wait()``.

    The payload lands in a staging buffer and is copied into ``tensor`` only once its header
    matched, so a mismatched message never touches ``tensor``.
    """
    pg = _check("irecv", group, src, tag, "src")
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
        expected = (dtype_name(buf.arr), tuple(buf.arr.shape))
        try:
            wait(reqs[1], "payload receive")
        except CommError:
            if got != expected:
                raise _mismatch(pg, "irecv", src, tag, buf.arr, got) from None
            raise
        if got != expected:
            raise _mismatch(pg, "irecv", src, tag, buf.arr, got)
        buf.arr[...] = staging
        buf.commit()

    return PolledWork(lambda: all(r.test() for r in reqs), complete)
