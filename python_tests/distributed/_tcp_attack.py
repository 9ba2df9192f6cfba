"""Helpers for the tcp security tests: start ranks by hand, and forge what an attacker sends."""
from __future__ import annotations

import os
import secrets
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from needle.distributed._buffers import pack_header as p2p_header

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]
DATA, BYE = 0, 1


def job_env(**extra: str) -> dict[str, str]:
    """A fresh job: its own secret and job id (the attacker is told the job id, not the
    secret), on a free port."""
    from needle.distributed.launch import free_port

    env = dict(os.environ, NEEDLE_DIST_SECRET=secrets.token_hex(32),
               NEEDLE_DIST_JOB_ID=secrets.token_hex(8), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE="2", NEEDLE_DIST_BACKEND="tcp")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for name in ("NEEDLE_DIST_AUTH", "NEEDLE_DIST_MAX_UNEXPECTED_MB", "NEEDLE_DIST_LOCAL_ADDR"):
        env.pop(name, None)
    env.update(extra)
    return env


def start_rank(rank: int, env: dict, script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPTS / script), *args],
                            env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, seconds: float = 90.0) -> str:
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def finish(procs: list[subprocess.Popen], seconds: float = 120.0) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


def frame_header(kind: int, channel: int, src: int, tag: int, job_id: str) -> bytes:
    """A header the transport accepts as well formed (before job ids existed: 4 fields)."""
    try:
        from needle.distributed._tcp_transport import pack_header
    except ImportError:
        return struct.pack("<Biiq", kind, channel, src, tag)
    return pack_header(job_id, kind, channel, src, tag)


def forged_send(values: np.ndarray, src: int, job_id: str, tag: int = 0) -> list[list[bytes]]:
    """The two messages of ``dist.send(values, dst, tag)`` from ``src``: dtype+shape header,
    then the payload (user tag t travels as transport tags 2t and 2t + 1 on channel 0)."""
    return [[frame_header(DATA, 0, src, 2 * tag, job_id), p2p_header(values, "send").tobytes()],
            [frame_header(DATA, 0, src, 2 * tag + 1, job_id), values.tobytes()]]


def curve_intruder(sock, server_public: bytes) -> None:
    """Make ``sock`` a CURVE client that knows the server's public key but holds a key pair of
    its own, not one of the job's: only the job's ZAP handler can keep it out."""
    import zmq

    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def results(text: str) -> dict[str, str]:
    """Lines 'KEY value' of a victim's output (the last of each key)."""
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key.isupper():
            found[key] = value
    return found
