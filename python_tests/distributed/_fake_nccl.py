"""A stand-in for ``cupy.cuda.nccl`` (plus the streams and events it needs) for the CUDA
emulator, where device memory is host memory.

Every call is recorded (``FakeNccl.calls``: kind, rank, count, dtype, op, root or peer, the
stream handle, and whether it was inside groupStart/groupEnd). Calls are asynchronous as in
NCCL: a collective completes when the last rank of the communicator has issued it, and that
rank computes it for everyone, reading and writing the buffers through their addresses. An
event recorded on a stream is done once every NCCL call issued on that stream before it is.

Reductions fold the ranks in order, in the buffer's dtype: ``((x0 op x1) op x2) ...``; the
average divides that sum by the rank count.

With ``processes=True`` (ranks in separate processes) a communicator instead exchanges the
bytes at each call over two private channels of the host group's transport, and every call
is complete when it returns. (Real NCCL chooses ring or tree orders at run
time, so tests compare it with a float64 reference within tolerance, and fake ranks with each
other bitwise.)
"""
from __future__ import annotations

import ctypes
import itertools
import threading
from collections import defaultdict

import numpy as np

from needle._core.dtypes import numpy_dtype

# NCCL's dtype codes; bfloat16 is looked up when a call uses it (ml_dtypes is imported then)
DTYPES = {6: "float16", 7: "float32", 8: "float64", 9: "bfloat16"}
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
_FOLD = {SUM: np.add, AVG: np.add, MAX: np.maximum, MIN: np.minimum, PROD: np.multiply}


def _view(ptr: int, count: int, dtype: int) -> np.ndarray:
    np_dtype = numpy_dtype(DTYPES[dtype])
    raw = (ctypes.c_char * max(count * np_dtype.itemsize, 1)).from_address(ptr)
    return np.frombuffer(raw, dtype=np_dtype, count=count)


class FakeStream:
    """A stream handle; ``with stream:`` makes it the thread's current stream."""

    _ids = itertools.count(0x1000, 0x10)
    _local = threading.local()

    def __init__(self, null: bool = False):
        self.ptr = 0 if null else next(self._ids)

    def __enter__(self):
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._local.stack.pop()


NULL_STREAM = FakeStream(null=True)


def get_current_stream() -> FakeStream:
    stack = FakeStream._local.__dict__.get("stack")
    return stack[-1] if stack else NULL_STREAM


class _Pending:
    """One NCCL operation of one rank, waiting for its peers."""

    def __init__(self) -> None:
        self.done = False


class FakeEvent:
    def __init__(self, block: bool = False, disable_timing: bool = False):
        self._after: list[_Pending] = []

    def record(self, stream: FakeStream) -> None:
        self._after = list(FakeNccl.current.issued[stream.ptr])

    @property
    def done(self) -> bool:
        with FakeNccl.current.lock:
            return all(p.done for p in self._after)


class FakeCommunicator:
    def __init__(self, fake: "FakeNccl", ndev: int, unique_id: tuple, rank: int):
        self.fake, self.size, self.rank = fake, ndev, rank
        self.key = tuple(unique_id)
        self.seq = 0
        self.pair_seq: dict = defaultdict(int)
        self.error: str | None = None
        self.aborted = False
        with fake.lock:
            fake.members[self.key][rank] = self

    # ---- collectives ------------------------------------------------------------------
    def allReduce(self, send, recv, count, dtype, op, stream):  # noqa: N802 - CuPy's names
        self._collective("allReduce", send, recv, count, dtype, op, -1, stream)

    def reduce(self, send, recv, count, dtype, op, root, stream):
        self._collective("reduce", send, recv, count, dtype, op, root, stream)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self._collective("broadcast", send, recv, count, dtype, -1, root, stream)

    def send(self, buf, count, dtype, peer, stream):
        self._p2p("send", buf, count, dtype, peer, stream, (self.rank, peer))

    def recv(self, buf, count, dtype, peer, stream):
        self._p2p("recv", buf, count, dtype, peer, stream, (peer, self.rank))

    def check_async_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"fake NCCL: {self.error}")

    def abort(self) -> None:
        self.aborted = True
        self.fake.log("abort", self.rank)

    def destroy(self) -> None:
        self.fake.log("destroy", self.rank)

    # ---- matching ---------------------------------------------------------------------
    def _collective(self, kind, send, recv, count, dtype, op, root, stream) -> None:
        self.fake.log(kind, self.rank, count=count, dtype=dtype, op=op, root=root,
                      stream=stream)
        with self.fake.lock:
            self.seq += 1
            slot = self.fake.slots[(self.key, "coll", self.seq)]
            slot[self.rank] = (kind, send, recv, count, dtype, op, root, self._pend(stream))
            if len(slot) == self.size:
                self._run(slot)

    def _p2p(self, kind, buf, count, dtype, peer, stream, pair) -> None:
        self.fake.log(kind, self.rank, count=count, dtype=dtype, peer=peer, stream=stream)
        with self.fake.lock:
            self.pair_seq[(kind, peer)] += 1
            slot = self.fake.slots[(self.key, pair, self.pair_seq[(kind, peer)])]
            slot[kind] = (buf, count, dtype, self._pend(stream))
            if len(slot) == 2:
                (sbuf, scount, sdt, spend), (rbuf, rcount, rdt, rpend) = slot["send"], slot["recv"]
                if (scount, sdt) != (rcount, rdt):
                    self._fail(f"send/recv mismatch {scount}x{sdt} vs {rcount}x{rdt}")
                else:
                    _view(rbuf, rcount, rdt)[:] = _view(sbuf, scount, sdt)
                spend.done = rpend.done = True

    def _pend(self, stream: int) -> _Pending:
        pending = _Pending()
        self.fake.issued[stream].append(pending)
        return pending

    def _fail(self, why: str) -> None:
        for member in self.fake.members[self.key].values():
            member.error = why

    def _run(self, slot: dict) -> None:
        first = slot[0]
        if any(v[0] != first[0] or v[3:7] != first[3:7] for v in slot.values()):
            self._fail(f"ranks issued different calls: {sorted(slot.items())}")
        else:
            kind, count, dtype, op, root = first[0], first[3], first[4], first[5], first[6]
            ranks = range(self.size)
            if kind == "broadcast":
                value = _view(slot[root][1], count, dtype).copy()
                for r in ranks:
                    _view(slot[r][2], count, dtype)[:] = value
            else:
                acc = _view(slot[0][1], count, dtype).copy()
                for r in ranks[1:]:
                    acc = _FOLD[op](acc, _view(slot[r][1], count, dtype))
                if op == AVG:
                    acc = acc / acc.dtype.type(self.size)
                for r in ranks if kind == "allReduce" else [root]:
                    _view(slot[r][2], count, dtype)[:] = acc
        for v in slot.values():
            v[7].done = True


class ProcessCommunicator(FakeCommunicator):
    """A fake communicator of one rank among processes: each call exchanges the buffers over
    the host transport (private channels, made in the same order on every rank), so it is
    complete when it returns; sends are buffered by the transport."""

    def __init__(self, fake: "FakeNccl", ndev: int, unique_id: tuple, rank: int):
        from needle.distributed import _group

        super().__init__(fake, ndev, unique_id, rank)
        transport = _group.current_state().transport
        self.coll, self.p2p = transport.channels(2, list(range(ndev)))

    def _collective(self, kind, send, recv, count, dtype, op, root, stream) -> None:
        self.fake.log(kind, self.rank, count=count, dtype=dtype, op=op, root=root,
                      stream=stream)
        self.seq += 1
        mine = _view(send, count, dtype).copy()
        if kind == "broadcast":
            if self.rank == root:
                self._post(mine, [r for r in range(self.size) if r != root])
                _view(recv, count, dtype)[:] = mine
            else:
                _view(recv, count, dtype)[:] = self._take(root, count, dtype)
            return
        if kind == "reduce" and self.rank != root:
            self._post(mine, [root])
            return
        if kind == "allReduce":
            self._post(mine, [r for r in range(self.size) if r != self.rank])
        values = [mine if r == self.rank else self._take(r, count, dtype)
                  for r in range(self.size)]
        acc = values[0].copy()
        for value in values[1:]:
            acc = _FOLD[op](acc, value)
        _view(recv, count, dtype)[:] = acc / acc.dtype.type(self.size) if op == AVG else acc

    def _post(self, data: np.ndarray, peers: list[int]) -> None:
        for r in peers:
            self.coll.isend(data.view(np.uint8), r, self.seq)

    def _take(self, src: int, count: int, dtype: int) -> np.ndarray:
        out = np.empty(count, numpy_dtype(DTYPES[dtype]))
        self._wait(self.coll.irecv(out.view(np.uint8), src, self.seq))
        return out

    def _p2p(self, kind, buf, count, dtype, peer, stream, pair) -> None:
        self.fake.log(kind, self.rank, count=count, dtype=dtype, peer=peer, stream=stream)
        if kind == "send":
            self.p2p.isend(_view(buf, count, dtype).copy().view(np.uint8), peer, 0)
        else:
            out = np.empty(count, numpy_dtype(DTYPES[dtype]))
            self._wait(self.p2p.irecv(out.view(np.uint8), peer, 0))
            _view(buf, count, dtype)[:] = out

    @staticmethod
    def _wait(req) -> None:
        import time

        if not req.wait(time.monotonic() + 60):
            raise RuntimeError("fake NCCL: a peer's bytes did not arrive within 60 s")


class FakeNccl:
    """The module: constants, unique ids, communicators, groups; ``calls`` is the log."""

    current: "FakeNccl"
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = SUM, PROD, MAX, MIN, AVG

    def __init__(self, processes: bool = False) -> None:
        self.processes = processes
        self.lock = threading.RLock()
        self.calls: list[dict] = []
        self.members: dict = defaultdict(dict)
        self.slots: dict = defaultdict(dict)
        self.issued: dict = defaultdict(list)
        self._ids = itertools.count(1)
        self._group = threading.local()
        FakeNccl.current = self

    def log(self, kind: str, rank: int, **fields) -> None:
        with self.lock:
            self.calls.append(dict(kind=kind, rank=rank,
                                   grouped=getattr(self._group, "depth", 0) > 0, **fields))

    def get_unique_id(self) -> tuple:
        return (next(self._ids),) + (0,) * 127

    def NcclCommunicator(self, ndev, unique_id, rank):  # noqa: N802 - CuPy's name
        kind = ProcessCommunicator if self.processes else FakeCommunicator
        return kind(self, ndev, unique_id, rank)

    def groupStart(self) -> None:  # noqa: N802
        self._group.depth = getattr(self._group, "depth", 0) + 1

    def groupEnd(self) -> None:  # noqa: N802
        self._group.depth -= 1

    def of(self, kind: str, rank: int | None = None) -> list[dict]:
        return [c for c in self.calls if c["kind"] == kind and rank in (None, c["rank"])]


_NAMES = ("nccl", "Stream", "Event", "get_current_stream")


def install(fake_cupy, processes: bool = False) -> FakeNccl:
    """Put a fresh fake NCCL, streams (current per thread, as in CuPy: the ranks of a test
    are threads) and events on the emulator's ``cupy.cuda``; :func:`uninstall` puts back
    what was there."""
    fake = FakeNccl(processes)
    cuda = fake_cupy.cuda
    fake.saved = {n: cuda.__dict__[n] for n in _NAMES if n in cuda.__dict__}
    cuda.nccl, cuda.Stream, cuda.Event = fake, FakeStream, FakeEvent
    cuda.get_current_stream = get_current_stream
    return fake


def install_in_this_process() -> FakeNccl:
    """For a rank process a test starts: ``cuda()`` on the CUDA emulator (needle's runtime
    pointed at it) and a fake NCCL that exchanges bytes between the processes."""
    import importlib.util
    import os

    from needle.backend_ndarray._cuda import runtime

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "backend_ndarray",
                        "_cuda_emulator.py")
    spec = importlib.util.spec_from_file_location("_needle_cuda_emulator", path)
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    runtime._cupy, runtime._reason = emulator.FakeCupy(num_sms=2), None
    return install(runtime._cupy, processes=True)


def uninstall(fake_cupy, fake: FakeNccl) -> None:
    for name in _NAMES:
        fake_cupy.cuda.__dict__.pop(name, None)
    fake_cupy.cuda.__dict__.update(fake.saved)
