"""Starting and stopping process groups: init_process_group, new_group, destroy_process_group,
and ``spawn_threads`` for the in-process thread backend."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from . import _group, _nccl
from ._errors import CommError, PeerError
from ._group import DEFAULT_TIMEOUT, NonMemberGroup, ProcessGroup, current_state
from ._run_rank import rank_environment

BACKENDS = ("mpi", "tcp", "thread", "nccl")


def _default_backend() -> str:
    """$NEEDLE_DIST_BACKEND, else the host transport the process was started for."""
    if "NEEDLE_DIST_BACKEND" in os.environ:
        return os.environ["NEEDLE_DIST_BACKEND"]
    return _started_by()


def _started_by() -> str:
    """mpi under mpiexec, tcp under needle's tcp launcher, else mpi (a singleton world)."""
    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return "mpi"
    if "RANK" in os.environ and "MASTER_PORT" in os.environ:
        return "tcp"
    return "mpi"


def _env_int(name: str, given: int | None) -> int:
    if given is not None:
        return int(given)
    if name not in os.environ:
        raise CommError(f"init_process_group: backend 'tcp' needs {name}, expected it as an "
                        "argument or environment variable, got neither")
    try:
        return int(os.environ[name])
    except ValueError:
        raise CommError(f"init_process_group: bad {name}, expected an integer, got "
                        f"{os.environ[name]!r}") from None


def _check_rank(rank: int, world_size: int) -> tuple[int, int]:
    """Refuse a layout no job can complete, before waiting for peers that cannot exist."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise CommError(f"init_process_group: bad rank layout, expected WORLD_SIZE >= 1 and "
                        f"0 <= RANK < WORLD_SIZE, got RANK={rank} WORLD_SIZE={world_size}")
    return rank, world_size


def check_timeout(op: str, timeout: Any) -> float:
    """``timeout`` as seconds, refusing what no wait can honour (negative, zero, NaN)."""
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:  # also refuses NaN
        raise CommError(f"{op}: bad timeout, expected a number of seconds > 0, got {timeout!r}")
    return seconds


def _transport(backend: str, rank: int | None, world_size: int | None, timeout: float,
               world: Any) -> Any:
    if backend == "mpi":
        from ._mpi_transport import MpiTransport

        transport = MpiTransport()
        for name, given, actual in (("rank", rank, transport.rank),
                                    ("world_size", world_size, transport.size)):
            if given is not None and given != actual:
                raise CommError(f"init_process_group: {name} differs from MPI's, expected "
                                f"{actual}, got {given}")
        return transport
    if backend == "tcp":
        from ._tcp_transport import TcpTransport

        rank, size = _check_rank(_env_int("RANK", rank), _env_int("WORLD_SIZE", world_size))
        return TcpTransport(rank, size, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                            _env_int("MASTER_PORT", None), timeout)
    from ._thread_transport import ThreadTransport

    if world is None or rank is None:
        raise CommError("init_process_group: backend 'thread' needs rank= and world= "
                        "(use dist.spawn_threads), got none")
    return ThreadTransport(rank, world)


def _export_rank_environment(transport: Any) -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE for code that reads them (samplers,
    logging), also under a plain ``mpiexec`` that sets only its own PMI_* variables."""
    found = rank_environment(dict(os.environ))
    found.update(RANK=str(transport.rank), WORLD_SIZE=str(transport.size))  # the facts
    os.environ.update(found)


def init_process_group(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                       rank: int | None = None, world_size: int | None = None,
                       world: Any = None) -> ProcessGroup:
    """Join the default process group.

    Args:
        backend: "mpi" (start with mpiexec or the launcher), "tcp" (reads RANK, WORLD_SIZE,
            MASTER_ADDR, MASTER_PORT and the job secret NEEDLE_DIST_SECRET, which the
            launcher sets; see docs/distributed.md), "thread" (ranks are threads; see
            spawn_threads), "nccl" (cuda() tensors through NCCL, everything else through a
            host transport: $NEEDLE_DIST_NCCL_HOST, else mpi or tcp as None picks; "thread"
            when ``world`` is given). None picks $NEEDLE_DIST_BACKEND, else mpi under
            mpiexec and tcp when RANK/MASTER_PORT are set.
            Under mpi and tcp, RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are set in
            ``os.environ`` when missing.
        timeout: seconds any blocking call of this group may wait before raising CommError.

    Raises:
        NcclUnavailable: backend "nccl" where no rank has CuPy with NCCL and a GPU (a job
            where only some ranks have one keeps the host path for every tensor).

    Example:
        >>> import needle.distributed as dist
        >>> dist.spawn_threads(lambda rank: (dist.get_rank(), dist.get_world_size()), 2)
        [(0, 2), (1, 2)]
    """
    backend = backend or _default_backend()
    if backend not in BACKENDS:
        raise CommError(f"init_process_group: unknown backend, expected one of {BACKENDS}, "
                        f"got {backend!r}")
    if current_state() is not None:
        raise CommError("init_process_group: already initialized, expected one call per "
                        "process (call destroy_process_group first)")
    timeout = check_timeout("init_process_group", timeout)
    host = backend
    if backend == "nccl":
        host = "thread" if world is not None else _nccl.host_backend(_started_by)
    transport = _transport(host, rank, world_size, timeout, world)
    if host != "thread":
        _export_rank_environment(transport)
    ranks = list(range(transport.size))
    group = ProcessGroup(transport, transport.channels(2, ranks), timeout)
    _group.set_state(_group._State(transport, group), thread_local=host == "thread")
    if backend == "nccl":
        try:
            _nccl.attach(group, required=True)
        except BaseException:
            destroy_process_group()
            raise
    return group


def is_initialized() -> bool:
    return current_state() is not None


def _world(op: str) -> _group._State:
    state = current_state()
    if state is None:
        raise CommError(f"{op}: no process group, expected dist.init_process_group() first")
    return state


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    return _group.resolve(group, "get_rank").rank


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (default: the world)."""
    return _group.resolve(group, "get_world_size").size


def get_backend(group: Any = None) -> str:
    """"mpi", "tcp", "thread", or "nccl" for a group whose cuda() tensors use NCCL."""
    pg = _group.resolve(group, "get_backend")
    return "nccl" if getattr(pg, "nccl", None) is not None else pg.backend


def new_group(ranks: list[int] | None = None, timeout: float | None = None) -> Any:
    """A group of some world ranks. Every rank of the world must call it, in the same order.

    Returns a ProcessGroup on members and a placeholder that raises on use elsewhere.
    """
    state = _world("new_group")
    size = state.world.size
    ranks = list(range(size)) if ranks is None else [int(r) for r in ranks]
    if len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks) or not ranks:
        raise CommError(f"new_group: ranks must be distinct world ranks in [0, {size}), "
                        f"got {ranks}")
    channels = state.transport.channels(2, ranks)
    if channels is None:
        return NonMemberGroup(ranks, state.world.rank)
    group = ProcessGroup(state.transport, channels,
                         state.world.timeout if timeout is None else timeout,
                         traffic=state.world.traffic)
    state.groups.append(group)
    if getattr(state.world, "nccl", None) is not None:
        _nccl.attach(group, required=False)
    return group


def destroy_process_group(group: Any = None) -> None:
    """Close ``group``, or everything (and the transport) when ``group`` is None."""
    state = current_state()
    if state is None:
        return
    if group is not None:
        if isinstance(group, ProcessGroup):
            _destroy(group)
        return
    for g in state.groups:
        _destroy(g)
    state.transport.close()
    _group.set_state(None, thread_local=state.transport.backend == "thread")


def _destroy(group: ProcessGroup) -> None:
    group.destroy()
    comm = getattr(group, "nccl", None)
    if comm is not None:
        comm.destroy()


_SPAWN_GRACE = 5.0  # seconds past the timeout before spawn_threads gives up on a rank


def _root_cause(errors: list[tuple[int, BaseException]]) -> tuple[int, BaseException] | None:
    """The failure the others follow from: the first (in time) that is not a PeerError,
    since a PeerError says another rank is at fault; else the first."""
    causes = [e for e in errors if not isinstance(e[1], PeerError)]
    first = causes or errors
    return first[0] if first else None


def spawn_threads(fn: Callable[..., Any], world_size: int, *args: Any,
                  timeout: float = 60.0, backend: str = "thread") -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` threads, each the rank of a thread-backend
    group (``backend="nccl"``: an nccl group over the thread transport), and return their
    results in rank order.

    Raises:
        the failure the others follow from: the first that is not a PeerError (a PeerError
        blames another rank), else the first; CommError naming the ranks still running
        ``timeout`` + 5 s after the start, with that failure as its cause.

    Example:
        >>> import needle.distributed as dist
        >>> dist.spawn_threads(lambda rank: rank * 10, 3)
        [0, 10, 20]
    """
    from ._thread_transport import ThreadWorld

    timeout = check_timeout("spawn_threads", timeout)
    if backend not in ("thread", "nccl"):
        raise CommError(f"spawn_threads: unknown backend, expected 'thread' or 'nccl', got "
                        f"{backend!r}")
    world = ThreadWorld(world_size)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def main(rank: int) -> None:
        try:
            init_process_group(backend, timeout=timeout, rank=rank, world=world)
            results[rank] = fn(rank, *args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append((rank, exc))
        finally:
            destroy_process_group()

    threads = [threading.Thread(target=main, args=(r,), name=f"needle-rank-{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    # One deadline for all: every call of a rank gives up after ``timeout``, so a rank alive
    # well past it is stuck outside needle, and joining each in turn would multiply the wait.
    end = time.monotonic() + timeout + _SPAWN_GRACE
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    root = _root_cause(list(errors))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    if stuck:
        cause = "" if root is None else (f"; rank {root[0]} failed first: "
                                         f"{type(root[1]).__name__}: {root[1]}")
        raise CommError(f"spawn_threads: ranks {stuck} still running {timeout + _SPAWN_GRACE:g} "
                        f"s after the start, expected every rank to end within the timeout "
                        f"({timeout:g} s){cause}") from (root[1] if root else None)
    if root is not None:
        raise root[1]
    return results
