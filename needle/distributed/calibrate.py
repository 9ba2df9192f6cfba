"""Communication time: the α-β link model, collective times from it, and the probe that fits it.

A message of ``n`` bytes between two ranks takes ``T(n) = α + β·n`` from the moment the sender
starts posting it until a receiver that was already waiting holds it (``α``: latency, ``β``:
seconds per byte, 1 / bandwidth). Each end also spends CPU time it cannot compute in: the
sender is busy ``o_s(n)`` posting the message (header, copy out), and a receiver that finds
the message already there is busy ``o_r(n)`` taking it (unpacking, allocating). All three are
affine in ``n``; :class:`Link` holds them. A receiver that waits polls for ``spin`` (2 ms),
then yields its core between polls; on a machine whose cores are all taken it gets one back
only ``wake`` later, so a receive that waited longer than ``spin`` ends ``wake`` after the
message landed (zero on an idle machine, milliseconds on an oversubscribed one).

A collective of needle's algorithms (``_algorithms.py``) is a sequence of rounds, each a
message to a neighbour, preceded by one call-check round (the 192-byte signature exchange):

======================  ==========================  =====================================
collective              rounds                      bytes sent (traffic.py's predictions)
======================  ==========================  =====================================
ring all-reduce         2(n-1)                      2(n-1)/n·M
ring reduce-scatter     n-1                         (n-1)/n·M
ring all-gather         n-1                         (n-1)/n·M
tree broadcast/reduce   ceil(log2 n)                M per round
barrier                 ceil(log2 n)                1 byte per round
send                    1 (no call check)           M
======================  ==========================  =====================================

so ``time = (rounds + 1)·α + β·(bytes sent)`` (:func:`collective_time`); a ring round moves
one segment in each direction at once, so the bytes a rank sends are what its link carries.

:func:`probe_link` fits ``α, β`` from ping-pongs of a few sizes over the job's own transport
(``p2p`` array messages, the ones pipeline stages send), and ``o_s, o_r`` from the same
probe. Every wait in it has a timeout: a missing peer raises ``CommError``, never hangs.

Example:
    >>> link = Link(alpha=1e-5, beta=1e-9)
    >>> round(link.time(1_000_000), 6)            # 10 us + 1 MB at 1 GB/s
    0.00101
    >>> [round(x, 12) for x in fit_alpha_beta([0, 1000, 2000], [1e-5, 2e-5, 3e-5])]
    [1e-05, 1e-08]
    >>> round(collective_time("all_reduce", 4_000_000, 4, Link(0.0, 1e-9)), 6)
    0.006
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from ._errors import CommError

__all__ = ["Link", "LinkProbe", "fit_alpha_beta", "collective_time", "collective_rounds",
           "probe_link", "DEFAULT_SIZES"]

DEFAULT_SIZES = (0, 16384, 262144, 2097152)
SPIN_S = 2e-3  # how long a blocked receive polls before it starts yielding (_transport.py)
QUANTILE = 25  # the fits use each size's lower quartile: the link while both ranks run
_TAGS = (1 << 27) - 8  # ping, pong, taken-while-waiting (below p2p's 2**28 limit)


@dataclass(frozen=True)
class Link:
    """The α-β model of one link, with each end's CPU time per message (s, s per byte)."""

    alpha: float = 0.0
    beta: float = 0.0
    send_fixed: float = 0.0
    send_per_byte: float = 0.0
    recv_fixed: float = 0.0
    recv_per_byte: float = 0.0
    wake: float = 0.0
    spin: float = SPIN_S

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise CommError(f"Link: {name} must be a non-negative number, got {value!r}")

    @classmethod
    def from_bandwidth(cls, bandwidth: float, latency: float = 0.0) -> "Link":
        """A link of ``bandwidth`` bytes per second and ``latency`` seconds (no CPU cost)."""
        if not bandwidth > 0:
            raise CommError(f"Link.from_bandwidth: bandwidth must be positive, got {bandwidth!r}")
        return cls(alpha=float(latency), beta=1.0 / float(bandwidth))

    def time(self, nbytes: float) -> float:
        """``α + β·n``: send start to a waiting receiver holding the message."""
        return self.alpha + self.beta * nbytes

    def send_time(self, nbytes: float) -> float:
        """Time the sender is busy posting ``nbytes``."""
        return self.send_fixed + self.send_per_byte * nbytes

    def recv_time(self, nbytes: float) -> float:
        """Time a receiver is busy taking ``nbytes`` that had already arrived."""
        return self.recv_fixed + self.recv_per_byte * nbytes

    def wake_time(self, waited: float) -> float:
        """Extra delay of a receive that waited ``waited`` seconds: ``wake`` once the wait
        outlasted ``spin`` (the receiver gave its core away and must be scheduled back)."""
        return self.wake if waited > self.spin else 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Link":
        return cls(**{k: float(values[k]) for k in cls.__dataclass_fields__ if k in values})


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(α, β)`` of ``times ≈ α + β·sizes``, both clipped at zero (a fit may
    dip below on noisy data; a negative latency or bandwidth means nothing).

    Raises:
        CommError: fewer than two distinct sizes, or lengths that differ.
    """
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(set(x.tolist())) < 2:
        raise CommError(f"fit_alpha_beta: expected equal-length 1-d sizes and times with at "
                        f"least two distinct sizes, got {x.shape} sizes {sorted(set(x.tolist()))}"
                        f" and {y.shape} times")
    beta, alpha = np.polyfit(x, y, 1)
    if beta < 0:  # flat within noise: all latency
        return max(float(y.mean()), 0.0), 0.0
    if alpha < 0:  # through the origin
        return 0.0, max(float((x @ y) / (x @ x)), 0.0)
    return float(alpha), float(beta)


_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "barrier", "send")


def _rounds_and_sent(kind: str, nbytes: float, n: int) -> tuple[int, float]:
    """(message rounds without the call check, bytes one rank sends) of the module table."""
    if kind not in _KINDS:
        raise CommError(f"collective_time: unknown collective, expected one of {_KINDS}, got "
                        f"{kind!r}")
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) * nbytes / n
    if kind in ("reduce_scatter", "all_gather"):
        return n - 1, (n - 1) * nbytes / n
    if kind == "send":
        return 1, nbytes
    depth = math.ceil(math.log2(n))
    return depth, depth * (1 if kind == "barrier" else nbytes)


def collective_rounds(kind: str, n: int) -> int:
    """Message rounds of one collective on ``n`` ranks, the call check included (0 for n = 1)."""
    rounds, _ = _rounds_and_sent(kind, 0, max(n, 1))
    if n <= 1:
        return 0
    return rounds + (0 if kind == "send" else 1)


def collective_time(kind: str, nbytes: float, n: int, link: Link,
                    sent_bytes: float | None = None) -> float:
    """Predicted seconds of one collective of ``nbytes`` (the tensor's bytes ``M``) on ``n``
    ranks: ``rounds·α + β·sent`` (module table). ``sent_bytes`` overrides the formula's
    bytes (traffic.py's exact per-rank prediction, for segments that do not divide evenly)."""
    rounds = collective_rounds(kind, n)
    if rounds == 0:
        return 0.0
    sent = _rounds_and_sent(kind, nbytes, n)[1] if sent_bytes is None else sent_bytes
    return rounds * link.alpha + link.beta * sent


@dataclass
class LinkProbe:
    """What :func:`probe_link` measured (lower quartiles per size, seconds), the fitted link
    and every sample."""

    sizes: list[int]
    one_way: list[float]
    send_busy: list[float]
    recv_busy: list[float]
    repeats: int
    link: Link
    samples: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"sizes": self.sizes, "one_way_s": self.one_way, "send_busy_s": self.send_busy,
                "recv_busy_s": self.recv_busy, "repeats": self.repeats,
                "link": self.link.as_dict(), "samples": self.samples}

    def residuals(self) -> dict[str, list[float]]:
        """Samples minus the fit, pooled over sizes (``flight``, ``send``, ``recv``), and the
        wake-up samples minus their median (``wake``): the noise a random draw of the
        simulator adds to a message."""
        k, s = self.link, self.samples
        out: dict[str, list[float]] = {"flight": [], "send": [], "recv": []}
        for n, ts, ss, rs in zip(s["sizes"], s["one_way"], s["send"], s["recv"], strict=True):
            out["flight"] += [t - k.time(n) for t in ts]
            out["send"] += [t - k.send_time(n) for t in ss]
            out["recv"] += [t - k.recv_time(n) for t in rs]
        out["wake"] = [w - k.wake for w in s["wake"]]
        return out


def probe_link(group: Any = None, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 30,
               peer: int = 1, timeout: float = 30.0, settle: float = 2e-3) -> LinkProbe | None:
    """Fit the link between group ranks 0 and ``peer`` (collective over the group: the other
    ranks only join its barriers). Returns the :class:`LinkProbe` on rank 0, None elsewhere.

    Per size (float32 arrays of ``n`` bytes), three phases of ``repeats`` rounds each:

    * ping-pong, back to back: rank 0 sends, ``peer`` echoes; one-way ``T(n)`` is half the
      round trip, ``o_s(n)`` the time rank 0's send call takes;
    * taking a waiting message: rank 0 posts one before a barrier; ``peer``, past the barrier
      and ``settle`` seconds later, times its receive (``o_r(n)``);
    * (smallest size only) waking: rank 0 sleeps ``2 x spin`` before its ping, so ``peer``
      has yielded its core by then; ``wake`` = that round trip minus ``2 T``.

    The fits use each size's lower quartile (:data:`QUANTILE`): the link while both ranks
    hold a core, not the preemptions of a busy machine; the samples are kept, and their
    residuals around the fit are the noise the simulator's random draws add
    (:meth:`LinkProbe.residuals`). ``wake`` is the median. The first round of each phase
    warms the path and is dropped.

    Raises:
        CommError: a peer that does not answer within ``timeout`` seconds, bad sizes.
    """
    from ._group import resolve
    from .object_collectives import all_gather_object

    pg = resolve(group, "probe_link")
    if pg.size < 2 or not 0 < peer < pg.size:
        raise CommError(f"probe_link: needs ranks 0 and peer {peer} of a group of at least "
                        f"2, got a group of {pg.size}")
    if len(set(sizes)) < 2 or min(sizes) < 0 or repeats < 2:
        raise CommError(f"probe_link: expected at least two distinct non-negative sizes and "
                        f"repeats >= 2, got sizes {list(sizes)}, repeats {repeats}")
    sizes_ = sorted({int(n) for n in sizes})
    role = 0 if pg.rank == 0 else 1 if pg.rank == peer else None
    rows = {n: _probe_size(pg, role, peer, n, repeats, timeout, settle) for n in sizes_}
    wakes = _probe_wake(pg, role, peer, repeats, timeout)
    takes = all_gather_object({n: rows[n]["recv"] for n in sizes_} if role == 1 else None,
                              group=pg)[peer]
    if role != 0:
        return None
    low = lambda xs: float(np.percentile(xs, QUANTILE))  # noqa: E731
    med = lambda xs: float(np.median(xs))  # noqa: E731
    one_way = [low(rows[n]["one_way"]) for n in sizes_]
    send_busy = [low(rows[n]["send"]) for n in sizes_]
    recv_busy = [low(takes[n]) for n in sizes_]
    alpha, beta = fit_alpha_beta(sizes_, one_way)
    s0, s1 = fit_alpha_beta(sizes_, send_busy)
    r0, r1 = fit_alpha_beta(sizes_, recv_busy)
    wake = [max(0.0, w - 2 * alpha) for w in wakes]
    link = Link(alpha, beta, s0, s1, r0, r1, med(wake))
    samples = {"sizes": sizes_, "one_way": [rows[n]["one_way"] for n in sizes_],
               "send": [rows[n]["send"] for n in sizes_], "recv": [takes[n] for n in sizes_],
               "wake": wake}
    return LinkProbe(sizes_, one_way, send_busy, recv_busy, repeats, link, samples)


def _probe_size(pg: Any, role: int | None, peer: int, n: int, repeats: int, timeout: float,
                settle: float) -> dict[str, list[float]]:
    from . import p2p
    from .collectives import barrier

    buf = np.ones(n // 4, np.float32)
    out: dict[str, list[float]] = {"one_way": [], "send": [], "recv": []}
    barrier(group=pg, timeout=timeout)
    for k in range(repeats + 1):  # back-to-back ping-pong
        if role == 0:
            t0 = time.perf_counter()
            work = p2p.isend_array(buf, peer, tag=_TAGS, group=pg, timeout=timeout)
            t1 = time.perf_counter()
            p2p.recv_array(peer, tag=_TAGS + 1, group=pg, timeout=timeout)
            t2 = time.perf_counter()
            work.wait()
            if k:
                out["one_way"].append((t2 - t0) / 2)
                out["send"].append(t1 - t0)
        elif role == 1:
            got = p2p.recv_array(0, tag=_TAGS, group=pg, timeout=timeout)
            p2p.isend_array(got, 0, tag=_TAGS + 1, group=pg, timeout=timeout).wait()
    for k in range(repeats + 1):  # taking a message that is already there
        third = p2p.isend_array(buf, peer, tag=_TAGS + 2, group=pg,
                                timeout=timeout) if role == 0 else None
        barrier(group=pg, timeout=timeout)
        if role == 1:
            time.sleep(settle)
            t0 = time.perf_counter()
            p2p.recv_array(0, tag=_TAGS + 2, group=pg, timeout=timeout)
            if k:
                out["recv"].append(time.perf_counter() - t0)
        if third is not None:
            third.wait()
    return out


def _probe_wake(pg: Any, role: int | None, peer: int, repeats: int, timeout: float
                ) -> list[float]:
    """Round trips of an empty message to a receiver that waited ``2 x SPIN_S`` first."""
    from . import p2p
    from .collectives import barrier

    buf = np.ones(0, np.float32)
    trips = []
    for k in range(repeats + 1):
        barrier(group=pg, timeout=timeout)
        if role == 0:
            time.sleep(2 * SPIN_S)
            t0 = time.perf_counter()
            work = p2p.isend_array(buf, peer, tag=_TAGS + 3, group=pg, timeout=timeout)
            p2p.recv_array(peer, tag=_TAGS + 4, group=pg, timeout=timeout)
            if k:
                trips.append(time.perf_counter() - t0)
            work.wait()
        elif role == 1:
            p2p.recv_array(0, tag=_TAGS + 3, group=pg, timeout=timeout)
            p2p.isend_array(buf, 0, tag=_TAGS + 4, group=pg, timeout=timeout).wait()
    return trips
