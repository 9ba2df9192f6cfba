"""Collectives on Tensors, NDArrays and NumPy arrays, in place on the caller's objects.

Each call validates its arguments on the calling thread, then runs (inline, or on the group's
communication thread when ``async_op=True``) needle's own algorithm from ``_algorithms`` or,
with ``algorithm="native"``, the transport's collective: ``MPI_Iallreduce`` and friends on mpi,
a shared-memory reduction on thread; tcp has no native collectives. On an ``nccl`` group,
``cuda()`` tensors skip all of that: they go from their device buffers into NCCL (``_nccl``).
"""
from __future__ import annotations

import zlib
from typing import Any, Callable

import numpy as np

from . import _algorithms as alg
from . import _nccl, _waits, tracing, traffic
from ._buffers import Borrowed, borrow, dtype_name
from ._errors import CommError, ShapeError
from ._group import ProcessGroup, resolve
from ._work import Work

OPS = ("sum", "mean", "max", "min")


def _op_name(op: str, where: str) -> str:
    if op not in OPS:
        raise CommError(f"{where}: unknown reduction, expected one of {OPS}, got {op!r}")
    return op


def _native(pg: ProcessGroup, where: str, algorithm: str, allowed: tuple[str, ...]) -> Any:
    if algorithm not in allowed + ("native",):
        raise CommError(
            f"{where}: unknown algorithm, expected one of {allowed + ('native',)}, "
            f"got {algorithm!r}"
        )
    if algorithm != "native":
        return None
    native = pg.coll.native()
    if native is None or not hasattr(native, where):
        raise CommError(
            f"{where}: algorithm='native' needs a transport with its own {where} "
            f"(mpi, thread), got backend {pg.backend!r}; use algorithm={allowed[0]!r}"
        )
    return native


def _sig(where: str, arr: np.ndarray, **extra: Any) -> str:
    more = " ".join(f"{k}={v}" for k, v in extra.items())
    return f"{where} {dtype_name(arr)} {tuple(arr.shape)} {more}".strip()


def _launch(pg: ProcessGroup, where: str, body: Callable[[alg.Op], None], signature: str,
            timeout: float | None, async_op: bool,
            record: traffic.TrafficRecord | None = None) -> Work | None:
    # the user's call site and the call's number, taken on the caller's thread: a timeout or
    # a mismatch names them
    site = _waits.call_site()
    pg.collectives_issued = seq = pg.collectives_issued + 1

    def run() -> None:
        with traffic.counting(record), tracing.collective_span(where, pg, record):
            op = alg.Op(pg, where, timeout, site, seq)
            alg.check_signature(op, signature)
            body(op)

    result = pg.run(run, async_op)
    return result if async_op else None


def all_reduce(tensor: Any, op: str = "sum", group: Any = None, async_op: bool = False,
               algorithm: str = "ring", timeout: float | None = None,
               bounds: list[int] | None = None) -> Work | None:
    """Reduce ``tensor`` over all ranks of the group; every rank ends with the result.

    Args:
        op: "sum", "mean", "max" or "min".
        algorithm: "ring" (needle's pipelined reduce-scatter + all-gather) or "native".
        async_op: run on the communication thread and return a Work.
        bounds: ring only: the segment offsets of the flattened tensor (default
            :func:`shard_bounds`). The ring all-reduce is :func:`reduce_scatter_v` followed
            by :func:`all_gather_v` over the same segments, so each element is summed in the
            same order as a reduce-scatter sums it.

    Example:
        >>> import numpy as np, needle.distributed as dist
        >>> def job(rank):
        ...     x = np.array([[1, 2, 3], [1, 0, 1]][rank], dtype=np.float32)
        ...     dist.all_reduce(x)
        ...     return x.tolist()
        >>> dist.spawn_threads(job, 2)
        [[2.0, 2.0, 4.0], [2.0, 2.0, 4.0]]
    """
    pg = resolve(group, "all_reduce")
    _op_name(op, "all_reduce")
    native = _native(pg, "all_reduce", algorithm, ("ring",))
    dev = _nccl.route(pg, tensor)
    if dev is not None:
        return _launch(pg, "all_reduce", _nccl.all_reduce(pg, dev[0], op),
                       _nccl.signature("all_reduce", dev[0], op=op), timeout, async_op)
    buf = borrow(tensor, "all_reduce")
    a = buf.arr
    seg = None if bounds is None else _check_bounds("all_reduce", bounds, a.size, pg.size)
    if seg is not None and native is not None:
        raise CommError("all_reduce: bounds apply to algorithm='ring', got "
                        "algorithm='native' with bounds")
    record = traffic.open_record(
        pg, "all_reduce", algorithm, a.nbytes,
        traffic.ring_all_reduce_bytes(a.size, a.itemsize, pg.size, pg.rank, seg),
        "ring all-reduce: 2(n-1)/n x M", native=native is not None)

    def body(o: alg.Op) -> None:
        flat = buf.arr.reshape(-1)
        if native is not None:
            native.all_reduce(flat, op, o.deadline)
        else:
            alg.ring_all_reduce(o, flat, op, pg.chunk_bytes, seg)
        buf.commit()

    extra = {} if seg is None else {"bounds": zlib.crc32(repr(seg).encode())}
    return _launch(pg, "all_reduce", body, _sig("all_reduce", buf.arr, op=op,
                   algorithm=algorithm, **extra), timeout, async_op, record)


def broadcast(tensor: Any, src: int = 0, group: Any = None, async_op: bool = False,
              algorithm: str = "tree", timeout: float | None = None) -> Work | None:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank (chunked binomial tree)."""
    pg = resolve(group, "broadcast")
    pg.check_peer("broadcast", src, "src")
    native = _native(pg, "broadcast", algorithm, ("tree",))
    dev = _nccl.route(pg, tensor)
    if dev is not None:
        return _launch(pg, "broadcast", _nccl.broadcast(pg, dev[0], src),
                       _nccl.signature("broadcast", dev[0], src=src), timeout, async_op)
    buf = borrow(tensor, "broadcast")
    record = traffic.open_record(
        pg, "broadcast", algorithm, buf.arr.nbytes,
        traffic.tree_broadcast_bytes(buf.arr.nbytes, pg.size, pg.rank, src),
        "tree broadcast: M to each child, M from the parent", native=native is not None)

    def body(o: alg.Op) -> None:
        flat = buf.arr.reshape(-1)
        if native is not None:
            native.broadcast(flat, src, o.deadline)
        else:
            alg.tree_broadcast(o, flat, src, pg.chunk_bytes)
        buf.commit()

    return _launch(pg, "broadcast", body, _sig("broadcast", buf.arr, src=src), timeout, async_op,
                   record)


def reduce(tensor: Any, dst: int = 0, op: str = "sum", group: Any = None,
           async_op: bool = False, timeout: float | None = None) -> Work | None:
    """Reduce ``tensor`` over all ranks into ``tensor`` on rank ``dst`` (binomial tree); the
    other ranks' tensors are left unchanged."""
    pg = resolve(group, "reduce")
    pg.check_peer("reduce", dst, "dst")
    _op_name(op, "reduce")
    dev = _nccl.route(pg, tensor)
    if dev is not None:
        return _launch(pg, "reduce", _nccl.reduce(pg, dev[0], dst, op),
                       _nccl.signature("reduce", dev[0], dst=dst, op=op), timeout, async_op)
    buf = borrow(tensor, "reduce")
    record = traffic.open_record(
        pg, "reduce", "tree", buf.arr.nbytes,
        traffic.tree_reduce_bytes(buf.arr.nbytes, pg.size, pg.rank, dst),
        "tree reduce: M to the parent, M from each child")

    def body(o: alg.Op) -> None:
        work = buf.arr.reshape(-1) if pg.rank == dst else buf.arr.reshape(-1).copy()
        alg.tree_reduce(o, work, dst, op, pg.chunk_bytes)
        if pg.rank == dst:
            buf.commit()

    return _launch(pg, "reduce", body, _sig("reduce", buf.arr, dst=dst, op=op), timeout, async_op,
                   record)


def _borrow_list(where: str, what: str, items: Any, like: np.ndarray, size: int,
                 readonly: bool) -> list[Borrowed]:
    if items is None or len(items) != size:
        got = None if items is None else len(items)
        raise ShapeError(
            f"{where}: {what} must hold one entry per rank, expected {size}, got {got}"
        )
    bufs = [borrow(t, where, readonly=readonly) for t in items]
    for i, b in enumerate(bufs):
        if b.arr.shape != like.shape or b.arr.dtype != like.dtype:
            raise ShapeError(
                f"{where}: {what}[{i}] must match the tensor, expected "
                f"{dtype_name(like)} {like.shape}, got {dtype_name(b.arr)} {b.arr.shape}"
            )
    return bufs


def _check_list(where: str, what: str, dev: list[_nccl.DeviceBuffer], size: int) -> None:
    """``dev`` = [the tensor, then the list's entries]: one entry per rank, each like it."""
    like, items = dev[0], dev[1:]
    if len(items) != size:
        raise ShapeError(f"{where}: {what} must hold one entry per rank, expected {size}, "
                         f"got {len(items)}")
    for i, b in enumerate(items):
        if b.shape != like.shape or b.dtype != like.dtype:
            raise ShapeError(f"{where}: {what}[{i}] must match the tensor, expected "
                             f"{like.dtype} {like.shape}, got {b.dtype} {b.shape}")


def all_gather(tensor_list: list, tensor: Any, group: Any = None, async_op: bool = False,
               timeout: float | None = None) -> Work | None:
    """Fill ``tensor_list[r]`` with rank r's ``tensor`` on every rank (ring all-gather)."""
    pg = resolve(group, "all_gather")
    dev = _nccl.route(pg, tensor, *(tensor_list or ()))
    if dev is not None:
        _check_list("all_gather", "tensor_list", dev, pg.size)
        return _launch(pg, "all_gather", _nccl.all_gather(pg, dev[1:], dev[0]),
                       _nccl.signature("all_gather", dev[0]), timeout, async_op)
    mine = borrow(tensor, "all_gather", readonly=True)
    outs = _borrow_list("all_gather", "tensor_list", tensor_list, mine.arr, pg.size, False)
    whole = pg.size * mine.arr.size
    record = traffic.open_record(
        pg, "all_gather", "ring", whole * mine.arr.itemsize,
        traffic.ring_all_gather_bytes(whole, mine.arr.itemsize, pg.size, pg.rank),
        "ring all-gather: (n-1)/n x M")

    def body(o: alg.Op) -> None:
        flat = np.empty(pg.size * mine.arr.size, dtype=mine.arr.dtype)
        parts = flat.reshape(pg.size, -1)
        parts[pg.rank] = mine.arr.reshape(-1)
        alg.ring_all_gather(o, flat, pg.chunk_bytes)
        for r, out in enumerate(outs):
            out.arr[...] = parts[r].reshape(mine.arr.shape)
            out.commit()

    return _launch(pg, "all_gather", body, _sig("all_gather", mine.arr), timeout, async_op,
                   record)


def reduce_scatter(output: Any, input_list: list, op: str = "sum", group: Any = None,
                   async_op: bool = False, timeout: float | None = None) -> Work | None:
    """``output`` on rank r becomes the reduction over ranks of ``input_list[r]`` (ring)."""
    pg = resolve(group, "reduce_scatter")
    _op_name(op, "reduce_scatter")
    dev = _nccl.route(pg, output, *(input_list or ()))
    if dev is not None:
        _check_list("reduce_scatter", "input_list", dev, pg.size)
        return _launch(pg, "reduce_scatter", _nccl.reduce_scatter(pg, dev[0], dev[1:], op),
                       _nccl.signature("reduce_scatter", dev[0], op=op), timeout, async_op)
    out = borrow(output, "reduce_scatter")
    ins = _borrow_list("reduce_scatter", "input_list", input_list, out.arr, pg.size, True)
    whole = pg.size * out.arr.size
    record = traffic.open_record(
        pg, "reduce_scatter", "ring", whole * out.arr.itemsize,
        traffic.ring_reduce_scatter_bytes(whole, out.arr.itemsize, pg.size, pg.rank),
        "ring reduce-scatter: (n-1)/n x M")

    def body(o: alg.Op) -> None:
        flat = np.concatenate([b.arr.reshape(-1) for b in ins])
        alg.ring_reduce_scatter(o, flat, op, pg.chunk_bytes)
        out.arr[...] = flat.reshape(pg.size, -1)[pg.rank].reshape(out.arr.shape)
        out.commit()

    return _launch(pg, "reduce_scatter", body, _sig("reduce_scatter", out.arr, op=op),
                   timeout, async_op, record)


def shard_bounds(numel: int, world_size: int) -> list[int]:
    """The ``world_size + 1`` offsets that cut ``numel`` elements into contiguous pieces whose
    sizes differ by at most one (rank r's piece is ``[b[r], b[r + 1])``).

    Example:
        >>> shard_bounds(10, 4)
        [0, 2, 5, 7, 10]
    """
    return alg._bounds(int(numel), int(world_size))


def _check_bounds(where: str, bounds: list[int] | None, numel: int, size: int) -> list[int]:
    if bounds is None:
        return shard_bounds(numel, size)
    b = [int(x) for x in bounds]
    if len(b) != size + 1 or b[0] != 0 or b[-1] != numel or any(
            x > y for x, y in zip(b, b[1:], strict=False)):
        raise ShapeError(
            f"{where}: bad segment bounds, expected {size + 1} non-decreasing offsets from 0 "
            f"to {numel} (the buffer's length), got {b}")
    return b


def reduce_scatter_v(flat: Any, bounds: list[int] | None = None, op: str = "sum",
                     group: Any = None, async_op: bool = False,
                     timeout: float | None = None) -> Work | None:
    """Ring reduce-scatter in place on the 1-D buffer ``flat`` cut at ``bounds`` (segments of
    any sizes, default :func:`shard_bounds`): afterwards rank r's segment
    ``flat[bounds[r]:bounds[r + 1]]`` holds the reduction over ranks; other segments hold
    partial results. Each rank sends every segment but its own once (ring traffic).

    Example:
        >>> import numpy as np, needle.distributed as dist
        >>> def job(rank):
        ...     x = np.arange(5, dtype=np.float32) * (rank + 1)
        ...     dist.reduce_scatter_v(x, [0, 2, 5])
        ...     return x[[0, 2, 5][rank]:[0, 2, 5][rank + 1]].tolist()
        >>> dist.spawn_threads(job, 2)
        [[0.0, 3.0], [6.0, 9.0, 12.0]]
    """
    pg = resolve(group, "reduce_scatter_v")
    _op_name(op, "reduce_scatter_v")
    dev = _nccl.route(pg, flat)
    if dev is not None:
        seg = _check_bounds("reduce_scatter_v", bounds, dev[0].count, pg.size)
        return _launch(pg, "reduce_scatter_v", _nccl.reduce_scatter_v(pg, dev[0], seg, op),
                       _nccl.signature("reduce_scatter_v", dev[0], op=op,
                                       bounds=zlib.crc32(repr(seg).encode())),
                       timeout, async_op)
    buf = borrow(flat, "reduce_scatter_v")
    seg = _check_bounds("reduce_scatter_v", bounds, buf.arr.size, pg.size)

    def body(o: alg.Op) -> None:
        alg.ring_reduce_scatter(o, buf.arr.reshape(-1), op, pg.chunk_bytes, seg)
        buf.commit()

    return _launch(pg, "reduce_scatter_v", body, _sig("reduce_scatter_v", buf.arr, op=op,
                   bounds=zlib.crc32(repr(seg).encode())), timeout, async_op)


def all_gather_v(flat: Any, bounds: list[int] | None = None, group: Any = None,
                 async_op: bool = False, timeout: float | None = None) -> Work | None:
    """Ring all-gather in place on the 1-D buffer ``flat``: rank r contributes
    ``flat[bounds[r]:bounds[r + 1]]`` (segments of any sizes, default :func:`shard_bounds`);
    afterwards every segment is filled on every rank. Each rank sends every segment but its
    right neighbour's once.

    Example:
        >>> import numpy as np, needle.distributed as dist
        >>> def job(rank):
        ...     x = np.zeros(3, dtype=np.float32); x[[0, 1, 3][rank]:[0, 1, 3][rank + 1]] = 7
        ...     dist.all_gather_v(x, [0, 1, 3])
        ...     return x.tolist()
        >>> dist.spawn_threads(job, 2)
        [[7.0, 7.0, 7.0], [7.0, 7.0, 7.0]]
    """
    pg = resolve(group, "all_gather_v")
    dev = _nccl.route(pg, flat)
    if dev is not None:
        seg = _check_bounds("all_gather_v", bounds, dev[0].count, pg.size)
        return _launch(pg, "all_gather_v", _nccl.all_gather_v(pg, dev[0], seg),
                       _nccl.signature("all_gather_v", dev[0],
                                       bounds=zlib.crc32(repr(seg).encode())),
                       timeout, async_op)
    buf = borrow(flat, "all_gather_v")
    seg = _check_bounds("all_gather_v", bounds, buf.arr.size, pg.size)

    def body(o: alg.Op) -> None:
        alg.ring_all_gather(o, buf.arr.reshape(-1), pg.chunk_bytes, seg)
        buf.commit()

    return _launch(pg, "all_gather_v", body, _sig("all_gather_v", buf.arr,
                   bounds=zlib.crc32(repr(seg).encode())), timeout, async_op)


def gather(tensor: Any, gather_list: list | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, timeout: float | None = None) -> Work | None:
    """Rank ``dst`` receives every rank's ``tensor`` into ``gather_list`` (others pass None)."""
    pg = resolve(group, "gather")
    pg.check_peer("gather", dst, "dst")
    mine = borrow(tensor, "gather", readonly=True)
    outs = _borrow_list("gather", "gather_list", gather_list, mine.arr, pg.size, False) \
        if pg.rank == dst else None
    record = traffic.open_record(
        pg, "gather", "linear", mine.arr.nbytes,
        traffic.gather_bytes(mine.arr.nbytes, pg.size, pg.rank, dst),
        "linear gather: the root receives (n-1) x M")

    def body(o: alg.Op) -> None:
        alg.linear_gather(o, mine.arr, [b.arr for b in outs] if outs else None, dst)
        for b in outs or ():
            b.commit()

    return _launch(pg, "gather", body, _sig("gather", mine.arr, dst=dst), timeout, async_op,
                   record)


def scatter(tensor: Any, scatter_list: list | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, timeout: float | None = None) -> Work | None:
    """Rank r's ``tensor`` receives ``scatter_list[r]`` from rank ``src``."""
    pg = resolve(group, "scatter")
    pg.check_peer("scatter", src, "src")
    mine = borrow(tensor, "scatter")
    ins = _borrow_list("scatter", "scatter_list", scatter_list, mine.arr, pg.size, True) \
        if pg.rank == src else None
    record = traffic.open_record(
        pg, "scatter", "linear", mine.arr.nbytes,
        traffic.scatter_bytes(mine.arr.nbytes, pg.size, pg.rank, src),
        "linear scatter: the root sends (n-1) x M")

    def body(o: alg.Op) -> None:
        alg.linear_scatter(o, mine.arr, [b.arr for b in ins] if ins else None, src)
        mine.commit()

    return _launch(pg, "scatter", body, _sig("scatter", mine.arr, src=src), timeout, async_op,
                   record)


def barrier(group: Any = None, async_op: bool = False, algorithm: str = "dissemination",
            timeout: float | None = None) -> Work | None:
    """Return once every rank of the group has entered the barrier."""
    pg = resolve(group, "barrier")
    native = _native(pg, "barrier", algorithm, ("dissemination",))
    record = traffic.open_record(pg, "barrier", algorithm, 0, traffic.barrier_bytes(pg.size),
                                 "dissemination: 1 byte per round", native=native is not None)

    def body(o: alg.Op) -> None:
        if native is not None:
            native.barrier(o.deadline)
        else:
            alg.dissemination_barrier(o)

    return _launch(pg, "barrier", body, "barrier", timeout, async_op, record)
