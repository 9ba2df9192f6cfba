"""The tcp transport's shutdown is bounded: libzmq's context termination (which waits for
queued messages and zero-copy buffers) was seen to block a rank's exit for ever under load."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from needle.distributed._tcp_transport import TcpTransport

pytestmark = pytest.mark.timeout(60)


class _StuckContext:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.term_called = threading.Event()

    def term(self) -> None:
        self.term_called.set()
        self.release.wait()


def test_context_termination_that_never_returns_is_abandoned_with_a_warning(capsys):
    transport = TcpTransport.__new__(TcpTransport)
    transport.rank, transport.SHUTDOWN_GRACE = 3, 0.2
    transport._thread, transport._monitors, transport.push, transport.zap = None, {}, {}, None
    transport.rendezvous = None
    transport.ctx = _StuckContext()
    try:
        transport._teardown()
        assert transport.ctx.term_called.is_set()
        err = capsys.readouterr().err
        assert "rank 3: the tcp transport did not shut down within 0.2 s" in err
        assert "libzmq did not release its sockets and context" in err
    finally:
        transport.ctx.release.set()


def test_receiver_thread_that_does_not_stop_keeps_its_sockets(capsys):
    transport = TcpTransport.__new__(TcpTransport)
    transport.rank, transport.SHUTDOWN_GRACE = 1, 0.2
    stop = threading.Event()
    transport._thread = threading.Thread(target=stop.wait, daemon=True)
    transport._thread.start()
    transport._monitors = {"never": 0}  # closing these would fail: they are not sockets
    try:
        transport._teardown()
        assert "its receiver thread did not stop" in capsys.readouterr().err
    finally:
        stop.set()


_REAL_SHUTDOWN = textwrap.dedent("""
    import time, zmq
    from needle.distributed._tcp_transport import TcpTransport
    t = TcpTransport.__new__(TcpTransport)
    t.rendezvous = None
    t.ctx = zmq.Context()
    peer = t.ctx.socket(zmq.PULL)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    push = t.ctx.socket(zmq.PUSH)
    monitor = push.get_monitor_socket(zmq.EVENT_ALL)

    class PeerLeavesAsTheMonitorCloses:  # the race seen at exit, made deterministic
        def close(self, linger=None):
            monitor.close(linger)
            peer.close(0)  # libzmq's I/O thread now emits disconnect events
            time.sleep(0.5)

    t._monitors = {PeerLeavesAsTheMonitorCloses(): 1}
    push.connect(f"tcp://127.0.0.1:{port}")
    t.push, t.pull, t.zap = {1: push}, None, None
    time.sleep(0.3)
    t._close_sockets()
    print("closed")
""")


def test_shutdown_with_a_departed_peer_does_not_deadlock_in_libzmq():
    """Real sockets: a peer leaving just as the monitors close. Closing a monitor before
    stopping it deadlocked libzmq here (a rank hung at exit in disable_monitor)."""
    out = subprocess.run([sys.executable, "-c", _REAL_SHUTDOWN], capture_output=True,
                         text=True, timeout=40)
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr[-2000:]
