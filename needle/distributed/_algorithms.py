"""needle's collective algorithms on flat NumPy buffers, built on a channel's isend/irecv.

Ring (reduce-scatter + all-gather): at step j rank r sends segment (start - j) to its right
neighbour and receives segment (start - j - 1) from its left; the first steps reduce what they
receive, the later ones overwrite. Every segment is cut into chunks and each chunk travels the
ring on its own, so reducing chunk k overlaps the transfer of chunk k + 1 and a reduced chunk
is forwarded at once. Sends and receives are posted in (step, chunk) order on both sides, which
is the order the transport matches them in.
"""
from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Any

import numpy as np

from ._blame import CALL_CHECK, blame_left_behind, blame_on_timeout
from ._errors import CommError, PeerError, rewrap
from ._waits import record_timeout

REDUCE = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}
_TAG_SIGNATURE, _TAG_RING, _TAG_TREE, _TAG_LINEAR, _TAG_BARRIER = 1, 2, 3, 4, 5
# What ProcessGroup.bytes_sent counts each tag's payload under.
TAG_NAMES = {_TAG_SIGNATURE: "check", _TAG_RING: "ring", _TAG_TREE: "tree",
             _TAG_LINEAR: "linear", _TAG_BARRIER: "barrier"}
_SIGNATURE_BYTES = 192


class Op:
    """What one collective call needs: its channel, name (for errors), timeout, group."""

    def __init__(self, group: Any, name: str, timeout: float | None = None, site: str = "?",
                 seq: int = 0):
        self.group, self.name = group, name
        self.site, self.seq = site, seq  # the user's call and its number on this group
        self.timeout = group.timeout if timeout is None else float(timeout)
        self.deadline = group.deadline(self.timeout)
        self.channel = group.coll
        self.rank, self.size = self.channel.rank, self.channel.size
        self.pending: list = []

    def wait(self, req: Any, peer: int, what: str) -> None:
        try:
            done = req.wait(self.deadline)
        except CommError as exc:
            self.cancel_all()
            message = f"{self.name}: rank {self.rank} failed {what} with " \
                      f"{self.group.describe(peer)}: {exc}"
            culprit = blame_left_behind(self, peer) if isinstance(exc, PeerError) else None
            if culprit is None:
                raise rewrap(exc, message) from None
            raise PeerError(f"{message}; it had timed out waiting for "
                            f"{self.group.describe(culprit)}, which never arrived",
                            self.channel.global_rank(culprit), "timeout") from None
        if not done:
            self.cancel_all()
            message = (f"{self.name}: rank {self.rank} timed out after {self.timeout:g} s "
                       f"waiting for {self.group.describe(peer)} ({what})")
            culprit = blame_on_timeout(self, peer, certain=what == CALL_CHECK)
            if culprit != peer:
                message += (f", which was itself waiting: {self.group.describe(culprit)} never "
                            "arrived")
            graph = record_timeout(self.channel.global_rank(self.rank), self.name,
                                   self.channel.global_rank(peer), what, self.seq, self.site)
            raise PeerError(message + f" (collective {self.seq} at {self.site})" +
                            (f"; {graph}" if graph else ""), self.channel.global_rank(culprit),
                            "deadlock" if graph.startswith("deadlock") else "timeout")

    def isend(self, buf: np.ndarray, dst: int, tag: int) -> Any:
        req = self.channel.isend(buf, dst, tag)
        self.pending.append(req)
        counter = getattr(self.group, "bytes_sent", None)
        if counter is not None:  # measured traffic, by algorithm family
            counter[TAG_NAMES.get(tag, "other")] += int(buf.nbytes)
        return req

    def irecv(self, buf: np.ndarray, src: int, tag: int) -> Any:
        req = self.channel.irecv(buf, src, tag)
        self.pending.append(req)
        return req

    def cancel_all(self) -> None:
        for req in self.pending:
            req.cancel()


def check_signature(op: Op, signature: str) -> None:
    """Ranks compare what they were asked to do with their left neighbour, so a rank that calls
    a different collective, dtype, shape or group is reported, naming both calls' source lines,
    instead of exchanging garbage.

    The message is ``what`` (compared) then NUL then ``seq site`` (carried for the error only:
    ranks may call one collective from different lines), cut and padded to 192 bytes."""
    if op.size == 1 or not op.group.check_signatures:
        return
    what = f"{signature} group={_group_name(op.group)}"
    raw = f"{what}\0{op.seq} {op.site}".encode()[:_SIGNATURE_BYTES].ljust(_SIGNATURE_BYTES)
    mine = np.frombuffer(bytearray(raw), dtype=np.uint8)
    theirs = np.empty_like(mine)
    left, right = (op.rank - 1) % op.size, (op.rank + 1) % op.size
    recv = op.irecv(theirs, left, _TAG_SIGNATURE)
    send = op.isend(mine, right, _TAG_SIGNATURE)
    op.wait(recv, left, CALL_CHECK)
    op.wait(send, right, "the call check (send)")
    other = theirs.tobytes()
    if other.partition(b"\0")[0] != raw.partition(b"\0")[0]:
        their_what, _, tail = other.decode(errors="replace").partition("\0")
        their_seq, _, their_site = tail.strip().partition(" ")
        raise CommError(
            f"{op.name}: ranks called different collectives, expected {what!r} (rank "
            f"{op.rank}, collective {op.seq} at {op.site}), got {their_what.strip()!r} "
            f"({op.group.describe(left)}, collective {their_seq or '?'} at "
            f"{their_site or '?'})")


def _group_name(group: Any) -> str:
    """The group's ranks, short enough for the call check (cached on the group)."""
    name = getattr(group, "_call_check_name", None)
    if name is None:
        ranks = list(group.ranks)
        name = str(ranks).replace(" ", "") if len(ranks) <= 8 else \
            f"{len(ranks)}ranks:{zlib.crc32(repr(ranks).encode()):08x}"
        group._call_check_name = name
    return name


def _bounds(numel: int, parts: int) -> list[int]:
    return [numel * i // parts for i in range(parts + 1)]


def ring(op: Op, flat: np.ndarray, reduce: str | None, reduce_steps: int, steps: int,
         start: int, chunk_bytes: int, bounds: list[int] | None = None) -> None:
    """Run ``steps`` ring steps on ``flat`` (the first ``reduce_steps`` reduce). One function
    because the pipeline state (posted receives, pending sends, scratch) is shared by all.
    ``bounds``: the n + 1 segment offsets (default: n segments differing by at most one)."""
    n, r = op.size, op.rank
    if n == 1 or steps == 0:
        return
    left, right = (r - 1) % n, (r + 1) % n
    seg = _bounds(flat.size, n) if bounds is None else bounds
    longest = max(seg[i + 1] - seg[i] for i in range(n))
    chunks = max(1, -(-longest * flat.itemsize // chunk_bytes))
    widest = -(-longest // chunks)
    # One scratch slot per chunk: chunk k of step j + 1 is received only after chunk k of
    # step j was reduced, so the slot is free again.
    scratch = np.empty(chunks * widest, dtype=flat.dtype) if reduce_steps else None
    combine = REDUCE[reduce] if reduce else None
    sends: dict[tuple[int, int], list] = defaultdict(list)

    def piece(s: int, k: int) -> np.ndarray:
        lo, hi = seg[s], seg[s + 1]
        return flat[lo + (hi - lo) * k // chunks: lo + (hi - lo) * (k + 1) // chunks]

    def post_recv(j: int, k: int) -> Any:
        s = (start - j - 1) % n
        target = piece(s, k)
        if j < reduce_steps:
            target = scratch[k * widest: k * widest + target.size]
        else:  # overwriting: what we sent from this piece must be out first
            for req in sends.pop((s, k), ()):
                op.wait(req, right, f"ring send of segment {s}")
        return op.irecv(target, left, _TAG_RING)

    def post_send(j: int, k: int) -> None:
        s = (start - j) % n
        sends[(s, k)].append(op.isend(piece(s, k), right, _TAG_RING))

    recvs = {k: post_recv(0, k) for k in range(chunks)}
    for k in range(chunks):
        post_send(0, k)
    for j in range(steps):
        for k in range(chunks):
            op.wait(recvs[k], left, f"ring step {j} of {steps}, chunk {k} of {chunks}")
            if j < reduce_steps:
                target = piece((start - j - 1) % n, k)
                combine(target, scratch[k * widest: k * widest + target.size], out=target)
            if j + 1 < steps:
                recvs[k] = post_recv(j + 1, k)
                post_send(j + 1, k)
    for reqs in sends.values():
        for req in reqs:
            op.wait(req, right, "the last ring sends")


def ring_all_reduce(op: Op, flat: np.ndarray, reduce: str, chunk_bytes: int,
                    bounds: list[int] | None = None) -> None:
    """Exactly :func:`ring_reduce_scatter` then :func:`ring_all_gather` (the same start and
    segments, pipelined as one ring), so both sum every element in the same order."""
    n = op.size
    ring(op, flat, reduce, n - 1, 2 * (n - 1), op.rank - 1, chunk_bytes, bounds)
    if reduce == "mean" and n > 1:
        flat /= n


def ring_reduce_scatter(op: Op, flat: np.ndarray, reduce: str, chunk_bytes: int,
                        bounds: list[int] | None = None) -> None:
    """Afterwards segment ``rank`` of ``flat`` (n segments: ``bounds``, default equal ones)
    holds the reduction."""
    n = op.size
    ring(op, flat, reduce, n - 1, n - 1, op.rank - 1, chunk_bytes, bounds)
    if reduce == "mean" and n > 1:
        seg = _bounds(flat.size, n) if bounds is None else bounds
        mine = flat[seg[op.rank]: seg[op.rank + 1]]
        mine /= n


def ring_all_gather(op: Op, flat: np.ndarray, chunk_bytes: int,
                    bounds: list[int] | None = None) -> None:
    """Segment ``rank`` of ``flat`` is this rank's part; afterwards all segments are filled."""
    ring(op, flat, None, 0, op.size - 1, op.rank, chunk_bytes, bounds)


def _tree(rank: int, root: int, n: int) -> tuple[int | None, list[int]]:
    """Binomial tree: parent clears the lowest set bit of the root-relative rank; children
    add powers of two below it (largest subtree first)."""
    v = (rank - root) % n
    parent = None if v == 0 else ((v & (v - 1)) + root) % n
    low = v & -v if v else 1 << max(n - 1, 1).bit_length()
    children = []
    bit = 1
    while bit < low and v + bit < n:
        children.append(bit)
        bit <<= 1
    return parent, [((v + b) + root) % n for b in reversed(children)]


def tree_broadcast(op: Op, flat: np.ndarray, root: int, chunk_bytes: int) -> None:
    """Chunked binomial-tree broadcast: a chunk is forwarded as soon as it arrives."""
    parent, children = _tree(op.rank, root, op.size)
    chunks = max(1, -(-flat.nbytes // chunk_bytes))
    cut = _bounds(flat.size, chunks)
    recvs = [op.irecv(flat[cut[k]:cut[k + 1]], parent, _TAG_TREE) for k in range(chunks)] \
        if parent is not None else []
    sends = []
    for k in range(chunks):
        if parent is not None:
            op.wait(recvs[k], parent, f"broadcast chunk {k} of {chunks}")
        sends += [(op.isend(flat[cut[k]:cut[k + 1]], c, _TAG_TREE), c) for c in children]
    for req, child in sends:
        op.wait(req, child, "broadcast send")


def tree_reduce(op: Op, flat: np.ndarray, root: int, reduce: str, chunk_bytes: int) -> None:
    """Binomial-tree reduce to ``root`` (the mirror of the broadcast), chunked."""
    parent, children = _tree(op.rank, root, op.size)
    chunks = max(1, -(-flat.nbytes // chunk_bytes))
    cut = _bounds(flat.size, chunks)
    scratch = np.empty((len(children), flat.size), dtype=flat.dtype)
    recvs = [[op.irecv(scratch[i, cut[k]:cut[k + 1]], c, _TAG_TREE) for k in range(chunks)]
             for i, c in enumerate(children)]
    sends = []
    for k in range(chunks):
        part = flat[cut[k]:cut[k + 1]]
        for i, child in enumerate(children):
            op.wait(recvs[i][k], child, f"reduce chunk {k} of {chunks}")
            REDUCE[reduce](part, scratch[i, cut[k]:cut[k + 1]], out=part)
        if parent is not None:
            sends.append(op.isend(part, parent, _TAG_TREE))
    for req in sends:
        op.wait(req, parent, "reduce send")
    if reduce == "mean" and op.rank == root:
        flat /= op.size


def linear_gather(op: Op, mine: np.ndarray, parts: list[np.ndarray] | None, root: int) -> None:
    """Every rank sends its part to ``root``, which receives into ``parts``."""
    if op.rank != root:
        op.wait(op.isend(mine, root, _TAG_LINEAR), root, "gather send")
        return
    recvs = [(op.irecv(parts[r], r, _TAG_LINEAR), r) for r in range(op.size) if r != root]
    parts[root][...] = mine
    for req, peer in recvs:
        op.wait(req, peer, "gather receive")


def linear_scatter(op: Op, mine: np.ndarray, parts: list[np.ndarray] | None, root: int) -> None:
    """``root`` sends ``parts[r]`` to every rank r."""
    if op.rank != root:
        op.wait(op.irecv(mine, root, _TAG_LINEAR), root, "scatter receive")
        return
    sends = [(op.isend(parts[r], r, _TAG_LINEAR), r) for r in range(op.size) if r != root]
    mine[...] = parts[root]
    for req, peer in sends:
        op.wait(req, peer, "scatter send")


def dissemination_barrier(op: Op) -> None:
    """ceil(log2 n) rounds; in round k every rank signals rank + 2**k and hears rank - 2**k."""
    token, got = np.ones(1, np.uint8), np.empty(1, np.uint8)
    distance = 1
    while distance < op.size:
        src, dst = (op.rank - distance) % op.size, (op.rank + distance) % op.size
        recv = op.irecv(got, src, _TAG_BARRIER)
        send = op.isend(token, dst, _TAG_BARRIER)
        op.wait(recv, src, "barrier")
        op.wait(send, dst, "barrier")
        distance <<= 1
