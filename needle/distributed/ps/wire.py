"""The parameter server's messages, in needle.distributed's one message format (``_wire``).

Every request a worker sends is an object message (``p2p.isend_object``) on ``T_REQUEST``: a
dict with the op, the worker's clock, the version its gradient was computed on, the examples
behind it, the loss and correct counts of those examples for reporting, the update count it
had seen and the digest of the server's shard keys. Every reply is an object message on
``T_REPLY``. Payloads are array messages (``p2p.isend``), one flat array per dtype group of
the server's shard (see ``layout.Shard``), received into buffers of the expected dtype and
size, so a payload of another layout is refused before it lands; a push to server 0 also
carries the model's buffers, one flat array per dtype group (``layout.buffer_groups``).

A worker's heartbeat is a one-byte ping on the group's second channel: it carries nothing,
only its arrival counts.

Example:
    >>> parse_request(request(PUSH, clock=3, examples=8, loss_sum=1.5), 1)["examples"]
    8
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import MessageError

# tags on the parameter server's private group
T_REQUEST, T_PUSH_DATA, T_REPLY, T_PULL_DATA, T_HEARTBEAT = 1, 2, 3, 4, 5
# a push to server 0 is followed by the worker's buffers (BatchNorm running statistics ...)
T_BUFFER_DATA = 7

# request ops
PUSH, PULL, FINISH, JOIN = "push", "pull", "finish", "join"
OPS = (PUSH, PULL, FINISH, JOIN)

REQUEST = {"op": str, "clock": int, "version": int, "examples": int, "loss_sum": float,
           "correct": int, "updates_seen": int, "shard_key": int}
REPLY = {"version": int, "clock": int, "updates": int}
MAX_MESSAGE_BYTES = 4096  # the most a request or reply may take encoded


def request(op: str, clock: int = 0, version: int = 0, examples: int = 0,
            loss_sum: float = 0.0, correct: int = 0, updates_seen: int = 0,
            shard_key: int = 0, report: dict | None = None) -> dict:
    """A request; a FINISH may carry the worker's ``report`` (see :func:`parse_report`)."""
    out = {"op": op, "clock": int(clock), "version": int(version), "examples": int(examples),
           "loss_sum": float(loss_sum), "correct": int(correct),
           "updates_seen": int(updates_seen), "shard_key": int(shard_key)}
    if report is not None:
        out["report"] = report
    return out


def reply(version: int, clock: int, updates: int) -> dict:
    return {"version": int(version), "clock": int(clock), "updates": int(updates)}


def _parse(obj: Any, fields: dict, what: str, peer: str) -> dict:
    if not isinstance(obj, dict) or set(obj) != set(fields):
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise MessageError(f"ParameterServer: {peer} sent a malformed {what}, expected the "
                           f"fields {sorted(fields)}, got {got}")
    for name, kind in fields.items():
        value = obj[name]
        if not (type(value) is kind or (kind is float and type(value) is int)):
            raise MessageError(f"ParameterServer: {peer} sent a malformed {what}, expected "
                               f"{name} of type {kind.__name__}, got {value!r}")
    return obj


def parse_request(obj: Any, rank: int) -> dict:
    """A received request, checked field by field (MessageError names what is wrong)."""
    report = None
    if isinstance(obj, dict) and obj.get("op") == FINISH and "report" in obj:
        obj = dict(obj)
        report = parse_report(obj.pop("report"), rank)
    out = _parse(obj, REQUEST, "request", f"worker rank {rank}")
    if report is not None:
        out["report"] = report
    if out["op"] not in OPS:
        raise MessageError(f"ParameterServer: worker rank {rank} sent unknown op, expected one "
                           f"of {OPS}, got {out['op']!r}")
    return out


def parse_report(obj: Any, rank: int) -> dict:
    """A worker's end-of-run report: its memory row (``apps/training``'s ``memory.per_rank``
    row): at most 8 sections of at most 8 named integers (or None) each, and ``rank``."""
    def fail(what: str) -> MessageError:
        return MessageError(f"ParameterServer: worker rank {rank} sent a malformed report, "
                            f"expected a dict of at most 8 sections of named integers, {what}")

    def number(v: Any) -> bool:
        return v is None or type(v) is int

    if not isinstance(obj, dict) or len(obj) > 8:
        raise fail(f"got {type(obj).__name__} of {len(obj) if isinstance(obj, dict) else 0}")
    for key, value in obj.items():
        if not isinstance(key, str):
            raise fail(f"got the key {key!r}")
        if isinstance(value, dict):
            if len(value) > 8 or not all(isinstance(k, str) and number(v)
                                         for k, v in value.items()):
                raise fail(f"got section {key!r} = {value!r}")
        elif not number(value):
            raise fail(f"got {key!r} = {value!r}")
    return obj


def parse_reply(obj: Any, rank: int) -> dict:
    return _parse(obj, REPLY, "reply", f"server rank {rank}")


def ping() -> np.ndarray:
    """A heartbeat buffer (to send, or to receive into)."""
    return np.zeros(1, np.uint8)
