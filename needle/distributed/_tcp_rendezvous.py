"""Rendezvous of the tcp transport: every rank learns every other rank's receive address.

Rank 0 binds a ROUTER at exactly MASTER_ADDR:MASTER_PORT (never a wildcard address); every rank
(rank 0 included) sends a hello ``{job, rank, size, address}`` from a DEALER and waits for the
table of addresses. With CURVE on, both sockets authenticate (see ``_tcp_security``), so only
holders of the job secret get through, and the hello's rank must be the authenticated one.

A hello from another job (different job id, or a connection that fails authentication) never
joins: the stranger is told, and fails loudly, while this job keeps waiting for its own ranks.
A hello of this job that contradicts the others (a rank twice, another world size) fails
everyone, since the job's own configuration is wrong.

Rank 0 keeps the rendezvous socket for the life of the job, so that a second job on the same
MASTER_PORT cannot bind it, and its ranks reach this rank 0 instead of a rank 0 of their own.
Ranks started by hand with the same secret cannot be told apart by anything they carry, so a
hello after the rendezvous that claims one of this job's ranks means two jobs share the secret
and the port, and some of this job's ranks may be the other job's: ``answer_late`` refuses the
newcomer and returns why this job must stop too.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from ._errors import CommError
from ._tcp_security import AUTH_ENV, SECRET_ENV, Security

LOCAL_ADDR_ENV = "NEEDLE_DIST_LOCAL_ADDR"
_HANDSHAKE_FAILURES = ("HANDSHAKE_FAILED_NO_DETAIL", "HANDSHAKE_FAILED_PROTOCOL",
                       "HANDSHAKE_FAILED_AUTH")


def _zmq() -> Any:
    import zmq

    return zmq


def resolve_ip(host: str, what: str) -> str:
    """The IPv4 address ``host`` names (a name is looked up once, so every socket agrees)."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError) as exc:
        raise CommError(f"init_process_group: cannot resolve {what}, expected a host name or "
                        f"IPv4 address, got {host!r} ({exc})") from None


def local_address(master_ip: str) -> str:
    """Where this rank receives: NEEDLE_DIST_LOCAL_ADDR, else the interface that reaches the
    master (loopback for a loopback master)."""
    if os.environ.get(LOCAL_ADDR_ENV):
        return resolve_ip(os.environ[LOCAL_ADDR_ENV], LOCAL_ADDR_ENV)
    if master_ip.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master_ip, 9))
        return probe.getsockname()[0]
    except OSError as exc:
        raise CommError(f"init_process_group: no route to MASTER_ADDR {master_ip} ({exc}); set "
                        f"{LOCAL_ADDR_ENV} to this machine's address") from None
    finally:
        probe.close()


def monitored_events() -> int:
    zmq = _zmq()
    mask = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
    for name in _HANDSHAKE_FAILURES:
        mask |= getattr(zmq, "EVENT_" + name)
    return mask


def handshake_failure(event: int) -> str | None:
    """The name of a failed-authentication monitor event, else None."""
    zmq = _zmq()
    for name in _HANDSHAKE_FAILURES:
        if event == getattr(zmq, "EVENT_" + name):
            return name
    return None


class Rendezvous:
    """One rank's part of the rendezvous (rank 0 also serves it)."""

    def __init__(self, ctx: Any, security: Security, rank: int, size: int, master_ip: str,
                 port: int, timeout: float):
        self.ctx, self.security, self.rank, self.size = ctx, security, rank, size
        self.where = f"{master_ip}:{port}"
        self.master_ip, self.port, self.timeout = master_ip, port, timeout
        self.deadline = time.monotonic() + timeout
        self.strangers = 0  # hellos refused because they came from another job
        self.router: Any = None

    def run(self, mine: str) -> list[str]:
        """Send this rank's address; return every rank's address (index = rank)."""
        router = self._bind() if self.rank == 0 else None
        dealer = self._connect()
        try:
            dealer.send_json({"job": self.security.job_id, "rank": self.rank, "size": self.size,
                              "address": mine})
            if router is not None:
                self._serve(router)
            reply = self._await_reply(dealer)
        except BaseException:
            if router is not None:
                router.close(int(1000 * min(self.timeout, 5.0)))
            raise
        finally:
            dealer.disable_monitor()
            self._monitor.close(0)
            dealer.close(0)
        self.router = router  # rank 0: held until close(), see answer_late
        if "error" in reply:
            raise CommError(f"init_process_group: rank {self.rank}: {reply['error']}")
        table = reply.get("table")
        if not isinstance(table, list) or len(table) != self.size:
            raise CommError(f"init_process_group: bad rendezvous reply, expected {self.size} "
                            f"addresses, got {reply!r:.200}")
        return table

    def close(self) -> None:
        if self.router is not None:
            self.router.close(1000)  # let a last refusal reach its newcomer
            self.router = None

    # ----- rank 0 -----------------------------------------------------------------------
    def answer_late(self, table: list[str]) -> str | None:
        """Answer one hello that arrived after the rendezvous (rank 0, receiver thread).
        A stranger is refused; a process of this job (same job id) that claims a rank is a
        second job with this secret and port: refuse it and return why this job must stop."""
        frames = self.router.recv_multipart(copy=False)
        hello, refusal, misfit = self._judge(frames)
        stop = None
        if refusal is None and misfit is None:
            rank = hello["rank"]
            stop = (f"a second process with this job's secret claims rank {rank} (from "
                    f"{hello['address']}) after rank {rank} joined (from {table[rank]}): two "
                    f"jobs share {SECRET_ENV} and MASTER_PORT {self.port}, so this job cannot "
                    "tell its own ranks from the other's; give each job its own secret or port")
        if refusal is None:
            refusal = (f"the rendezvous at {self.where} belongs to a job that is already "
                       f"running: {stop or misfit}" + ("; that job stops too" if stop else ""))
        self.strangers += 1
        self.router.send_multipart([frames[0].bytes, json.dumps({"error": refusal}).encode()])
        return stop

    def _bind(self) -> Any:
        zmq = _zmq()
        router = self.ctx.socket(zmq.ROUTER)
        router.linger = 0
        self.security.make_server(router, 0)
        try:
            router.bind(f"tcp://{self.master_ip}:{self.port}")
        except zmq.ZMQError as exc:
            router.close(0)
            raise CommError(
                f"init_process_group: rank 0 cannot listen on MASTER_ADDR:MASTER_PORT "
                f"{self.where} ({exc}); another job uses the port, or rank 0 is not on the "
                "machine MASTER_ADDR names") from None
        return router

    def _serve(self, router: Any) -> None:
        seen: dict[int, tuple[bytes, str]] = {}
        while len(seen) < self.size:
            left = self.deadline - time.monotonic()
            if left <= 0 or not router.poll(left * 1000):
                missing = sorted(set(range(self.size)) - set(seen))
                raise CommError(f"init_process_group: rank 0 timed out after {self.timeout:g} s "
                                f"waiting for ranks {missing} to join the rendezvous at "
                                f"{self.where}")
            frames = router.recv_multipart(copy=False)
            ident = frames[0].bytes
            hello, stranger, fatal = self._judge(frames)
            if stranger:
                self.strangers += 1
                router.send_multipart([ident, json.dumps({"error": stranger}).encode()])
                continue
            if fatal is None and hello["rank"] in seen:
                fatal = f"rank {hello['rank']} joined twice, expected every rank once"
            if fatal:
                for other, _ in [*seen.values(), (ident, "")]:
                    router.send_multipart([other, json.dumps({"error": fatal}).encode()])
                raise CommError(f"init_process_group: rendezvous at {self.where}: {fatal}")
            seen[hello["rank"]] = (ident, hello["address"])
        reply = json.dumps({"table": [seen[r][1] for r in range(self.size)]}).encode()
        for ident, _ in seen.values():
            router.send_multipart([ident, reply])

    def _judge(self, frames: list) -> tuple[dict, str | None, str | None]:
        """(hello, why a stranger is refused, why the job itself is misconfigured)."""
        try:
            hello = json.loads(frames[1].bytes) if len(frames) == 2 else None
        except ValueError:
            hello = None
        types = {"job": str, "rank": int, "size": int, "address": str}
        if not isinstance(hello, dict) or any(not isinstance(hello.get(k), t)
                                              for k, t in types.items()):
            return {}, "malformed rendezvous hello, expected JSON with " + ", ".join(
                f"{k} ({t.__name__})" for k, t in types.items()), None
        if hello["job"] != self.security.job_id:
            return hello, (f"the rendezvous at {self.where} belongs to another job (job id "
                           f"{self.security.job_id}, got {hello['job']}): two jobs on one "
                           "MASTER_PORT?"), None
        if self.security.enabled and frames[1].get("User-Id") != str(hello["rank"]):
            return hello, None, (f"a hello claims rank {hello['rank']} but authenticated as "
                                 f"rank {frames[1].get('User-Id')}")
        if hello["size"] != self.size or not 0 <= hello["rank"] < self.size:
            return hello, None, (f"WORLD_SIZE mismatch, expected WORLD_SIZE={self.size} and "
                                 f"0 <= rank < {self.size}, got rank {hello['rank']} with "
                                 f"WORLD_SIZE={hello['size']}")
        return hello, None, None

    # ----- every rank -------------------------------------------------------------------
    def _connect(self) -> Any:
        zmq = _zmq()
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.linger = 0
        self.security.make_client(dealer, self.rank, 0)
        self._monitor = dealer.get_monitor_socket(monitored_events())
        dealer.connect(f"tcp://{self.master_ip}:{self.port}")
        return dealer

    def _await_reply(self, dealer: Any) -> dict:
        zmq = _zmq()
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            left = self.deadline - time.monotonic()
            events = dict(poller.poll(max(left, 0) * 1000)) if left > 0 else {}
            if dealer in events:
                try:
                    reply = json.loads(dealer.recv())
                except ValueError:
                    reply = None
                return reply if isinstance(reply, dict) else {"error": "malformed reply"}
            if self._monitor in events:
                failed = handshake_failure(recv_monitor_message(self._monitor)["event"])
                if failed:
                    raise CommError(self._refused(failed))
                continue
            if left <= 0:
                raise CommError(
                    f"init_process_group: rank {self.rank} timed out after {self.timeout:g} "
                    f"s waiting for the rendezvous at {self.where} (is rank 0 running?)")

    def _refused(self, event: str) -> str:
        return (f"init_process_group: rank {self.rank} could not authenticate with the "
                f"rendezvous at {self.where} ({event}): it belongs to another job (a different "
                f"{SECRET_ENV}, or {AUTH_ENV} differs); is another job using MASTER_PORT "
                f"{self.port}?")
