"""TCP transport over ZeroMQ: one PULL socket per rank receives, one PUSH socket per peer sends.

Start-up: the rendezvous (``_tcp_rendezvous``) hands every rank the table of receive addresses.
With ``NEEDLE_DIST_AUTH=curve`` (the default) every connection is authenticated and encrypted
with keys derived from the job secret (``_tcp_security``), so only ranks of this job can deliver
a frame, and each frame's claimed sender must be the rank its connection authenticated as.

A receiver thread moves arriving frames into the rank's mailbox (no copy when no receive is
waiting). It never dies on bad input: a frame that is malformed, of another job, or from a rank
other than its connection's is dropped and counted in ``stats``. Peers that go away are noticed
at once: a rank that shuts down sends a goodbye, and a connection that closes without one (the
peer was killed or crashed) or fails authentication marks that peer gone, so that receives from
it and sends to it raise a PeerError naming it instead of waiting for the timeout.

Rejoining: a rank restarted by the launcher (``--restart-workers``; environment
``NEEDLE_DIST_REJOIN``) skips the rendezvous, which is over: it reads the receive addresses that
rank 0 wrote to the launcher's status directory, binds a fresh receive socket, and sends every
peer a REJOIN frame carrying its new address. A peer then connects to the new address, forgets
that the rank was gone and drops what the dead incarnation left unreceived, so the restarted
rank is an ordinary peer again (the parameter server relies on this for restarted workers).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from ._errors import PeerError
from ._tcp_rendezvous import (
    Rendezvous,
    handshake_failure,
    local_address,
    monitored_events,
    resolve_ip,
)
from ._tcp_security import Security
from ._transport import (
    DoneRequest,
    FailedRequest,
    Mailbox,
    MailboxChannel,
    MailboxTransportMixin,
    Request,
    unexpected_limit_bytes,
)

_FRAME = struct.Struct("<QBiiq")  # job hash, kind, channel id, source rank, tag
_DATA, _BYE, _REJOIN, _STOP = 0, 1, 2, 3  # _STOP: rank 0 stops the job, with its reason
REJOIN_ENV = "NEEDLE_DIST_REJOIN"
ADDRESSES_FILE = "tcp_addresses.json"


def _addresses_path() -> str | None:
    from ._run_rank import STATUS_DIR_ENV

    folder = os.environ.get(STATUS_DIR_ENV)
    return os.path.join(folder, ADDRESSES_FILE) if folder else None


def _write_addresses(table: list[str]) -> None:
    path = _addresses_path()
    if path is None:
        return
    from needle.serialization import atomic_write_bytes  # a random, exclusive temporary

    try:
        atomic_write_bytes(path, json.dumps(table).encode())
    except OSError:
        pass


def _zmq() -> Any:
    import zmq  # lazily: only the tcp backend needs pyzmq

    return zmq


def job_hash(job_id: str) -> int:
    """The job identity as carried in every frame header (64 bits)."""
    return int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "little")


def pack_header(job_id: str, kind: int, channel_id: int, src: int, tag: int) -> bytes:
    return _FRAME.pack(job_hash(job_id), kind, channel_id, src, tag)


class ZmqSendRequest(Request):
    """A zero-copy send: done when ZeroMQ has released the buffer. If the peer is gone and the
    buffer is still held a moment later, the message will never leave: fail instead of waiting
    for the timeout. (The moment covers a send that did complete just before the peer left,
    whose release libzmq reports a little later.)"""

    GONE_GRACE = 0.5

    def __init__(self, tracker: Any, keepalive: Any, transport: "TcpTransport", dst: int):
        self.tracker = tracker
        self.keepalive = keepalive  # the buffer must outlive the zero-copy send
        self.transport, self.dst = transport, dst
        self._gone_seen: float | None = None

    def test(self) -> bool:
        if self.tracker.done:
            return True
        if self.transport.mailbox.gone(self.dst) is not None:
            now = time.monotonic()
            self._gone_seen = self._gone_seen or now
            if now - self._gone_seen > self.GONE_GRACE:
                self.transport.raise_if_gone(self.dst)
        return False


class TcpTransport(MailboxTransportMixin):
    backend = "tcp"
    DISCONNECT_GRACE = 1.0  # seconds between a closed connection and "the peer is gone"
    SHUTDOWN_GRACE = 10.0   # seconds close() waits for the receiver thread and for libzmq

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int, timeout: float,
                 security: Security | None = None):
        zmq = _zmq()
        self.rank, self.size = rank, size
        self.security = security or Security.from_env(size)
        self._job = job_hash(self.security.job_id)
        self.ctx = zmq.Context()
        self.mailbox = Mailbox(unexpected_limit_bytes())
        self.drops: Counter = Counter()
        self.push: dict[int, Any] = {}
        self._monitors: dict[Any, int] = {}
        self._connected: set[int] = set()
        self._suspects: dict[int, float] = {}  # peer -> when its connection closed
        self._closing = False
        self._thread: threading.Thread | None = None
        self._poller: Any = None
        self.rendezvous: Any = None
        self.zap = None
        try:
            self.zap = self.security.start_handler(self.ctx)
            master_ip = resolve_ip(master_addr, "MASTER_ADDR")
            self.pull = self.ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.RCVHWM, 0)
            self.pull.linger = 0
            self.security.make_server(self.pull, rank)
            self.pull.bind_to_random_port(f"tcp://{local_address(master_ip)}")
            self.address = self.pull.getsockopt(zmq.LAST_ENDPOINT).decode()
            rejoin = bool(os.environ.get(REJOIN_ENV))
            if rejoin:
                table = self._saved_addresses(size)
                table[rank] = self.address
                _write_addresses(table)
            else:
                self.rendezvous = Rendezvous(self.ctx, self.security, rank, size, master_ip,
                                             int(master_port), timeout)
                table = self.rendezvous.run(self.address)
                if rank == 0:
                    _write_addresses(table)
            self._timeout = timeout
            self._table = table
            self._connect(table, timeout)
        except BaseException:
            self._teardown()
            raise
        self.locks = {r: threading.Lock() for r in range(size)}
        if rejoin:
            for sock in self.push.values():
                sock.send_multipart([pack_header(self.security.job_id, _REJOIN, 0, rank, 0),
                                     self.address.encode()])
        self._thread = threading.Thread(target=self._serve, name=f"needle-tcp-rx-{rank}")
        self._thread.daemon = True
        self._thread.start()

    @staticmethod
    def _saved_addresses(size: int) -> list[str]:
        path = _addresses_path()
        try:
            with open(path or "") as f:
                table = json.load(f)
        except (OSError, ValueError):
            table = None
        if not isinstance(table, list) or len(table) != size:
            raise PeerError(f"init_process_group: {REJOIN_ENV} is set but the job's address "
                            f"table ({path}) is missing or malformed: only a rank restarted "
                            "by needle's launcher can rejoin", 0, "gone")
        return table

    def _connect(self, table: list[str], timeout: float) -> None:
        for peer, address in enumerate(table):
            if peer != self.rank:
                self.push[peer] = self._push_socket(peer, address, timeout)

    def _push_socket(self, peer: int, address: str, timeout: float) -> Any:
        zmq = _zmq()
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, int(min(timeout, 10.0) * 1000))
        self.security.make_client(sock, self.rank, peer)
        monitor = sock.get_monitor_socket(monitored_events())
        self._monitors[monitor] = peer
        if self._poller is not None:
            self._poller.register(monitor, _zmq().POLLIN)
        sock.connect(address)
        return sock

    def _on_rejoin(self, peer: int, address: str) -> None:
        """``peer`` was restarted and listens at ``address`` now (receiver thread)."""
        with self.locks[peer]:
            old = self.push.pop(peer)
            old.disable_monitor()  # before closing its reader (see _teardown)
            for monitor, who in list(self._monitors.items()):
                if who == peer:
                    self._poller.unregister(monitor)
                    del self._monitors[monitor]
                    monitor.close(0)
            old.close(linger=0)
            self._connected.discard(peer)
            self._suspects.pop(peer, None)
            self.push[peer] = self._push_socket(peer, address, self._timeout)
        # receives still waiting on the dead incarnation fail (also when its death was not
        # noticed yet), then the rank is an ordinary peer again
        self.mailbox.mark_gone(peer, f"rank {peer} was restarted: its previous process is gone")
        self.mailbox.revive(peer)

    @property
    def stats(self) -> dict:
        """Counters for what the receiver refused or held: dropped frames (and why), refused
        connections (failed authentication), peak bytes of messages waiting for a receive."""
        return {"dropped_frames": sum(self.drops.values()), "drop_reasons": dict(self.drops),
                "refused_connections": self.zap.rejected if self.zap else 0,
                "refused_hellos": (self.rendezvous.strangers
                                   if self.rank == 0 and self.rendezvous else 0),
                "peak_unexpected_bytes": self.mailbox.peak_held_bytes}

    # ----- receiving --------------------------------------------------------------------
    def _serve(self) -> None:
        zmq = _zmq()
        poller = self._poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        router = self.rendezvous.router if self.rendezvous is not None else None
        if router is not None:
            poller.register(router, zmq.POLLIN)
        while not self._closing:
            try:
                events = dict(poller.poll(50))
                if self.pull in events:
                    self._drain()  # goodbyes first, then the closed connections they explain
                if router is not None and router in events:
                    stop = self.rendezvous.answer_late(self._table)
                    if stop:
                        self._stop_job(f"rank 0 stopped the job: {stop}")
                for monitor, peer in list(self._monitors.items()):
                    if monitor in events:
                        self._on_event(monitor, peer)
                self._judge_suspects()
            except zmq.ContextTerminated:
                return
            except Exception as exc:  # noqa: BLE001 - the receiver must outlive any bad input
                self.drops[f"receiver error: {type(exc).__name__}: {exc}"[:200]] += 1

    def _drain(self) -> None:
        zmq = _zmq()
        while True:
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            reason = self._reject(frames)
            if reason:
                self.drops[reason] += 1
                continue
            _, kind, channel_id, src, tag = _FRAME.unpack(frames[0].bytes)
            if kind == _BYE:
                self.mailbox.mark_gone(src, f"rank {src} left the process group (exited)")
            elif kind == _STOP:
                self._fail_every_peer(bytes(frames[1].bytes[:2000]).decode(errors="replace"))
            elif kind == _REJOIN:
                self._on_rejoin(src, frames[1].bytes.decode())
            else:
                self.mailbox.deliver((channel_id, src, tag), frames[1].buffer)

    def _reject(self, frames: list) -> str | None:
        """Why a received message must be dropped, or None when it is well formed and ours."""
        if len(frames[0]) != _FRAME.size or len(frames) > 2:
            return f"malformed frame ({len(frames)} parts, header of {len(frames[0])} bytes)"
        job, kind, channel_id, src, tag = _FRAME.unpack(frames[0].bytes)
        if job != self._job:
            return "frame of another job"
        if kind not in (_DATA, _BYE, _REJOIN, _STOP) or len(frames) != (1 if kind == _BYE else 2):
            return f"malformed frame (kind {kind} with {len(frames)} parts)"
        if not 0 <= src < self.size or src == self.rank or channel_id < 0 or tag < 0:
            return f"malformed frame (source {src}, channel {channel_id}, tag {tag})"
        if self.security.enabled and frames[0].get("User-Id") != str(src):
            return "frame whose claimed source is not its connection's rank"
        return None

    def _on_event(self, monitor: Any, peer: int) -> None:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)["event"]
        zmq = _zmq()
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected.add(peer)
        elif handshake_failure(event):
            self.mailbox.mark_gone(peer, (
                f"rank {peer} refused this rank's connection ({handshake_failure(event)}): "
                "its job secret differs, or the address belongs to another job"), "refused")
        elif event == zmq.EVENT_DISCONNECTED and peer in self._connected and not self._closing:
            # The connection *to* the peer closed; what the peer sent before dying travels on
            # its own connection to us and may still be on its way: judge a moment later.
            self._suspects.setdefault(peer, time.monotonic())

    def _judge_suspects(self) -> None:
        now = time.monotonic()
        for peer, since in list(self._suspects.items()):
            if now - since > self.DISCONNECT_GRACE:
                del self._suspects[peer]
                self.mailbox.mark_gone(peer, f"rank {peer} is gone: its connection closed "
                                             "without a goodbye (killed or crashed)")

    def _stop_job(self, reason: str) -> None:
        """Tell every peer why the job stops, then fail this rank's own communication."""
        head = _FRAME.pack(self._job, _STOP, 0, self.rank, 0)
        for peer, sock in self.push.items():
            with self.locks[peer]:
                try:
                    sock.send_multipart([head, reason.encode()], _zmq().NOBLOCK)
                except _zmq().ZMQError:
                    pass  # that peer fails on its own when this rank stops answering
        self._fail_every_peer(reason)

    def _fail_every_peer(self, reason: str) -> None:
        for peer in range(self.size):
            if peer != self.rank:
                self.mailbox.mark_gone(peer, reason, "refused")

    # ----- sending ----------------------------------------------------------------------
    def raise_if_gone(self, peer: int) -> None:
        gone = self.mailbox.gone(peer)
        if gone is not None:
            raise PeerError(gone.reason, peer, gone.kind)

    def channel(self, channel_id: int, ranks: list[int]) -> MailboxChannel:
        return MailboxChannel(self, channel_id, ranks)

    def send_bytes(self, buf: np.ndarray, dst: int, key: tuple) -> Request:
        if dst == self.rank:
            self.mailbox.deliver_into(key, buf)
            return DoneRequest()
        gone = self.mailbox.gone(dst)
        if gone is not None:
            return FailedRequest(PeerError(gone.reason, dst, gone.kind))
        head = _FRAME.pack(self._job, _DATA, key[0], key[1], key[2])
        body = buf.reshape(-1).view(np.uint8)
        with self.locks[dst]:
            tracker = self.push[dst].send_multipart([head, body], copy=False, track=True)
        return ZmqSendRequest(tracker, body, self, dst)

    def native_for(self, channel: MailboxChannel) -> None:
        return None

    # ----- shutdown ---------------------------------------------------------------------
    def close(self) -> None:
        zmq = _zmq()
        bye = _FRAME.pack(self._job, _BYE, 0, self.rank, 0)
        for peer, sock in self.push.items():
            if self.mailbox.gone(peer) is None:
                with self.locks[peer]:
                    try:  # never block shutdown on a peer that no longer reads
                        sock.send(bye, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
        self._closing = True
        if self._thread is not None:
            self._thread.join(timeout=self.SHUTDOWN_GRACE)
        self._teardown()

    def _teardown(self) -> None:
        self._closing = True
        if self._thread is not None and self._thread.is_alive():
            # The receiver still polls these sockets; closing them under it is undefined in
            # libzmq. Leave them (and the context) to the end of the process.
            self._warn("its receiver thread did not stop")
            return
        # libzmq can block in a socket's close or in the context's term (queued messages,
        # zero-copy buffers it still holds); the rank's work is done, so bound the wait and
        # leave a stuck shutdown to process exit, saying so.
        done = threading.Event()

        def shut() -> None:
            self._close_sockets()
            done.set()

        threading.Thread(target=shut, name=f"needle-tcp-close-{self.rank}", daemon=True).start()
        if not done.wait(self.SHUTDOWN_GRACE):
            self._warn("libzmq did not release its sockets and context")

    def _close_sockets(self) -> None:
        # Stop every monitor before closing its reading end: an I/O thread that emits an
        # event into a monitor nobody reads blocks for ever while holding the socket's
        # monitor lock, and a later disable_monitor() or close() then waits on that lock.
        for sock in self.push.values():
            sock.disable_monitor()
        for monitor in self._monitors:
            monitor.close(0)
        for sock in self.push.values():
            sock.close(linger=1000)  # flush to live peers, do not wait long for dead ones
        if getattr(self, "pull", None) is not None:
            self.pull.close(0)
        if self.rendezvous is not None:
            self.rendezvous.close()
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()

    def _warn(self, what: str) -> None:
        print(f"needle.distributed: rank {self.rank}: the tcp transport did not shut down "
              f"within {self.SHUTDOWN_GRACE:g} s ({what}); leaving it to process exit",
              file=sys.stderr, flush=True)
