"""MPI transport through mpi4py: Isend/Irecv polled against a deadline, native collectives.

Every blocking wait is a poll on MPI_Test so that it can time out; MPI has no timeouts itself.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._errors import CommError, PeerError
from ._transport import Channel, Request, poll_until


def _mpi() -> Any:
    from mpi4py import MPI  # imported lazily: needle works without an MPI library

    return MPI


class MpiRequest(Request):
    def __init__(self, req: Any, nbytes: int, is_recv: bool, peer: int):
        self.req = req
        self.nbytes = nbytes
        self.is_recv = is_recv
        self.peer = peer  # global rank, for blame
        self.status = _mpi().Status() if is_recv else None
        self.done = False
        self.error: str | None = None
        self.failed_peer = False

    def test(self) -> bool:
        if not self.done:
            self._progress()
        if self.error:
            if self.failed_peer:
                raise PeerError(self.error, self.peer, "gone")
            raise CommError(self.error)
        return self.done

    def _progress(self) -> None:
        MPI = _mpi()
        try:
            flag = self.req.Test(self.status)
        except MPI.Exception as exc:
            self.done = True
            text = exc.Get_error_string().splitlines()[0]
            if exc.Get_error_class() == MPI.ERR_TRUNCATE:
                self.error = (f"message size mismatch, expected {self.nbytes} bytes, got a "
                              f"larger message ({text})")
            else:  # the library failed the transfer: a dead or unreachable peer
                self.failed_peer = True
                self.error = f"MPI failed the transfer with rank {self.peer} ({text})"
            return
        if flag and self.is_recv:
            got = self.status.Get_count(_mpi().BYTE)
            if got != self.nbytes:
                self.error = f"message size mismatch, expected {self.nbytes} bytes, got {got} bytes"
        self.done = flag

    def cancel(self) -> bool:
        if not self.done:
            try:
                self.req.Cancel()
            except Exception:  # noqa: BLE001 - best effort after a timeout
                pass
        return False  # after MPI_Cancel a test cannot tell a cancel from a late match


def _bytes(buf: np.ndarray) -> list:
    return [buf.reshape(-1).view(np.uint8), _mpi().BYTE]


class MpiChannel(Channel):
    backend = "mpi"

    def __init__(self, comm: Any, world_ranks: list[int]):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ranks = world_ranks

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def isend(self, buf: np.ndarray, dst: int, tag: int) -> Request:
        return MpiRequest(self.comm.Isend(_bytes(buf), dst, tag), buf.nbytes, False,
                          self.ranks[dst])

    def irecv(self, buf: np.ndarray, src: int, tag: int) -> Request:
        return MpiRequest(self.comm.Irecv(_bytes(buf), src, tag), buf.nbytes, True,
                          self.ranks[src])

    def native(self) -> "MpiNative":
        return MpiNative(self)


SHM_PREFIX = "/dev/shm/mpich_shm_"


def record_shm_files(rank: int) -> None:
    """Under needle's launcher, note the MPICH shared-memory files this rank has mapped, so
    that the launcher can remove them when the job ends: MPICH unlinks them only in a clean
    MPI_Finalize, and a rank that raised, was killed or interrupted leaves them behind."""
    import json
    import os

    from ._run_rank import STATUS_DIR_ENV

    folder = os.environ.get(STATUS_DIR_ENV)
    if not folder:
        return
    try:
        with open("/proc/self/maps") as maps:
            names = sorted({line.split()[-1] for line in maps
                            if line.split()[-1].startswith(SHM_PREFIX)})
        path = os.path.join(folder, f"shm-{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(names, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # no /proc, or the launcher is gone: nothing to clean up for


class MpiTransport:
    backend = "mpi"

    def __init__(self) -> None:
        MPI = _mpi()
        self.world = MPI.COMM_WORLD
        self.rank = self.world.Get_rank()
        self.size = self.world.Get_size()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise CommError(
                "init_process_group: the MPI library must support MPI_THREAD_MULTIPLE "
                f"(async collectives run on a thread), got level {MPI.Query_thread()}"
            )

    def channels(self, count: int, ranks: list[int]) -> list[MpiChannel] | None:
        """Collective over the world: ``count`` isolated channels among ``ranks``."""
        MPI = _mpi()
        member = self.rank in ranks
        color = 0 if member else MPI.UNDEFINED
        key = ranks.index(self.rank) if member else 0
        comm = self.world.Split(color, key)
        record_shm_files(self.rank)  # MPICH maps them at the first communication
        if not member:
            return None
        return [MpiChannel(comm.Dup(), list(ranks)) for _ in range(count)]

    def close(self) -> None:
        """Nothing to do: mpi4py finalizes MPI when the interpreter exits."""


_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


class MpiNative:
    """MPI's own collectives on a channel's communicator (nonblocking, polled to a deadline)."""

    def __init__(self, channel: MpiChannel):
        self.channel = channel
        self.comm = channel.comm

    def _wait(self, req: Any, op: str, deadline: float) -> None:
        if not poll_until(req.Test, deadline):
            raise CommError(
                f"{op}: rank {self.channel.rank} timed out in the native MPI collective waiting "
                f"for ranks {list(range(self.channel.size))}"
            )

    def all_reduce(self, arr: np.ndarray, op: str, deadline: float) -> None:
        MPI = _mpi()
        req = self.comm.Iallreduce(MPI.IN_PLACE, arr, op=getattr(MPI, _OPS[op]))
        self._wait(req, "all_reduce", deadline)
        if op == "mean":
            arr /= self.channel.size

    def broadcast(self, arr: np.ndarray, root: int, deadline: float) -> None:
        self._wait(self.comm.Ibcast(_bytes(arr), root), "broadcast", deadline)

    def barrier(self, deadline: float) -> None:
        self._wait(self.comm.Ibarrier(), "barrier", deadline)
