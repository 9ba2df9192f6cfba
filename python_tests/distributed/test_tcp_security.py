"""The tcp transport talks only to its own job: attacks from a second local process.

Each test starts a real two-rank tcp job by hand (so that it controls the environment and can
strike during the rendezvous), attacks it with raw ZeroMQ sockets, then checks that the job
computed the right values and what its receiver counted. Without authentication (today's
``NEEDLE_DIST_AUTH=off``) every forged frame below would be accepted.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq (the 'test' extra) is not installed")

from ._tcp_attack import (  # noqa: E402
    BYE,
    curve_intruder,
    finish,
    forged_send,
    frame_header,
    job_env,
    results,
    start_rank,
    wait_for,
)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def _push(address: str, intruder_of: tuple[dict, int] | None = None):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 5000
    if intruder_of is not None:
        env, rank = intruder_of
        curve_intruder(sock, _public_key(env, rank))
    sock.connect(address)
    return sock


def _public_key(env: dict, rank: int) -> bytes:
    from needle.distributed._tcp_security import Security

    sec = Security.from_values("curve", env["NEEDLE_DIST_SECRET"], env["NEEDLE_DIST_JOB_ID"], 2)
    return sec.public_key(rank)


def _victims(tmp_path: Path, env: dict, *args: str) -> list[subprocess.Popen]:
    return [start_rank(r, env, "tcp_victim.py", str(tmp_path), *args) for r in range(2)]


def _run_attack(tmp_path: Path, env: dict, attack, *args: str) -> list[dict]:
    procs = _victims(tmp_path, env, *args)
    try:
        address = wait_for(tmp_path / "rank1.addr")
        wait_for(tmp_path / "rank0.addr")
        attack(address)
    finally:
        (tmp_path / "go").write_text("")
    outs = finish(procs)
    return [dict(results(text), rc=str(rc), text=text) for rc, text in outs]


def _assert_job_unharmed(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["rc"] == "0" and "COMM_ERROR" not in r, r["text"][-3000:]
    assert ranks[1]["RECV"] == "[1.0, 2.0, 3.0, 4.0]", ranks[1]["text"][-3000:]
    assert ranks[0]["ALL_REDUCE"] == ranks[1]["ALL_REDUCE"] == "3.0"


@pytest.mark.parametrize("intruder", [False, True], ids=["plain", "curve-intruder"])
def test_forged_data_frame_is_not_received(tmp_path: Path, intruder: bool) -> None:
    env = job_env()
    seen = {}

    def attack(address: str) -> None:
        sock = _push(address, (env, 1) if intruder else None)
        for frames in forged_send(np.full(4, 666, np.float32), 0, env["NEEDLE_DIST_JOB_ID"]):
            sock.send_multipart(frames)
        seen["sent"] = True
        sock.close()

    ranks = _run_attack(tmp_path, env, attack)
    _assert_job_unharmed(ranks)
    if intruder:  # it reached the handshake, and the ZAP handler refused its key
        assert json.loads(ranks[1]["STATS"])["refused_connections"] >= 1, ranks[1]["STATS"]


def test_forged_goodbye_does_not_end_the_job(tmp_path: Path) -> None:
    env = job_env()

    def attack(address: str) -> None:
        sock = _push(address)
        sock.send(frame_header(BYE, 0, 0, 0, env["NEEDLE_DIST_JOB_ID"]))
        sock.close()

    _assert_job_unharmed(_run_attack(tmp_path, env, attack))


def test_malformed_frame_is_dropped_and_counted(tmp_path: Path) -> None:
    """A 3-byte frame (authentication off, so that it reaches the receiver thread) is dropped
    and counted; the receiver lives on and the job completes."""
    env = job_env(NEEDLE_DIST_AUTH="off")

    def attack(address: str) -> None:
        sock = _push(address)
        sock.send(b"abc")
        sock.send_multipart([b"abc", b"def", b"ghi"])
        sock.close()

    ranks = _run_attack(tmp_path, env, attack)
    _assert_job_unharmed(ranks)
    stats = json.loads(ranks[1]["STATS"])
    assert stats["dropped_frames"] == 2, stats
    assert all(reason.startswith("malformed frame") for reason in stats["drop_reasons"]), stats


def test_flood_of_unexpected_messages_is_bounded(tmp_path: Path) -> None:
    """50 frames of 10 MiB with a key nobody receives: the victim holds at most the limit
    (64 MiB), frees the flood, and its next receive from the claimed sender raises a
    CommError naming that sender."""
    env = job_env(NEEDLE_DIST_AUTH="off", NEEDLE_DIST_MAX_UNEXPECTED_MB="64")
    chunk = np.zeros(10 * 2**20, np.uint8)

    def attack(address: str) -> None:
        sock = _push(address)
        head = frame_header(0, 0, 0, 12345, env["NEEDLE_DIST_JOB_ID"])
        for _ in range(50):
            sock.send_multipart([head, chunk])
        sock.close()  # linger: every frame is handed over before "go"

    ranks = _run_attack(tmp_path, env, attack, "flood")
    victim = ranks[1]
    assert "COMM_ERROR" in victim, victim["text"][-3000:]
    assert "rank 0 sent" in victim["COMM_ERROR"] and "limit of 67108864 bytes" in \
        victim["COMM_ERROR"], victim["COMM_ERROR"]
    assert json.loads(victim["STATS"])["peak_unexpected_bytes"] <= 64 * 2**20
    grown = float(victim["PEAK_MB"]) - float(victim["BASELINE_MB"])
    assert grown < 250, f"peak memory grew by {grown} MB, expected far less than the 500 MB sent"


@pytest.mark.parametrize("intruder", [False, True], ids=["plain", "curve-intruder"])
def test_fake_rendezvous_hello_cannot_join(tmp_path: Path, intruder: bool) -> None:
    """While rank 0 waits for rank 1, a stranger says hello as rank 1 (knowing the job id):
    it gets no table and no traffic, and the real rank 1 joins afterwards."""
    env = job_env()
    rank0 = start_rank(0, env, "tcp_victim.py", str(tmp_path))
    ctx = zmq.Context.instance()
    listen = ctx.socket(zmq.PULL)
    port = listen.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    if intruder:
        curve_intruder(dealer, _public_key(env, 0))
    dealer.connect(f"tcp://127.0.0.1:{env['MASTER_PORT']}")
    dealer.send_json({"job": env["NEEDLE_DIST_JOB_ID"], "rank": 1, "size": 2,
                      "address": f"tcp://127.0.0.1:{port}"})
    reply = dealer.recv_json() if dealer.poll(3000) else None
    rank1 = start_rank(1, env, "tcp_victim.py", str(tmp_path))
    try:
        wait_for(tmp_path / "rank0.addr")
        wait_for(tmp_path / "rank1.addr")
    finally:
        (tmp_path / "go").write_text("")
    outs = [dict(results(t), rc=str(rc), text=t) for rc, t in finish([rank0, rank1])]
    stolen = listen.poll(1000)
    listen.close(0)
    dealer.close(0)
    assert reply is None or "table" not in reply, reply
    assert not stolen, "the stranger received the job's traffic"
    _assert_job_unharmed(outs)
    if intruder:
        assert json.loads(outs[0]["STATS"])["refused_connections"] >= 1, outs[0]["STATS"]


def _wait_listening(port: int, seconds: float = 90.0) -> None:
    end = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < end, f"nothing listens on port {port}"
            time.sleep(0.05)


@pytest.mark.parametrize("auth", ["curve", "off"])
def test_two_jobs_on_one_port_fail_loudly_never_mix(auth: str) -> None:
    """Two 2-rank jobs on one MASTER_PORT, overlapping for sure: job A's rank 0 holds the
    port while job B starts. B fails loudly (a CommError; its rank 1 is told it reached
    another job); A, whose rank 1 comes last, computes its own answer; 103, the cross-joined
    sum, never appears."""
    a = job_env(NEEDLE_DIST_AUTH=auth, JOB_BASE="0")
    b = job_env(NEEDLE_DIST_AUTH=auth, JOB_BASE="100", MASTER_PORT=a["MASTER_PORT"])
    a0 = start_rank(0, a, "two_jobs.py")
    _wait_listening(int(a["MASTER_PORT"]))
    outs_b = finish([start_rank(r, b, "two_jobs.py") for r in range(2)])
    outs_a = finish([a0, start_rank(1, a, "two_jobs.py")])
    texts = "\n".join(text for _, text in outs_a + outs_b)
    for rc, text in outs_a:
        assert rc == 0 and results(text)["RESULT"] == "3.0", texts
    for rc, text in outs_b:
        assert rc != 0 and "CommError" in text, texts
    assert "RESULT 103.0" not in texts
    assert "another job" in outs_b[1][1]  # the stranger is told what happened


def _start_logged(rank: int, env: dict, log: Path, *args: str) -> subprocess.Popen:
    import sys

    from ._tcp_attack import SCRIPTS

    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(SCRIPTS / "two_jobs.py"), *args],
                                env=dict(env, RANK=str(rank)), stdout=out,
                                stderr=subprocess.STDOUT, text=True)


def _wait_text(proc: subprocess.Popen, log: Path, words: tuple[str, ...],
               seconds: float = 90.0) -> None:
    """Until ``log`` holds one of ``words`` or ``proc`` has exited."""
    end = time.monotonic() + seconds
    while proc.poll() is None and not any(w in log.read_text() for w in words):
        assert time.monotonic() < end, f"{log.name}: none of {words} in\n{log.read_text()}"
        time.sleep(0.05)


@pytest.mark.parametrize("auth", ["curve", "off"])
def test_interleaved_start_of_two_jobs_with_one_secret_never_mixes(tmp_path: Path,
                                                                    auth: str) -> None:
    """Two 2-rank jobs started by hand with one secret and one MASTER_PORT, in the order
    A0, B1, A1, B0: B1 reaches A's rank 0 first and cannot be told from A1. Every rank either
    computes its own job's sum (A 3.0, B 203.0) or fails naming MASTER_PORT; the cross-joined
    sum 103.0 never appears. The ranks wait for "go" before their all-reduce, so that all
    four run at once, as jobs that do real work do."""
    a = job_env(NEEDLE_DIST_AUTH=auth, JOB_BASE="0")
    a.pop("NEEDLE_DIST_JOB_ID")  # by hand: the job id comes from the secret alone
    b = dict(a, JOB_BASE="100")
    go = tmp_path / "go"
    order = [("A", 0, a), ("B", 1, b), ("A", 1, a), ("B", 0, b)]
    procs: list[tuple[str, int, subprocess.Popen, Path]] = []
    try:
        for job, rank, env in order:
            log = tmp_path / f"{job}{rank}.log"
            proc = _start_logged(rank, env, log, str(go))
            procs.append((job, rank, proc, log))
            if (job, rank) == ("A", 0):
                _wait_listening(int(a["MASTER_PORT"]))
            elif (job, rank) == ("B", 1):
                _wait_text(proc, log, ("JOINED",))  # joined A's rank 0
            elif (job, rank) == ("A", 1):
                _wait_text(proc, log, ("JOINING",))
                time.sleep(2.0)  # its hello is out before B's rank 0 starts
        for _, _, proc, log in procs:
            _wait_text(proc, log, ("JOINED",), seconds=60.0)
        go.write_text("")
        for _, _, proc, _ in procs:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
    finally:
        go.write_text("")
        for _, _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    texts = "\n".join(f"--- {j}{r} rc={p.returncode}\n{log.read_text()[-2500:]}"
                       for j, r, p, log in procs)
    assert "RESULT 103.0" not in texts, texts
    for job, _, proc, log in procs:
        text = log.read_text()
        if proc.returncode == 0:
            assert results(text)["RESULT"] == {"A": "3.0", "B": "203.0"}[job], texts
        else:
            assert "CommError" in text or "PeerError" in text, texts
            assert "MASTER_PORT" in text, texts


def test_each_one_node_launch_is_its_own_job(tmp_path: Path, monkeypatch) -> None:
    """Two one-node launches with the same user-given secret get different job ids, so the
    ranks of one are strangers to the other's rendezvous (refused as "another job"); a job of
    several nodes keeps the id every node derives from the secret."""
    from needle.distributed.launch import Nodes, _job_env

    monkeypatch.setenv("NEEDLE_DIST_SECRET", "a secret two launches share")
    monkeypatch.delenv("NEEDLE_DIST_JOB_ID", raising=False)
    one = [_job_env("tcp", Nodes(2, master_port=29500), str(tmp_path)) for _ in range(2)]
    assert one[0]["NEEDLE_DIST_SECRET"] == one[1]["NEEDLE_DIST_SECRET"]
    assert one[0]["NEEDLE_DIST_JOB_ID"] != one[1]["NEEDLE_DIST_JOB_ID"]
    many = _job_env("tcp", Nodes(2, nnodes=2, master_port=29500), str(tmp_path))
    assert "NEEDLE_DIST_JOB_ID" not in many


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
            hex_ip, hex_port = cols[1].split(":")
            ip = socket.inet_ntoa(bytes.fromhex(hex_ip)[::-1])
            found.append((ip, int(hex_port, 16)))
    return found


def _non_loopback_ipv4() -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.123", 9))  # no packet is sent: this only picks a route
        ip = probe.getsockname()[0]
    except OSError:
        ip = None
    finally:
        probe.close()
    return ip if ip and not ip.startswith("127.") else None


@pytest.mark.parametrize("where", ["127.0.0.2", "this host's address"])
def test_rendezvous_listens_only_on_the_address_asked_for(tmp_path: Path, where: str) -> None:
    """MASTER_ADDR=127.0.0.2 or the machine's own non-loopback address: rank 0 listens on that
    address only, and no socket of the rank listens on every interface (0.0.0.0)."""
    master = where if where[0].isdigit() else _non_loopback_ipv4()
    if master is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    env = job_env(MASTER_ADDR=master)
    rank0 = start_rank(0, env, "tcp_victim.py", str(tmp_path))
    port = int(env["MASTER_PORT"])
    try:
        sockets = []
        for _ in range(600):  # until the rendezvous socket is up (rank 1 never comes)
            sockets = _listening(rank0.pid) if rank0.poll() is None else []
            if any(p == port for _, p in sockets):
                break
            assert rank0.poll() is None, rank0.communicate()[0]
            time.sleep(0.05)
        assert (master, port) in sockets, sockets
        assert not [s for s in sockets if s[0] == "0.0.0.0"], sockets
    finally:
        rank0.kill()
        rank0.communicate()

