"""TCP transport over ZeroMQ: one PULL socket per rank receives, one PUSH socket per peer sends.

Rendezvous: rank 0 binds a ROUTER at MASTER_ADDR:MASTER_PORT; every rank reports the address of
its PULL socket there and gets back the table of all addresses. A receiver thread moves arriving
frames into the rank's mailbox (no copy when no receive is waiting). A rank that shuts down
sends a goodbye so that peers waiting for it fail at once instead of at their timeout.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from ._errors import CommError
from ._transport import (
    DoneRequest,
    Mailbox,
    MailboxChannel,
    MailboxTransportMixin,
    Request,
)

_FRAME = struct.Struct("<Biiq")  # kind, channel id, source rank, tag
_DATA, _BYE = 0, 1


def _zmq() -> Any:
    import zmq  # lazily: only the tcp backend needs pyzmq

    return zmq


def _local_address(master_addr: str) -> str:
    """The IP of the interface that reaches the master (loopback stays loopback)."""
    if master_addr in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master_addr, 9))
        return probe.getsockname()[0]
    finally:
        probe.close()


class ZmqSendRequest(Request):
    def __init__(self, tracker: Any, keepalive: Any):
        self.tracker = tracker
        self.keepalive = keepalive  # the buffer must outlive the zero-copy send

    def test(self) -> bool:
        return self.tracker.done


class TcpTransport(MailboxTransportMixin):
    backend = "tcp"

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int, timeout: float):
        zmq = _zmq()
        self.rank, self.size = rank, size
        self.ctx = zmq.Context()
        self.mailbox = Mailbox()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        host = _local_address(master_addr)
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        table = self._rendezvous(f"tcp://{host}:{port}", master_addr, master_port, timeout)
        self.push: dict[int, Any] = {}
        self.locks = {r: threading.Lock() for r in range(size)}
        for peer, address in enumerate(table):
            if peer != rank:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.LINGER, int(min(timeout, 10.0) * 1000))
                sock.connect(address)
                self.push[peer] = sock
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name=f"needle-tcp-rx-{rank}")
        self._thread.daemon = True
        self._thread.start()

    def _rendezvous(self, mine: str, master_addr: str, port: int, timeout: float) -> list[str]:
        zmq = _zmq()
        deadline = time.monotonic() + timeout
        router = None
        if self.rank == 0:
            router = self.ctx.socket(zmq.ROUTER)
            bind_host = "127.0.0.1" if _local_address(master_addr) == "127.0.0.1" else "*"
            try:
                router.bind(f"tcp://{bind_host}:{port}")
            except zmq.ZMQError as exc:
                router.close(0)
                raise CommError(
                    f"init_process_group: rank 0 cannot listen on MASTER_PORT {port} ({exc})"
                ) from None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{master_addr}:{port}")
        dealer.send_json({"rank": self.rank, "size": self.size, "address": mine})
        try:
            if router is not None:
                self._serve_rendezvous(router, deadline)
            if not dealer.poll(max(deadline - time.monotonic(), 0.0) * 1000):
                raise CommError(
                    f"init_process_group: rank {self.rank} timed out after {timeout} s waiting "
                    f"for the rendezvous at {master_addr}:{port} (is rank 0 running?)"
                )
            reply = dealer.recv_json()
        finally:
            dealer.close(0)
            if router is not None:
                router.close(int(1000 * min(timeout, 5.0)))
        if "error" in reply:
            raise CommError(f"init_process_group: {reply['error']}")
        return reply["table"]

    def _serve_rendezvous(self, router: Any, deadline: float) -> None:
        seen: dict[int, tuple[bytes, str]] = {}
        error = None
        while len(seen) < self.size:
            if not router.poll(max(deadline - time.monotonic(), 0.0) * 1000):
                missing = sorted(set(range(self.size)) - set(seen))
                raise CommError(
                    f"init_process_group: rank 0 timed out waiting for ranks {missing} "
                    "to join the rendezvous"
                )
            ident, raw = router.recv_multipart()
            hello = json.loads(raw)
            if hello["size"] != self.size or hello["rank"] in seen:
                error = (
                    f"rendezvous mismatch, expected WORLD_SIZE={self.size} and unique ranks, "
                    f"got rank {hello['rank']} with WORLD_SIZE={hello['size']}"
                )
            seen[hello["rank"]] = (ident, hello["address"])
            if len(seen) == self.size or error:
                break
        table = [seen[r][1] for r in sorted(seen)] if not error else []
        reply = {"error": error} if error else {"table": table}
        for ident, _ in seen.values():
            router.send_multipart([ident, json.dumps(reply).encode()])
        if error:
            raise CommError(f"init_process_group: {error}")

    def _serve(self) -> None:
        zmq = _zmq()
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self._closing:
            if not poller.poll(50):
                continue
            frames = self.pull.recv_multipart(copy=False)
            kind, channel_id, src, tag = _FRAME.unpack(frames[0].bytes)
            if kind == _BYE:
                self.mailbox.mark_gone(src, f"rank {src} left the process group (exited)")
            else:
                self.mailbox.deliver((channel_id, src, tag), frames[1].buffer)

    def channel(self, channel_id: int, ranks: list[int]) -> MailboxChannel:
        return MailboxChannel(self, channel_id, ranks)

    def send_bytes(self, buf: np.ndarray, dst: int, key: tuple) -> Request:
        if dst == self.rank:
            self.mailbox.deliver_into(key, buf)
            return DoneRequest()
        head = _FRAME.pack(_DATA, key[0], key[1], key[2])
        body = buf.reshape(-1).view(np.uint8)
        with self.locks[dst]:
            tracker = self.push[dst].send_multipart([head, body], copy=False, track=True)
        return ZmqSendRequest(tracker, body)

    def native_for(self, channel: MailboxChannel) -> None:
        return None

    def close(self) -> None:
        bye = _FRAME.pack(_BYE, 0, self.rank, 0)
        for peer, sock in self.push.items():
            with self.locks[peer]:
                sock.send(bye)
        self._closing = True
        self._thread.join(timeout=5.0)
        for sock in self.push.values():
            # Short linger: flush to live peers, but do not wait long for dead ones.
            sock.close(linger=1000)
        self.pull.close(0)
        self.ctx.term()
