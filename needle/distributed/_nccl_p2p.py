"""Point-to-point of ``cuda()`` tensors on an ``nccl`` group: the header through the host
group, the payload through NCCL send/recv on the caller's current stream.

The header keeps what the host path promises: the receiver checks dtype and shape before it
takes the payload (a mismatched payload is drained into a scratch device buffer, so the
sender is never left hanging, and the receive raises naming both sides), and tags still
separate independent streams of headers. NCCL itself matches sends and receives between two
ranks in the order they were issued, not by tag: the cuda() messages from one rank to another
must be received in the order they were sent.
"""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from ._nccl import DeviceBuffer, NcclComm
from ._wire import ARRAY, HEADER_BYTES, Header, pack_header, unpack_header
from ._work import PolledWork, Work


def _described(buf: DeviceBuffer) -> np.ndarray:
    """A zero-stride NumPy array of ``buf``'s dtype and shape: what headers describe."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, buf.dtype), buf.shape,
                                           (0,) * len(buf.shape))


def _deadline(pg: Any, op: str, timeout: float | None) -> SimpleNamespace:
    span = pg.timeout if timeout is None else float(timeout)
    return SimpleNamespace(name=op, timeout=span, deadline=time.monotonic() + span)


def _issue(pg: Any, call: Any, comm: NcclComm, stream: Any) -> Any:
    """Make ``call`` in the group's issue order (after its queued collectives: NCCL needs
    every rank to issue its calls in one order) and return an event recorded after it."""
    def run() -> Any:
        call()
        return comm.event(stream)

    return pg.run(run, False)


def isend(pg: Any, buf: DeviceBuffer, dst: int, tag: int, timeout: float | None,
          blocking: bool = False) -> Work:
    """``blocking`` (``send``): return once the header is sent and the payload queued on the
    stream; the communicator's next wait checks the payload's completion."""
    from .p2p import _waiter

    comm: NcclComm = pg.nccl
    comm.check("isend")
    dt, stream = comm.dtype("isend", buf), comm.stream()
    wait = _waiter(pg, "send", dst, tag, timeout)
    o = _deadline(pg, "send", timeout)
    req = pg.p2p.isend(pack_header(_described(buf), "isend"), dst, 2 * tag)
    event = _issue(pg, lambda: comm.comm.send(buf.ptr, buf.count, dt, dst, int(stream.ptr)),
                   comm, stream)

    call = f"send to {pg.describe(dst)}, tag {tag}"
    if blocking:
        wait(req, "header send")
        comm.pending.append((o, stream, "send", event, call, buf))
        return Work.completed()

    def complete() -> None:
        wait(req, "header send")
        comm.wait(o, stream, "send", event, call=call)
        del keep[:]

    keep = [buf]  # the sent buffer stays allocated until the send is done

    return PolledWork(lambda: bool(req.test() and event.done), complete)


def _post_header(pg: Any, op: str, src: int, tag: int, timeout: float | None) -> tuple:
    """Post the header receive from ``src`` (now: headers keep tag order) and return the
    communicator, the waiter, the header buffer, its request and ``payload(target)``, which
    takes the NCCL payload into ``target`` on the current stream and waits for it."""
    from .p2p import _waiter

    comm: NcclComm = pg.nccl
    comm.check(op)
    stream = comm.stream()
    wait = _waiter(pg, op, src, tag, timeout)
    o = _deadline(pg, op, timeout)
    header = np.empty(HEADER_BYTES, np.uint8)
    req = pg.p2p.irecv(header, src, 2 * tag)

    def payload(target: DeviceBuffer) -> None:
        dt = comm.dtype(op, target)
        event = _issue(pg, lambda: comm.comm.recv(target.ptr, target.count, dt, src,
                                                  int(stream.ptr)), comm, stream)
        comm.wait(o, stream, "recv", event, call=f"recv from {pg.describe(src)}, tag {tag}")

    return comm, wait, header, req, payload


def irecv(pg: Any, buf: DeviceBuffer, src: int, tag: int, timeout: float | None,
          op: str) -> Work:
    """The header receive is posted now (tag order); the NCCL receive once it has arrived."""
    from .p2p import _mismatch

    comm, wait, header, req, payload = _post_header(pg, op, src, tag, timeout)
    want = Header(ARRAY, buf.dtype, buf.shape)

    def complete() -> None:
        wait(req, "header receive")
        got = unpack_header(header, op)
        if got.kind != ARRAY:
            raise _mismatch(pg, op, src, tag, _described(buf), got)
        target = buf if got == want else _scratch(buf, got)
        payload(target)
        if target is not buf:
            raise _mismatch(pg, op, src, tag, _described(buf), got)
        buf.commit()

    return PolledWork(lambda: bool(req.test()), complete)


def _scratch(like: DeviceBuffer, got: Header) -> DeviceBuffer:
    from needle.backend_ndarray.ndarray import NDArray

    nd = NDArray.make(got.shape, device=like.nd.device, dtype=got.dtype)
    return DeviceBuffer(nd, nd)


def irecv_array(pg: Any, src: int, tag: int, timeout: float | None, device: Any,
                op: str = "recv_array") -> Work:
    """Receive the next array message from ``src`` into a new array on ``device``, of the
    dtype and shape its header gives; ``wait()`` returns it. An abort in its place raises
    SenderAborted with the sender's reason (which travels on the host group)."""
    from needle.backend_ndarray.ndarray import NDArray

    from ._errors import MessageError
    from ._wire import ABORT
    from .p2p import _aborted

    comm, wait, header, req, payload = _post_header(pg, op, src, tag, timeout)

    def complete() -> Any:
        wait(req, "header receive")
        got = unpack_header(header, op)
        if got.kind == ABORT:
            reason = np.empty(got.shape, np.uint8)
            wait(pg.p2p.irecv(reason, src, 2 * tag + 1), "abort reason")
            raise _aborted(pg, op, src, tag, reason)
        if got.kind != ARRAY:
            raise MessageError(f"{op}: expected an array message from {pg.describe(src)} "
                               f"(tag {tag}), got {got.describe()}")
        nd = NDArray.make(got.shape, device=device, dtype=got.dtype)
        payload(DeviceBuffer(nd, nd))
        return nd

    return PolledWork(lambda: bool(req.test()), complete)
