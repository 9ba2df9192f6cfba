"""GPU-native collectives: ``cuda()`` tensors of an ``nccl`` group travel through NCCL.

An ``nccl`` process group is a host group (mpi, tcp or thread) with an NCCL communicator
beside it. The host group carries everything that is not a ``cuda()`` buffer: the NCCL unique
id at start, objects, barriers, the call check that compares what the ranks were asked to do,
and failure reports. A ``cuda()`` tensor goes from its device buffer straight into NCCL on the
caller's current CuPy stream, so it is ordered after the kernels that produced it and before
those that read the result; nothing is copied through host memory.

NCCL calls are asynchronous. Each call records an event after its NCCL kernel and polls that
event until it completes or the group's timeout passes; then the communicator is aborted (a
half-finished collective cannot be resumed) and the call raises a CommError naming the ranks
involved, as the host transports do.

NCCL has no collectives on segments of unequal sizes: ``reduce_scatter_v`` is one ``reduce``
per segment (rooted at the segment's owner) and ``all_gather_v`` one ``broadcast`` per
segment, all in one NCCL group (``groupStart``/``groupEnd``): in place, no padding, no copies.
``all_gather`` into separate tensors is likewise a grouped broadcast per rank and
``reduce_scatter`` a grouped reduce per rank. The summation order is NCCL's own (ring or tree,
chosen by NCCL at run time): results agree with the host backends within rounding, not
bitwise.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

from ._errors import CommError

HOST_ENV = "NEEDLE_DIST_NCCL_HOST"
_ID_SLOTS = 1 + 256  # length, then the unique id's bytes (NCCL's id is 128 bytes)
_DTYPES = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "float16": "NCCL_FLOAT16",
           "bfloat16": "NCCL_BFLOAT16"}
_OPS = {"sum": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN", "mean": "NCCL_AVG"}


class NcclUnavailable(CommError):
    """NCCL was asked for where it cannot run: no CuPy, no NCCL in CuPy, or no GPU."""


def _probe() -> tuple[Any, Any, str]:
    """(cupy, cupy.cuda.nccl, '') when NCCL can run here, else (None, None, why not)."""
    from needle.backend_ndarray._cuda import runtime

    if not runtime.available():
        return None, None, runtime.unavailable_reason()
    cupy = runtime.cupy_module()
    nccl = getattr(cupy.cuda, "nccl", None)
    if nccl is None:
        try:
            from cupy.cuda import nccl  # type: ignore[no-redef]
        except Exception as exc:  # noqa: BLE001 - a CuPy built without NCCL raises various
            return None, None, (f"cupy.cuda.nccl is not importable "
                                f"({type(exc).__name__}: {exc})")
    if not hasattr(nccl, "NcclCommunicator"):
        return None, None, "this CuPy has no NCCL (cupy.cuda.nccl.NcclCommunicator missing)"
    return cupy, nccl, ""


def host_backend(default: Callable[[], str]) -> str:
    """The host transport under NCCL: $NEEDLE_DIST_NCCL_HOST, else ``default()``."""
    host = os.environ.get(HOST_ENV) or default()
    if host not in ("mpi", "tcp"):
        raise CommError(f"init_process_group: bad {HOST_ENV}, expected 'mpi' or 'tcp', "
                        f"got {host!r}")
    return host


# ---- device buffers ----------------------------------------------------------------------
class DeviceBuffer:
    """A ``cuda()`` array seen by NCCL: its address, element count and dtype. ``nd`` is the
    caller's NDArray; when it was not compact, ``work`` is a compact copy written back at
    ``commit()`` (a device copy)."""

    def __init__(self, nd: Any, work: Any):
        self.nd, self.work = nd, work
        handle = work._handle
        self.dtype: str = handle.dtype
        self.itemsize: int = handle.itemsize
        self.count: int = work.size
        self.shape: tuple = tuple(nd.shape)
        self.ptr: int = handle.ptr() + work._offset * handle.itemsize

    def at(self, element: int) -> int:
        """The address of element ``element`` of the flat buffer."""
        return self.ptr + int(element) * self.itemsize

    def commit(self) -> None:
        from needle._core.versions import note_write

        if self.work is not self.nd:
            self.nd[tuple(slice(None) for _ in self.shape)] = self.work
        else:
            note_write(self.work._handle)


def device_buffer(obj: Any) -> DeviceBuffer | None:
    """The DeviceBuffer of a ``cuda()`` Tensor or NDArray, None for anything else."""
    nd = obj.realize_cached_data() if hasattr(obj, "realize_cached_data") else obj
    if getattr(getattr(nd, "device", None), "name", None) != "cuda" or \
            not hasattr(nd, "_handle"):
        return None
    return DeviceBuffer(nd, nd if nd.is_compact() else nd.compact())


def route(pg: Any, *objs: Any) -> list[DeviceBuffer] | None:
    """Device buffers when ``pg`` has NCCL and every object is a ``cuda()`` array; None means
    the host path (numpy arrays, cpu tensors, a mixed CPU/GPU job)."""
    comm = getattr(pg, "nccl", None)
    if comm is None:
        return None
    bufs = [device_buffer(o) for o in objs]
    if any(b is None for b in bufs):
        return None
    return bufs  # type: ignore[return-value]


def signature(where: str, buf: DeviceBuffer, **extra: Any) -> str:
    """The call check's text: marked ``nccl`` so that a rank on the host path (a cpu tensor
    where the others pass cuda() ones) is a mismatch rather than a hang."""
    more = " ".join(f"{k}={v}" for k, v in extra.items())
    return f"{where} nccl {buf.dtype} {buf.shape} {more}".strip()


# ---- the communicator --------------------------------------------------------------------
class NcclComm:
    """One NCCL communicator over the ranks of a host process group.

    ``stream()`` is read on the caller's thread when a collective is issued (CuPy's current
    stream is per thread), and every NCCL call of that collective goes on that stream.
    """

    def __init__(self, group: Any, cupy: Any, nccl: Any, comm: Any):
        self.group, self.cupy, self.nccl, self.comm = group, cupy, nccl, comm
        self.aborted: str | None = None
        # blocking sends return once their payload is queued (a send waiting for its receive
        # would deadlock two ranks that send before they receive); the next wait checks them
        self.pending: list[tuple] = []

    def stream(self) -> Any:
        return self.cupy.cuda.get_current_stream()

    def dtype(self, where: str, buf: DeviceBuffer) -> int:
        name = _DTYPES.get(buf.dtype)
        code = None if name is None else getattr(self.nccl, name, None)
        if code is None:
            usable = tuple(k for k, v in _DTYPES.items() if hasattr(self.nccl, v))
            raise NcclUnavailable(f"{where}: dtype not supported by NCCL here, expected one "
                                  f"of {usable}, got {buf.dtype!r}")
        return int(code)

    def op(self, where: str, op: str) -> tuple[int, bool]:
        """NCCL's reduction code, and whether the sum still has to be divided (``mean``
        where this NCCL has no NCCL_AVG)."""
        code: Any = getattr(self.nccl, _OPS[op], None)
        if code is None:  # only NCCL_AVG is missing from older NCCLs
            return int(self.nccl.NCCL_SUM), True
        return int(code), False

    def check(self, where: str) -> None:
        if self.aborted is not None:
            raise CommError(f"{where}: the NCCL communicator of ranks {self.group.ranks} was "
                            f"aborted ({self.aborted}), expected a working group (start a "
                            "new process group)")

    def grouped(self, calls: list[Callable[[], None]]) -> None:
        """Issue ``calls`` as one NCCL group (one launch; sends and receives cannot deadlock
        each other inside it)."""
        if len(calls) == 1:
            calls[0]()
            return
        self.nccl.groupStart()
        try:
            for call in calls:
                call()
        finally:
            self.nccl.groupEnd()

    def event(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now: done once the NCCL calls before it are."""
        event = self.cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def wait(self, o: Any, stream: Any, what: str, event: Any = None,
             call: str | None = None) -> None:
        """Poll an event recorded after the NCCL kernels (``event``, else one recorded on
        ``stream`` now) until ``o.deadline``; past it, abort the communicator and raise
        naming the ranks involved. ``o`` has name, deadline, timeout, seq and site."""
        while self.pending:  # (o, stream, what, event, call, the buffer kept alive)
            entry = self.pending[0]
            self._poll(*entry[:5])
            self.pending.remove(entry)
        self._poll(o, stream, what, self.event(stream) if event is None else event, call)

    def _poll(self, o: Any, stream: Any, what: str, event: Any, call: str | None) -> None:
        spins = 0
        while not event.done:
            spins += 1
            if spins & 63:
                continue
            if time.monotonic() > o.deadline:
                self.abort(f"{what} timed out")
                call = call or f"collective {o.seq} at {o.site}"
                raise CommError(
                    f"{o.name}: rank {self.group.rank} timed out after {o.timeout:g} s "
                    f"waiting for the NCCL {what} of ranks {self.group.ranks} ({call}); a "
                    f"rank never issued it or its GPU is stuck; the NCCL communicator was "
                    f"aborted")
            time.sleep(1e-4)
        error = getattr(self.comm, "check_async_error", None)
        if error is not None:
            error()

    def abort(self, why: str) -> None:
        self.aborted = why
        abort = getattr(self.comm, "abort", None)
        if abort is not None:
            abort()

    def destroy(self) -> None:
        destroy = getattr(self.comm, "destroy", None)
        if destroy is not None and self.aborted is None:
            destroy()
        self.aborted = self.aborted or "destroyed"


def _use_local_gpu(cupy: Any) -> None:
    """On a machine with several GPUs, rank LOCAL_RANK takes GPU LOCAL_RANK (mod their count):
    NCCL refuses two ranks of one communicator on one GPU."""
    local = os.environ.get("LOCAL_RANK")
    count = int(cupy.cuda.runtime.getDeviceCount())
    if local is not None and local.isdigit() and count > 1:
        cupy.cuda.Device(int(local) % count).use()


def attach(group: Any, required: bool) -> None:
    """Give ``group`` an NCCL communicator when every member has a GPU (``group.nccl``);
    a mixed CPU/GPU group keeps the host path. Every member must call it.

    Raises:
        NcclUnavailable: ``required`` and no member can run NCCL (each says why on its own).
    """
    from .collectives import all_gather, broadcast

    cupy, nccl, reason = _probe()
    mine = np.array([0 if nccl is None else 1], np.int64)
    everyone = [np.zeros(1, np.int64) for _ in range(group.size)]
    all_gather(everyone, mine, group=group)
    have = [int(e[0]) for e in everyone]
    if not all(have):
        if required and not any(have):
            raise NcclUnavailable(f"init_process_group: backend 'nccl' needs CuPy with NCCL "
                                  f"and a GPU, got none on any rank (here: {reason})")
        group.nccl_note = (f"ranks {[r for r, h in enumerate(have) if not h]} have no GPU "
                           "with NCCL: cuda() tensors take the host path")
        return
    ident = np.zeros(_ID_SLOTS, np.int64)
    if group.rank == 0:
        made = tuple(nccl.get_unique_id())
        ident[0] = len(made)
        ident[1:1 + len(made)] = made
    broadcast(ident, src=0, group=group)
    unique_id = tuple(int(x) for x in ident[1:1 + int(ident[0])])
    _use_local_gpu(cupy)
    comm = nccl.NcclCommunicator(group.size, unique_id, group.rank)
    group.nccl = NcclComm(group, cupy, nccl, comm)


# ---- collectives: each returns the body that collectives._launch runs --------------------
Issue = Callable[[NcclComm, int], list]  # (comm, stream handle) -> the NCCL calls to make


def _body(pg: Any, where: str, issue: Issue, writes: list[DeviceBuffer],
          mean: list[tuple[DeviceBuffer, int, int]] | None = None) -> Callable[[Any], None]:
    """Read the current stream now (caller's thread); at run time issue the calls on it as
    one NCCL group, wait with the deadline, then divide ``mean`` ranges (buffer, lo, hi) by
    the group size where NCCL has no NCCL_AVG, and write results back."""
    comm: NcclComm = pg.nccl
    comm.check(where)
    stream = comm.stream()

    def run(o: Any) -> None:
        comm.check(where)
        comm.grouped(issue(comm, int(stream.ptr)))
        comm.wait(o, stream, where)
        for buf, lo, hi in mean or ():
            flat = buf.work.reshape((buf.count,))
            flat[lo:hi] = flat[lo:hi] / float(pg.size)
        for buf in writes:
            buf.commit()

    return run


def _reduction(comm_op: tuple[int, bool], buf: DeviceBuffer, ranges: list[tuple[int, int]]
               ) -> list[tuple[DeviceBuffer, int, int]] | None:
    return [(buf, lo, hi) for lo, hi in ranges] if comm_op[1] else None


def all_reduce(pg: Any, buf: DeviceBuffer, op: str) -> Callable[[Any], None]:
    """ncclAllReduce in place (``bounds`` do not apply: NCCL picks its own order)."""
    comm: NcclComm = pg.nccl
    dt, code = comm.dtype("all_reduce", buf), comm.op("all_reduce", op)

    def issue(c: NcclComm, s: int) -> list:
        return [lambda: c.comm.allReduce(buf.ptr, buf.ptr, buf.count, dt, code[0], s)]

    return _body(pg, "all_reduce", issue, [buf], _reduction(code, buf, [(0, buf.count)]))


def broadcast(pg: Any, buf: DeviceBuffer, src: int) -> Callable[[Any], None]:
    """ncclBroadcast in place from ``src``."""
    dt = pg.nccl.dtype("broadcast", buf)

    def issue(c: NcclComm, s: int) -> list:
        return [lambda: c.comm.broadcast(buf.ptr, buf.ptr, buf.count, dt, src, s)]

    return _body(pg, "broadcast", issue, [buf] if pg.rank != src else [])


def reduce(pg: Any, buf: DeviceBuffer, dst: int, op: str) -> Callable[[Any], None]:
    """ncclReduce in place onto ``dst``; the other ranks' buffers are not written."""
    comm: NcclComm = pg.nccl
    dt, code = comm.dtype("reduce", buf), comm.op("reduce", op)
    mine = pg.rank == dst

    def issue(c: NcclComm, s: int) -> list:
        return [lambda: c.comm.reduce(buf.ptr, buf.ptr, buf.count, dt, code[0], dst, s)]

    return _body(pg, "reduce", issue, [buf] if mine else [],
                 _reduction(code, buf, [(0, buf.count)]) if mine else None)


def all_gather(pg: Any, outs: list[DeviceBuffer], mine: DeviceBuffer) -> Callable[[Any], None]:
    """One broadcast per rank r from its tensor into ``outs[r]``, as one NCCL group."""
    dt = pg.nccl.dtype("all_gather", mine)

    def issue(c: NcclComm, s: int) -> list:
        return [_bcast(c, mine.ptr if r == pg.rank else out.ptr, out.ptr, mine.count, dt, r, s)
                for r, out in enumerate(outs)]

    return _body(pg, "all_gather", issue, outs)


def reduce_scatter(pg: Any, out: DeviceBuffer, ins: list[DeviceBuffer], op: str
                   ) -> Callable[[Any], None]:
    """One reduce per rank r of ``ins[r]`` onto rank r's ``out``, as one NCCL group."""
    comm: NcclComm = pg.nccl
    dt, code = comm.dtype("reduce_scatter", out), comm.op("reduce_scatter", op)

    def issue(c: NcclComm, s: int) -> list:
        return [_reduce(c, x.ptr, out.ptr if r == pg.rank else x.ptr, out.count, dt, code[0],
                        r, s) for r, x in enumerate(ins)]

    return _body(pg, "reduce_scatter", issue, [out], _reduction(code, out, [(0, out.count)]))


def reduce_scatter_v(pg: Any, flat: DeviceBuffer, bounds: list[int], op: str
                     ) -> Callable[[Any], None]:
    """One in-place reduce per non-empty segment, rooted at its owner, as one NCCL group."""
    comm: NcclComm = pg.nccl
    dt, code = comm.dtype("reduce_scatter_v", flat), comm.op("reduce_scatter_v", op)
    segs = [(r, lo, hi) for r, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))
            if hi > lo]

    def issue(c: NcclComm, s: int) -> list:
        return [_reduce(c, flat.at(lo), flat.at(lo), hi - lo, dt, code[0], r, s)
                for r, lo, hi in segs]

    own = [(bounds[pg.rank], bounds[pg.rank + 1])]
    return _body(pg, "reduce_scatter_v", issue, [flat], _reduction(code, flat, own))


def all_gather_v(pg: Any, flat: DeviceBuffer, bounds: list[int]) -> Callable[[Any], None]:
    """One in-place broadcast per non-empty segment from its owner, as one NCCL group."""
    dt = pg.nccl.dtype("all_gather_v", flat)
    segs = [(r, lo, hi) for r, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))
            if hi > lo]

    def issue(c: NcclComm, s: int) -> list:
        return [_bcast(c, flat.at(lo), flat.at(lo), hi - lo, dt, r, s) for r, lo, hi in segs]

    return _body(pg, "all_gather_v", issue, [flat])


def _bcast(c: NcclComm, send: int, recv: int, count: int, dt: int, root: int, s: int
           ) -> Callable[[], None]:
    return lambda: c.comm.broadcast(send, recv, count, dt, root, s)


def _reduce(c: NcclComm, send: int, recv: int, count: int, dt: int, code: int, root: int,
            s: int) -> Callable[[], None]:
    return lambda: c.comm.reduce(send, recv, count, dt, code, root, s)
