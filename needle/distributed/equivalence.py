"""``check_equivalence``: N ranks x G accumulation steps x micro-batching must give the
single-process full-batch gradient.

The harness runs the reference (one process, the whole batch, the loss's mean) and the
distributed computation (each rank takes its share of the batch, cuts it into micro-batches
of unequal sizes, weights micro-batch i's mean loss by ``n_i / n_rank``, accumulates under
``no_sync``, and lets DDP or ZeRO weigh ranks by ``n_rank / N``), gathers every rank's
gradient and compares. It prints the denominators used at each level: the micro-batch sizes
``n_i`` (each micro-batch loss is a mean over ``n_i``), each rank's ``n_rank = sum_i n_i``, and
the global ``N = sum n_rank``; the result is ``sum n_i g_i / sum n_i`` over all micro-batches.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .process_group import get_rank, get_world_size, is_initialized, spawn_threads

_BUILD = threading.Lock()  # model construction may draw from NumPy's shared generator


@dataclass
class EquivalenceReport:
    """What :func:`check_equivalence` compared."""

    strategy: str
    world_size: int
    micro_batches: list[list[int]]  # per rank, the examples of each micro-batch
    local: list[int]  # per rank, the examples it holds
    total: int
    max_abs_error: float
    max_rel_error: float
    gradients: list[np.ndarray] = field(repr=False, default_factory=list)

    def __str__(self) -> str:
        lines = [f"check_equivalence: {self.strategy} on {self.world_size} rank(s), "
                 f"{max(len(m) for m in self.micro_batches)} micro-batches per rank",
                 f"  micro-batch denominators n_i per rank: {self.micro_batches}",
                 f"  rank denominators n_rank = sum_i n_i: {self.local}",
                 f"  global denominator N = sum n_rank: {self.total}",
                 f"  max |error| {self.max_abs_error:.3g}, max relative {self.max_rel_error:.3g}"]
        return "\n".join(lines)


def _split(n: int, parts: int, skew: bool, minimum: int = 1) -> list[int]:
    """``parts`` sizes (each >= ``minimum``) summing to ``n``; with ``skew`` deliberately
    unequal (the examples beyond the minimum are dealt in proportion 1 : 2 : 3 ...)."""
    if n < parts * minimum:
        raise ValueError(f"check_equivalence: {n} examples cannot fill {parts} parts of at "
                         f"least {minimum} (ranks x micro-batches), expected at least "
                         f"{parts * minimum} examples")
    if not skew:
        return [n * (i + 1) // parts - n * i // parts for i in range(parts)]
    extra = n - parts * minimum
    weights = np.arange(1, parts + 1, dtype=np.float64)
    cuts = np.floor(np.cumsum(weights) / weights.sum() * extra).astype(int)
    sizes = (np.diff(np.concatenate([[0], cuts])) + minimum).tolist()
    sizes[-1] += n - sum(sizes)
    return [int(v) for v in sizes]


def _run_rank(rank: int, world: int, build: Callable, loss_fn: Callable, X, y, init: list,
              strategy: str, stage: int, micro: list[list[int]], device) -> list[np.ndarray]:
    import needle.distributed as dist
    from needle.autograd import Tensor

    with _BUILD:
        model = build()
    for p, value in zip(model.parameters(), init, strict=True):
        p.data = Tensor(value, device=p.device, dtype=str(p.dtype), requires_grad=False)
    if strategy == "ddp":
        wrapper = dist.DistributedDataParallel(model)
    else:
        from needle import optim

        wrapper = dist.ZeroDataParallel(model, optimizer=lambda ps: optim.SGD(ps, lr=0.0),
                                        stage=stage)
    dtype = str(init[0].dtype)
    start = sum(sum(m) for m in micro[:rank])
    local = sum(micro[rank])
    wrapper.set_num_examples(local)
    at = start
    for i, n_i in enumerate(micro[rank]):
        xs = Tensor(X[at:at + n_i], device=device, dtype=dtype, requires_grad=False)
        ys = Tensor(y[at:at + n_i], device=device, requires_grad=False)
        at += n_i
        last = i == len(micro[rank]) - 1
        if last:
            (loss_fn(wrapper(xs), ys) * (n_i / local)).backward()
        else:
            with wrapper.no_sync():
                (loss_fn(wrapper(xs), ys) * (n_i / local)).backward()
    wrapper.finish_gradient_sync()
    if strategy == "ddp":
        return [p.grad.numpy() for p in model.parameters()]
    return wrapper.full_gradients()


def check_equivalence(build: Callable[[], Any], loss_fn: Callable, X: np.ndarray,
                      y: np.ndarray, *, world_size: int = 2, accumulate: int = 3,
                      strategy: str = "ddp", stage: int = 2, skew: bool = True,
                      rtol: float = 1e-9, atol: float = 1e-12, device=None,
                      verbose: bool = True) -> EquivalenceReport:
    """Assert that ``world_size`` ranks x ``accumulate`` micro-batches reproduce the
    single-process gradient of ``loss_fn`` (a mean over examples) on the whole batch.

    Runs on thread ranks (``dist.spawn_threads``) when no process group exists; inside one
    (every rank calls it with the same arguments) it uses that group. Ranks get shares of
    unequal sizes and cut them into unequal micro-batches (``skew``), so every weighting
    matters. Models with batch statistics (BatchNorm) compute another function on smaller
    batches and are not expected to pass.

    Args:
        build: makes the model (called once for the reference, once per rank; the rank
            copies take the reference's initial parameters).
        loss_fn: ``loss_fn(logits, y)``, the mean over the examples it is given.
        X, y: the whole batch (NumPy).
        strategy: "ddp" (DistributedDataParallel) or "zero" (ZeroDataParallel, ``stage``).
        rtol, atol: the comparison (default tight: use float64 models).

    Returns:
        An :class:`EquivalenceReport` (printed when ``verbose``).

    Raises:
        AssertionError: naming the parameter and the error when the gradients differ.

    Example:
        >>> import numpy as np
        >>> from needle import nn
        >>> from needle.distributed import check_equivalence
        >>> X = np.random.default_rng(0).standard_normal((10, 3)); y = np.arange(10) % 2
        >>> report = check_equivalence(lambda: nn.Linear(3, 2, dtype="float64"),
        ...                            nn.SoftmaxLoss(), X, y, verbose=False)
        >>> report.micro_batches, report.local, report.total
        ([[1, 1, 2], [1, 2, 3]], [4, 6], 10)
    """
    from needle.autograd import Tensor

    if strategy not in ("ddp", "zero"):
        raise ValueError(f"check_equivalence: strategy must be 'ddp' or 'zero', got "
                         f"{strategy!r}")
    world = get_world_size() if is_initialized() else int(world_size)
    n = int(len(y))
    shares = _split(n, world, skew, minimum=int(accumulate))
    micro = [_split(s, int(accumulate), skew) for s in shares]
    with _BUILD:
        reference = build()
    init = [p.numpy() for p in reference.parameters()]
    xs = Tensor(X, device=device, dtype=str(init[0].dtype), requires_grad=False)
    ys = Tensor(y, device=device, requires_grad=False)
    loss_fn(reference(xs), ys).backward()
    want = [p.grad.numpy() for p in reference.parameters()]
    args = (build, loss_fn, X, y, init, strategy, stage, micro, device)
    if is_initialized():
        got = _run_rank(get_rank(), world, *args)
    else:
        got = spawn_threads(_run_rank, world, world, *args)[0]
    abs_err = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
    rel_err = max(float((np.abs(g - w) / np.maximum(np.abs(w), 1e-30)).max())
                  for g, w in zip(got, want, strict=True))
    report = EquivalenceReport(strategy, world, micro, shares, n, abs_err, rel_err, got)
    if verbose:
        print(report)
    names = [name for name, _ in reference.named_parameters()] \
        if hasattr(reference, "named_parameters") else [str(i) for i in range(len(want))]
    for name, g, w in zip(names, got, want, strict=True):
        np.testing.assert_allclose(
            g, w, rtol=rtol, atol=atol,
            err_msg=f"check_equivalence: gradient of {name!r} differs from the single-process "
                    f"full-batch gradient ({strategy}, {world} ranks, micro-batches {micro})")
    return report
