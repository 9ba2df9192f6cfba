"""Differentiable send and receive: a cut edge of the graph between two ranks.

``send_forward(x, dst)`` sends ``x``'s data to ``dst`` and returns a one-element *token*
whose graph leads back to ``x``; ``recv_forward(src)`` returns the received activation as a
Tensor whose graph node remembers ``src``. In backward the receiving rank's engine reaches
that node and sends the adjoint back to ``src``; on the sending rank ``token.backward()``
receives it and the engine continues into ``x``'s graph. Any dtype needle sends, any device
(data travels through host memory, except ``cuda()`` tensors on an ``nccl`` group: NCCL
carries them from device to device), any transport. ``tag`` keeps concurrent micro-batches
apart; each (peer, tag, direction) stream is matched in order.

Example (two thread ranks: y = 3 x on rank 0, loss = sum(y ** 2) on rank 1):
    >>> import numpy as np, needle as ndl, needle.distributed as dist
    >>> from needle.distributed.pipeline import recv_forward, send_forward, wait_sends
    >>> def job(rank):
    ...     if rank == 0:
    ...         x = ndl.Tensor(np.array([1.0, 2.0], np.float32))
    ...         token = send_forward(x * 3, dst=1)
    ...         token.backward()              # receives d loss / d y, continues into x
    ...         wait_sends()
    ...         return x.grad.numpy().tolist()
    ...     y = recv_forward(src=0)
    ...     (y * y).sum().backward()          # sends 2 y back to rank 0
    ...     wait_sends()
    ...     return y.numpy().tolist()
    >>> dist.spawn_threads(job, 2)
    [[18.0, 36.0], [3.0, 6.0]]
"""
from __future__ import annotations

from typing import Any

import numpy as np

from needle.autograd import Tensor, TensorOp
from needle.backend_selection import BACKEND, array_api

from .. import _nccl
from .._buffers import to_device, to_host
from .._errors import CommError
from .._group import resolve
from . import wire


class Link:
    """One cut edge: where the activation went (or came from) and where its adjoint goes.

    ``prefetch()`` receives the adjoint ahead of backward (the runtime's RECV_B action), so
    that backward itself does not wait; ``sent_adjoint`` tells whether backward sent one.
    """

    def __init__(self, group: Any, peer: int, tag: int, timeout: float | None = None,
                 local: "LocalSlot | None" = None):
        self.pg = resolve(group, "pipeline")
        if local is None:
            self.pg.check_peer("pipeline", peer, "peer")
        wire.check_tag("pipeline", tag)
        self.peer, self.tag, self.timeout, self.local = peer, tag, timeout, local
        self._adjoint: Any = None
        self.sent_adjoint = False
        self.device: Any = None  # where received arrays go when NCCL carries them

    def reset(self) -> None:
        """Forget the previous step (the runtime reuses links across steps)."""
        self._adjoint = None
        self.sent_adjoint = False

    def send(self, arr: Any, direction: int) -> None:
        """Send ``arr``: a device array goes as it is where NCCL can carry it (the receiving
        side then gets a device array too), anything else as a host copy."""
        if self.local is None and _nccl.route(self.pg, arr) is not None:
            self.device = arr.device
        else:
            arr = to_host(arr)
        if self.local is not None:
            self.local.put((self.tag, direction), arr)
        else:
            wire.send_array(self.pg, arr, self.peer, self.tag, direction, self.timeout)
        if direction == wire.BACKWARD:
            self.sent_adjoint = True

    def recv(self, direction: int) -> Any:
        if self.local is not None:
            return self.local.take((self.tag, direction))
        return wire.recv_array(self.pg, self.peer, self.tag, direction, self.timeout,
                               self.device)

    def prefetch(self) -> None:
        if self._adjoint is None:
            self._adjoint = self.recv(wire.BACKWARD)

    def take_adjoint(self) -> Any:
        self.prefetch()
        adjoint, self._adjoint = self._adjoint, None
        return adjoint


class LocalSlot:
    """Hand-over between two stages on the same rank (a pipeline of one rank, for example)."""

    def __init__(self) -> None:
        self.items: dict[tuple, np.ndarray] = {}

    def put(self, key: tuple, arr: np.ndarray) -> None:
        self.items[key] = arr

    def take(self, key: tuple) -> np.ndarray:
        if key not in self.items:
            raise CommError(f"pipeline: local hand-over {key} read before it was written, "
                            "expected the plan to run the send first")
        return self.items.pop(key)


class SendOp(TensorOp):
    """Forward: send the input, output a one-element float32 token. Backward: receive the
    adjoint from the peer (prefetched or now) as the input's gradient."""

    save_inputs = ()  # backward needs only the input's shape, dtype and device

    def __init__(self, link: Link):
        self.link = link

    def compute(self, a):
        self.link.send(a, wire.FORWARD)
        return to_device(np.zeros(1, np.float32), getattr(a, "device", None))

    def gradient(self, out_grad, node):
        x = node.inputs[0]
        adjoint = self.link.take_adjoint()
        shape, dtype = tuple(x.shape), str(x.dtype)
        if adjoint.shape != shape or str(adjoint.dtype) != dtype:
            raise CommError(f"send_forward: adjoint from {self.link.pg.describe(self.link.peer)} "
                            f"(tag {self.link.tag}) does not match the activation, expected "
                            f"{dtype} {shape}, got {adjoint.dtype} {adjoint.shape}")
        return Tensor(adjoint, device=x.device, dtype=dtype, requires_grad=False)


class RecvOp(TensorOp):
    """Forward: output the received activation (its input is a one-element anchor that only
    puts the node in the graph). Backward: send the adjoint to the peer."""

    save_inputs = ()

    def __init__(self, link: Link, host: Any):
        self.link = link
        self._host: Any = host  # host values, or the device array NCCL received

    def compute(self, anchor):
        # built here, inside a recorded op, so needle.memory counts it as an activation
        host, self._host = self._host, None
        if not isinstance(host, np.ndarray):
            return host
        return to_device(host, getattr(anchor, "device", None))

    def gradient(self, out_grad, node):
        self.link.send(out_grad.realize_cached_data(), wire.BACKWARD)
        anchor = node.inputs[0]
        return Tensor(np.zeros(1, np.float32), device=anchor.device, dtype="float32",
                      requires_grad=False)


def send_forward(x: Tensor, dst: int, tag: int = 0, group: Any = None,
                 timeout: float | None = None, link: Link | None = None) -> Tensor:
    """Send ``x`` to rank ``dst``; return a token whose ``backward()`` receives the adjoint
    from ``dst`` and continues backward into ``x``'s graph.

    The send is nonblocking: call :func:`wait_sends` (the pipeline runtime does it at the end
    of each step) before relying on delivery.

    Raises:
        CommError: bad ``dst``/``tag``, a timeout, or an adjoint of the wrong shape or dtype.
    """
    if not isinstance(x, Tensor):
        raise CommError(f"send_forward: expected a Tensor, got {type(x).__name__}")
    link = link or Link(group, dst, tag, timeout)
    return SendOp(link)(x)


def recv_forward(src: int, tag: int = 0, group: Any = None, device: Any = None,
                 requires_grad: bool = True, timeout: float | None = None,
                 link: Link | None = None) -> Tensor:
    """Receive an activation from rank ``src`` (any shape and dtype) as a Tensor on
    ``device`` (default: needle's default device). With ``requires_grad`` its backward sends
    the adjoint back to ``src``.

    Raises:
        CommError: bad ``src``/``tag``, a timeout, or ``PipelineAborted`` when the sender failed.
    """
    link = link or Link(group, src, tag, timeout)
    if device is None and BACKEND == "nd":
        device = array_api.default_device()
    link.device = device
    host = link.recv(wire.FORWARD)
    if not requires_grad or np.dtype(host.dtype).kind not in "f":
        data = host if not isinstance(host, np.ndarray) else to_device(host, device)
        return Tensor(data, device=device, requires_grad=False)
    anchor = Tensor(np.zeros(1, np.float32), device=device, dtype="float32", requires_grad=True)
    return RecvOp(link, host)(anchor)
