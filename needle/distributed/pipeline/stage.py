"""``PipelineStage`` (one rank's piece of a model) and splitting a ``Sequential`` into stages.

Stage ``k`` of ``S`` lives on rank ``k % p`` of the pipeline group (``p`` ranks): with
``S == p`` one stage per rank; with ``S == v p`` each rank holds ``v`` chunks (interleaved).

Example:
    >>> balance([4, 1, 1, 4, 2], 2)
    [0, 3, 5]
    >>> balance([1, 1, 1, 1], 3)  # ties: the earliest cuts
    [0, 1, 2, 4]
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from .._errors import ShapeError
from .._group import resolve
from .schedules import ScheduleError


class PipelineStage:
    """``module`` as stage ``stage_index`` of ``num_stages`` on the pipeline ``group``.

    Args:
        module: an ``nn.Module`` computing this stage (its input is the previous stage's
            output, or the micro-batch on stage 0).
        stage_index: which stage this is; it must live on this rank
            (``stage_index % group size == rank``).
        num_stages: stages in the whole pipeline, a multiple of the group size.
        group: the pipeline process group (default: the world).
        device: where this stage computes (default: its first parameter's device).

    Raises:
        ScheduleError: indices out of range or a stage placed on the wrong rank.
    """

    def __init__(self, module: Any, stage_index: int, num_stages: int, group: Any = None,
                 device: Any = None):
        pg = resolve(group, "PipelineStage")
        if not isinstance(num_stages, int) or num_stages < 1 or num_stages % pg.size:
            raise ScheduleError(f"PipelineStage: num_stages must be a positive multiple of the "
                                f"group size {pg.size}, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ScheduleError(f"PipelineStage: stage_index out of range, expected 0 <= "
                                f"stage_index < {num_stages}, got {stage_index!r}")
        if stage_index % pg.size != pg.rank:
            raise ScheduleError(f"PipelineStage: stage {stage_index} belongs on rank "
                                f"{stage_index % pg.size} of the group, got rank {pg.rank}")
        self.module, self.stage_index, self.num_stages, self.group = (module, stage_index,
                                                                     num_stages, pg)
        params = module.parameters() if hasattr(module, "parameters") else []
        if device is None:
            device = params[0].device if params else None
        if device is None:
            from needle.backend_selection import default_device

            device = default_device()
        self.device = device

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> list[Any]:
        return self.module.parameters() if hasattr(self.module, "parameters") else []

    def __repr__(self) -> str:
        return (f"PipelineStage({self.stage_index} of {self.num_stages}, rank {self.group.rank}"
                f" of {self.group.size})")


def balance(costs: Sequence[float], num_stages: int) -> list[int]:
    """Cut layers with ``costs`` into ``num_stages`` contiguous, non-empty groups that minimise
    the largest group's cost; returns the ``num_stages + 1`` boundaries (first 0, last n).

    Ties go to the earliest cut, so every rank computes the same split.

    Raises:
        ShapeError: fewer layers than stages, or a negative cost.
    """
    n = len(costs)
    if num_stages < 1 or n < num_stages:
        raise ShapeError(f"balance: cannot cut {n} layers into {num_stages} non-empty stages, "
                         f"expected at least {num_stages} layers")
    if any(c < 0 or not np.isfinite(c) for c in costs):
        raise ShapeError(f"balance: costs must be finite and >= 0, got {list(costs)}")
    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype=np.float64)])
    inf = float("inf")
    # best[k][i]: the smallest max-cost of cutting the first i layers into k groups
    best = np.full((num_stages + 1, n + 1), inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=int)
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(int(cut[k][bounds[-1]]))
    return bounds[::-1]


def parameter_costs(layers: Sequence[Any]) -> list[float]:
    """Cost of each layer as its number of parameter elements (plus one, so that layers
    without parameters still count)."""
    return [1.0 + sum(float(np.prod(p.shape)) for p in layer.parameters()) for layer in layers]


def measure_costs(layers: Sequence[Any], sample: Any, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each layer on ``sample`` (a batch for the first layer),
    the median of ``repeats`` runs. Timings differ between processes: measure on one rank and
    broadcast the numbers, or every rank may cut the model differently."""
    from needle.autograd import Tensor

    runs = []
    for _ in range(max(1, repeats)):
        x, times = sample, []
        for layer in layers:
            inp = Tensor(x.numpy() if hasattr(x, "numpy") else x, requires_grad=True,
                         device=getattr(x, "device", None))
            start = time.perf_counter()
            out = layer(inp)
            out.backward(Tensor(np.ones(out.shape, dtype=str(out.dtype)), device=out.device))
            times.append(time.perf_counter() - start)
            x = out.detach()
        runs.append(times)
    return [float(v) for v in np.median(np.array(runs), axis=0)]


def split_sequential(model: Any, num_stages: int, costs: Any = "params",
                     sample: Any = None) -> list[Any]:
    """Cut ``model`` (an ``nn.Sequential``) into ``num_stages`` balanced ``Sequential`` pieces.

    Args:
        costs: "params" (parameter counts), "measure" (time each layer on ``sample``; see
            :func:`measure_costs`), or one number per layer.

    Example:
        >>> import numpy as np; from needle import nn
        >>> np.random.seed(0)
        >>> m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 2))
        >>> [len(s.modules) for s in split_sequential(m, 2)]
        [2, 2]
    """
    from needle import nn

    layers = list(getattr(model, "modules", ()))
    if not isinstance(model, nn.Sequential) or not layers:
        raise ShapeError(f"split_sequential: expected a non-empty nn.Sequential, got "
                         f"{type(model).__name__}")
    if isinstance(costs, str):
        if costs == "params":
            costs = parameter_costs(layers)
        elif costs == "measure":
            if sample is None:
                raise ShapeError("split_sequential: costs='measure' needs a sample batch, "
                                 "got sample=None")
            costs = measure_costs(layers, sample)
        else:
            raise ShapeError(f"split_sequential: costs must be 'params', 'measure' or one "
                             f"number per layer, got {costs!r}")
    if len(costs) != len(layers):
        raise ShapeError(f"split_sequential: one cost per layer, expected {len(layers)}, got "
                         f"{len(costs)}")
    bounds = balance(list(costs), num_stages)
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
