"""``checkpoint_sequential``: cut a chain of modules into segments, one checkpoint region each.

Example:
    >>> import numpy as np
    >>> from needle import nn
    >>> from needle.autograd import Tensor
    >>> np.random.seed(0); net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    >>> y = checkpoint_sequential(net, 3, Tensor(np.ones((2, 4), dtype="float32")))
    >>> y.sum().backward(); net.modules[0].weight.grad.shape
    (4, 4)
"""
from __future__ import annotations

from .._core.errors import MemoryArgumentError
from .plan import CheckpointPlan, equal_segments
from .region import checkpoint

__all__ = ["checkpoint_sequential"]


def _module_list(modules) -> list:
    inner = getattr(modules, "modules", None)
    if inner is not None and not callable(inner):
        return list(inner)  # needle's Sequential keeps its layers in ``.modules``
    if isinstance(modules, (list, tuple)):
        return list(modules)
    raise MemoryArgumentError(
        f"checkpoint_sequential: expected a Sequential or a list of modules, got "
        f"{type(modules).__name__}")


def _segments(layers: list, segments) -> tuple[list, list]:
    if isinstance(segments, CheckpointPlan):
        if segments.segments[-1][1] != len(layers):
            raise MemoryArgumentError(
                f"checkpoint_sequential: the plan covers {segments.segments[-1][1]} layers, "
                f"expected {len(layers)}, got a plan for another chain")
        return list(segments.segments), list(segments.checkpointed)
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise MemoryArgumentError(
            f"checkpoint_sequential: segments must be an int or a CheckpointPlan, got "
            f"{segments!r}")
    bounds = equal_segments(len(layers), segments)
    return list(bounds), [True] * len(bounds)


def _run_chain(chain):
    def run(x):
        for layer in chain:
            x = layer(x)
        return x

    run.__qualname__ = f"segment[{len(chain)} layers]"
    run.layers = chain  # seen by the region's module-state snapshot (closure)
    return run


def checkpoint_sequential(modules, segments, x, *, preserve_rng_state: bool = True,
                          verify: bool = False):
    """Run ``modules`` on ``x`` as ``segments`` checkpoint regions of consecutive layers.

    Args:
        modules: a ``nn.Sequential`` or a list/tuple of callables applied in order.
        segments: the number of regions (layers shared out as evenly as possible, larger
            segments first) or a :class:`CheckpointPlan` from ``plan_checkpoints`` (its
            stored segments run without checkpointing).
        x: the input tensor.
        preserve_rng_state, verify: passed to every region (see ``checkpoint``).

    Returns:
        the output of the last layer.

    Raises:
        MemoryArgumentError: ``segments`` outside ``1..len(modules)`` or a plan of another size.
    """
    layers = _module_list(modules)
    bounds, flags = _segments(layers, segments)
    for k, ((start, stop), ckpt) in enumerate(zip(bounds, flags, strict=True)):
        run = _run_chain(layers[start:stop])
        if ckpt:
            x = checkpoint(run, x, preserve_rng_state=preserve_rng_state, verify=verify,
                           name=f"segment {k} (layers {start}..{stop - 1})")
        else:
            x = run(x)
    return x
