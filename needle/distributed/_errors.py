"""Error classes used by needle.distributed.

``CommError`` (from needle's one error hierarchy) is what every failed or timed-out
communication raises. ``PeerError`` is the CommError whose cause is another rank: it left, died,
never arrived, or sent what it must not. It carries that rank, so that the launcher can tell the
rank that failed first from the ranks that failed only because of it.
"""
from __future__ import annotations

from needle._core.errors import CommError, DTypeError, GraphError, NeedleError, ShapeError

# Why a peer is blamed; the launcher prints these phrases after "peer rank k".
PEER_REASONS = {
    "gone": "is gone",
    "timeout": "never arrived",
    "deadlock": "is stuck in a deadlock",
    "refused": "could not be authenticated",
    "flood": "sent too many messages nobody received",
    "failed": "failed",  # and told this rank so (a pipeline abort): its failure came first
}


class PeerError(CommError):
    """A CommError caused by another rank.

    Attributes:
        peer: the global rank at fault.
        reason: one of ``PEER_REASONS``.

    Example:
        >>> e = PeerError("recv: rank 1 left the process group", peer=1, reason="gone")
        >>> isinstance(e, CommError), e.peer, e.reason
        (True, 1, 'gone')
    """

    def __init__(self, message: str, peer: int, reason: str):
        super().__init__(message)
        self.peer, self.reason = int(peer), reason

    def __reduce__(self):  # keep the attributes through pickling (thread results, tests)
        return (type(self), (str(self), self.peer, self.reason))


class MessageError(CommError):
    """A received message the receiver refuses: a malformed header, a payload larger than its
    limit, another kind of message than the call expects (an object where an array was
    expected), or an object encoding that does not decode."""


class SenderAborted(CommError):
    """The sender failed and sent its reason in place of the message the receiver waited for.

    Attributes:
        reason: the sender's text.
    """

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):
        return (type(self), (str(self), self.reason))


class ObjectTypeError(DTypeError):
    """An object ``send_object`` cannot encode: the message names the op, where in the object
    the value sits and its type (the allowed types are listed in ``needle.distributed._wire``).
    """


def rewrap(exc: CommError, message: str) -> CommError:
    """A CommError with a longer ``message`` and the same class and blame as ``exc``."""
    if isinstance(exc, PeerError):
        return PeerError(message, exc.peer, exc.reason)
    return CommError(message)


__all__ = ["CommError", "DTypeError", "GraphError", "MessageError", "NeedleError",
           "ObjectTypeError", "PEER_REASONS", "PeerError", "SenderAborted", "ShapeError",
           "rewrap"]
