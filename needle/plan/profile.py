"""Compute costs from a profiled step: each pipeline stage's forward and backward, timed the way
the pipeline runtime runs them, and an optimizer's step.

:func:`profile_stage` times one stage on one micro-batch ``repeats`` times, as the runtime's
actions do it: ``F`` takes the input (the first stage builds a Tensor from the data; a later
stage receives it through the runtime's differentiable receive), runs the module and, on the
last stage, the loss with its ``n_i / n`` scale and the host read of its value; ``B`` is the
backward from the scaled loss or from the send's token, whose adjoint was received (with
``split_backward``: the input-gradient half ``B`` and the weight-gradient half ``W``). It
returns the samples, not only their mean: on a shared machine a sample may hold a preemption,
and the simulator's random draws (``needle.distributed.pipeline.simulator.expected``) use
them.

Example:
    >>> import numpy as np
    >>> from needle import nn
    >>> np.random.seed(0)
    >>> stage = nn.Sequential(nn.Linear(4, 3))
    >>> x = np.ones((2, 4), np.float32); y = np.zeros(2, np.uint8)
    >>> got = profile_stage(stage, x, first=True, last=True, loss_fn=nn.SoftmaxLoss(),
    ...                     target=y, repeats=3)
    >>> sorted(got), len(got["F"])
    (['B', 'F', 'RECV', 'SEND', 'W'], 3)
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

__all__ = ["profile_stage", "profile_schedule", "profile_optimizer", "time_calls"]


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` (after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _tensor(arr: np.ndarray, device: Any, requires_grad: bool) -> Any:
    from needle.autograd import Tensor

    return Tensor(arr, device=device, requires_grad=requires_grad)


def _local_links() -> tuple[Any, Any] | None:
    """(input link, output link) handing over within this rank, as the runtime's links do
    between stages on one rank; None without a process group."""
    from needle.distributed import CommError
    from needle.distributed.pipeline import Link
    from needle.distributed.pipeline.autograd_p2p import LocalSlot

    try:
        slot = LocalSlot()
        return Link(None, 0, 1, local=slot), Link(None, 0, 2, local=slot)
    except CommError:
        return None


def profile_stage(module: Any, x: np.ndarray, *, first: bool, last: bool,
                  loss_fn: Any = None, target: np.ndarray | None = None, scale: float = 1.0,
                  split_backward: bool = False, repeats: int = 20, device: Any = None
                  ) -> dict[str, list[float]]:
    """Seconds of ``F``, ``B`` and ``W`` of one micro-batch on one stage, ``repeats`` samples
    each (``W`` is all zeros unless ``split_backward``). ``x``: the stage's input (the data
    rows for the first stage, the previous stage's output otherwise); ``target`` and
    ``loss_fn`` are needed on the last stage.

    With a process group the input arrives and the output leaves through the runtime's
    differentiable receive and send, handed over within the rank (the transfer itself is the
    link's cost), so ``B`` runs the same graph as in a pipeline: the adjoint taken from the
    send, the input's adjoint given to the receive; ``SEND`` and ``RECV`` then hold the
    runtime's own part of posting and taking a message. The module is left in training mode,
    with gradients accumulated (reset them afterwards)."""
    from needle.autograd import Tensor
    from needle.distributed.pipeline import SplitBackward, recv_forward, send_forward, wire

    if last and (loss_fn is None or target is None):
        raise ValueError("profile_stage: the last stage needs loss_fn and target, got "
                         f"loss_fn={loss_fn!r}, target={'None' if target is None else 'array'}")
    module.train()
    params = list(module.parameters())
    links = _local_links()
    out: dict[str, list[float]] = {"F": [], "B": [], "W": [], "SEND": [], "RECV": []}
    for k in range(repeats + 1):  # the first round warms up (allocations) and is dropped
        received, took = None, 0.0
        if links is not None:
            for link in links:
                link.reset()
            links[0].local.items.clear()
            if not first:  # RECV_F: not compute
                links[0].local.put((links[0].tag, wire.FORWARD), x.copy())
                t = time.perf_counter()
                received = recv_forward(0, link=links[0], device=device)
                took = time.perf_counter() - t
        t0 = time.perf_counter()
        inp = received if received is not None else _tensor(x, device,
                                                            split_backward or not first)
        y = module(inp)
        seed = None
        if last:
            loss = loss_fn(y, Tensor(target, device=device, requires_grad=False))
            float(loss.numpy())
            y.detach()
            root = loss * scale
        t1 = time.perf_counter()
        if not last and links is not None:  # SEND_F and RECV_B: not compute
            root = send_forward(y, 0, link=links[1])
            t = time.perf_counter()
            links[1].local.put((links[1].tag, wire.BACKWARD), np.ones(y.shape, str(y.dtype)))
            links[1].prefetch()
            if k:
                out["SEND"].append(t - t1)
                out["RECV"].append(time.perf_counter() - t)
        elif not last:
            root, seed = y, Tensor(np.ones(y.shape, dtype=str(y.dtype)), device=y.device,
                                   requires_grad=False)
        t1b = time.perf_counter()
        if split_backward:
            split = SplitBackward(root, params, out_grad=seed)
            split.input_grad()
            t2 = time.perf_counter()
            split.weight_grad()
            t3 = time.perf_counter()
        else:
            root.backward(seed)
            t2 = t3 = time.perf_counter()
        if k and took:
            out["RECV"].append(took)
        if k:
            out["F"].append(t1 - t0)
            out["B"].append(t2 - t1b)
            out["W"].append(t3 - t2)
        del inp, y, root
    return out


def profile_schedule(schedule: Any, inputs: Any, targets: Any, steps: int = 12,
                     optimizer: Any = None, warmup: int = 1) -> dict | None:
    """The simulator's inputs measured inside ``steps`` pipelined steps of ``schedule`` (a
    :class:`~needle.distributed.pipeline.PipelineSchedule` built with ``record=True``), after
    ``warmup`` steps that are dropped (the first steps allocate and fill caches): every
    action's cost as the runtime runs it, with the other ranks' messages arriving and the
    other micro-batches in flight (an action costs more there than repeated alone:
    `profile_stage`), and the messages' costs. Collective over the pipeline group; rank 0
    gets :attr:`PipelineReport.inputs` plus ``"microbatches"`` (the profiled step's m; a
    prediction may simulate another m with the same inputs), the others None.
    ``optimizer``: stepped after each step (and its gradients reset before), as in training.
    """
    for k in range(warmup + steps):
        if k == warmup:
            schedule.history.clear()
        if optimizer is not None:
            optimizer.reset_grad()
        schedule.step(inputs, targets)
        if optimizer is not None:
            optimizer.step()
    report = schedule.report(root=0, skip_first=False)
    if report is None:
        return None
    return {**report.inputs, "microbatches": schedule.num_microbatches}


def profile_optimizer(optimizer: Any, repeats: int = 20) -> list[float]:
    """Seconds of ``optimizer.step()`` (gradients must be set; they are kept between calls),
    ``repeats`` samples after one warm-up call. The parameters move: profile a copy."""
    return time_calls(optimizer.step, repeats)
