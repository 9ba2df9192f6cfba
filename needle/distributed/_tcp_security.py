"""Who may talk to a tcp rank: ZeroMQ CURVE keys derived from a per-job secret, checked by ZAP.

Every rank derives, from the job secret, one CURVE key pair per rank of the job (a keyed BLAKE2b
of the secret and the rank number is the Curve25519 secret key). Every listening socket (rank 0's
rendezvous, each rank's receive socket) is a CURVE server with its own rank's keys, and every
connecting socket is a CURVE client with its own rank's keys. So a connection succeeds only when

* the client knows the server's public key (derived from the secret), and
* the client proves it holds the secret key of some rank of this job: libzmq asks the ZAP handler
  below (the ZeroMQ Authentication Protocol, RFC 27), which accepts exactly the job's public keys
  and names the connection's rank in its User-Id, so that the receiver can check that a frame
  claiming to come from rank k really arrived on rank k's connection.

CURVE also encrypts and authenticates every frame (XSalsa20-Poly1305 through libsodium), so a
forged or altered frame never reaches needle. ``NEEDLE_DIST_AUTH=off`` turns all of this off,
for networks where every process is trusted (and to measure what it costs).

Example:
    >>> sec = Security.from_values("curve", "correct horse battery", job_id=None, size=2)
    >>> sec.job_id == Security.from_values("curve", "correct horse battery", None, 2).job_id
    True
    >>> len(sec.public_key(1))
    40
"""
from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

from ._errors import CommError

SECRET_ENV = "NEEDLE_DIST_SECRET"
JOB_ENV = "NEEDLE_DIST_JOB_ID"
AUTH_ENV = "NEEDLE_DIST_AUTH"
MODES = ("curve", "off")
ZAP_DOMAIN = b"needle"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification


def _zmq() -> Any:
    import zmq

    return zmq


def _z85() -> Any:
    from zmq.utils import z85

    return z85


MIN_SECRET_CHARS = 16  # the launcher's own secrets have 64 (secrets.token_hex(32))


def check_secret(op: str, secret: str) -> None:
    """Refuse a secret short enough to guess: every key of the job is derived from it."""
    if len(secret) < MIN_SECRET_CHARS:
        raise CommError(f"{op}: {SECRET_ENV} too short to keep other processes out, expected "
                        f"at least {MIN_SECRET_CHARS} characters (python -c 'import secrets; "
                        f"print(secrets.token_hex(32))'), got {len(secret)}")


def derive_job_id(secret: str) -> str:
    """A job identity everyone holding the secret agrees on (it reveals nothing of it)."""
    return hashlib.blake2b(secret.encode(), digest_size=8, person=b"needle-job-id").hexdigest()


def _rank_secret_key(secret: str, rank: int) -> bytes:
    key = hashlib.sha256(secret.encode()).digest()
    raw = hashlib.blake2b(rank.to_bytes(8, "little"), digest_size=32, key=key,
                          person=b"needle-curve-v1").digest()
    return _z85().encode(raw)


class Security:
    """The job's security settings: mode, job identity and (for "curve") the rank keys."""

    def __init__(self, mode: str, job_id: str, secret: str | None, size: int):
        self.mode, self.job_id, self.size = mode, job_id, size
        self._secret_keys: list[bytes] = []
        self._public_keys: list[bytes] = []
        if mode == "curve":
            zmq = _zmq()
            if not zmq.has("curve"):
                raise CommError("init_process_group: NEEDLE_DIST_AUTH=curve needs a libzmq built "
                                "with CURVE (libsodium), got one without; install pyzmq's wheel "
                                "or set NEEDLE_DIST_AUTH=off on a trusted network")
            self._secret_keys = [_rank_secret_key(secret or "", r) for r in range(size)]
            self._public_keys = [zmq.curve_public(k) for k in self._secret_keys]

    @classmethod
    def from_values(cls, mode: str, secret: str | None, job_id: str | None,
                    size: int) -> "Security":
        if mode not in MODES:
            raise CommError(f"init_process_group: unknown {AUTH_ENV}, expected one of {MODES}, "
                            f"got {mode!r}")
        if mode == "curve" and not secret:
            raise CommError(
                f"init_process_group: backend 'tcp' needs the job secret {SECRET_ENV}, expected "
                "the same value on every rank (needle's launcher makes one; by hand: python -c "
                f"'import secrets; print(secrets.token_hex(32))') or {AUTH_ENV}=off on a trusted "
                "network, got neither")
        if mode == "curve":
            check_secret("init_process_group", secret or "")
        job = job_id or (derive_job_id(secret) if secret else "")
        return cls(mode, job, secret, size)

    @classmethod
    def from_env(cls, size: int) -> "Security":
        return cls.from_values(os.environ.get(AUTH_ENV, "curve"), os.environ.get(SECRET_ENV),
                               os.environ.get(JOB_ENV), size)

    @property
    def enabled(self) -> bool:
        return self.mode == "curve"

    def public_key(self, rank: int) -> bytes:
        return self._public_keys[rank]

    def make_server(self, sock: Any, rank: int) -> None:
        """Only clients holding a key of this job may connect to ``sock`` (bound by ``rank``)."""
        if not self.enabled:
            return
        zmq = _zmq()
        sock.curve_server = True
        sock.curve_secretkey = self._secret_keys[rank]
        sock.curve_publickey = self._public_keys[rank]
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler -> refuse, never accept all

    def make_client(self, sock: Any, rank: int, server_rank: int) -> None:
        """``sock`` connects as ``rank`` to the server socket of ``server_rank``."""
        if not self.enabled:
            return
        sock.curve_serverkey = self._public_keys[server_rank]
        sock.curve_publickey = self._public_keys[rank]
        sock.curve_secretkey = self._secret_keys[rank]

    def start_handler(self, ctx: Any) -> "ZapHandler | None":
        """The ZAP handler for ``ctx``; must run before any server socket of ``ctx`` binds."""
        if not self.enabled:
            return None
        z85 = _z85()
        return ZapHandler(ctx, {z85.decode(k): r for r, k in enumerate(self._public_keys)})


class ZapHandler:
    """Answers libzmq's authentication requests for one context on its own thread: a CURVE
    client is accepted when its public key is one of the job's rank keys (User-Id = that rank),
    refused otherwise (counted in ``rejected``)."""

    def __init__(self, ctx: Any, allowed: dict[bytes, int]):
        zmq = _zmq()
        self.allowed = allowed
        self.rejected = 0
        self.last_rejected: str | None = None
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(_ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="needle-zap", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        zmq = _zmq()
        while not self._stop.is_set():
            try:
                if self._sock.poll(100):
                    self._answer(self._sock.recv_multipart())
            except zmq.ZMQError:
                return  # context terminated

    def _answer(self, request: list[bytes]) -> None:
        # version, request id, domain, address, identity, mechanism, credentials...
        version, request_id = request[0], request[1]
        address, mechanism, credentials = request[3], request[5], request[6:]
        rank = self.allowed.get(credentials[0]) if mechanism == b"CURVE" and credentials else None
        if rank is None:
            self.rejected += 1
            self.last_rejected = address.decode(errors="replace")
            reply = [version, request_id, b"400", b"not a key of this job", b"", b""]
        else:
            reply = [version, request_id, b"200", b"OK", str(rank).encode(), b""]
        self._sock.send_multipart(reply)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sock.close(0)
