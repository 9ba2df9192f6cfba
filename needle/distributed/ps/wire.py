"""The parameter server's messages: fixed float64 headers on their own tags, then payloads.

Every request a worker sends starts with ``REQUEST`` fields (op, the worker's clock, the
version its gradient was computed on, the examples behind it, and the loss and correct counts
of those examples for reporting); every reply starts with ``REPLY`` fields. Payloads are one
flat array per dtype group of the server's shard (see ``layout.Shard``); a push to server 0
also carries the model's buffers, one flat array per dtype group (``layout.buffer_groups``).
float64 holds integers exactly up to 2**53, far beyond any clock or byte count here.
"""
from __future__ import annotations

import numpy as np

# tags on the parameter server's private channel
T_REQUEST, T_PUSH_DATA, T_REPLY, T_PULL_DATA, T_HEARTBEAT, T_SERVERS = 1, 2, 3, 4, 5, 6
# a push to server 0 is followed by the worker's buffers (BatchNorm running statistics ...)
T_BUFFER_DATA = 7

# request ops
PUSH, PULL, FINISH, JOIN = 1, 2, 3, 4
OP_NAMES = {PUSH: "push", PULL: "pull", FINISH: "finish", JOIN: "join"}

REQUEST = ("op", "clock", "version", "examples", "loss_sum", "correct", "updates_seen",
           "shard_key")
KEY = REQUEST.index("shard_key")
REPLY = ("status", "version", "clock", "updates", "spare0", "spare1", "spare2", "spare3")
FIELDS = 8
HEADER_BYTES = FIELDS * 8


def request(op: int, clock: int = 0, version: int = 0, examples: int = 0,
            loss_sum: float = 0.0, correct: int = 0, updates_seen: int = 0) -> np.ndarray:
    out = np.zeros(FIELDS, np.float64)
    out[:7] = (op, clock, version, examples, loss_sum, correct, updates_seen)
    return out


def reply(version: int, clock: int, updates: int) -> np.ndarray:
    out = np.zeros(FIELDS, np.float64)
    out[:4] = (0, version, clock, updates)
    return out


def header() -> np.ndarray:
    """An empty header buffer to receive into."""
    return np.zeros(FIELDS, np.float64)
