"""A mesh of ranks (data x tensor x pipeline parallel) and one process group per mesh line.

``init_device_mesh((dp, tp, pp))`` lays the world's ranks out in C order over the shape (the
last axis varies fastest: rank = (d * tp + t) * pp + s) and creates, for every axis, the
groups of ranks that differ only along it. Each rank keeps the groups it belongs to:
``mesh.get_group("tp")`` holds the ranks sharing its data-parallel replica and pipeline
stage, and so on. Every rank must call it (it calls ``new_group`` for every line, in the same
order everywhere).

Example (eight thread ranks, a 2 x 2 x 2 mesh):
    >>> import needle.distributed as dist
    >>> def job(rank):
    ...     mesh = init_device_mesh((2, 2, 2))
    ...     return mesh.coordinate, mesh.get_group("pp").ranks
    >>> dist.spawn_threads(job, 8)[5]
    ((1, 0, 1), [4, 5])
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from ._errors import CommError
from ._group import resolve
from .process_group import new_group


class DeviceMesh:
    """This rank's place in the mesh and the process group along each named axis."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...], coordinate: tuple,
                 groups: dict[str, Any]):
        self.shape, self.names, self.coordinate, self._groups = shape, names, coordinate, groups

    def _axis(self, name: str) -> int:
        if name not in self.names:
            raise CommError(f"DeviceMesh: unknown axis, expected one of {self.names}, got "
                            f"{name!r}")
        return self.names.index(name)

    def get_group(self, name: str) -> Any:
        """The process group of this rank's line along axis ``name``."""
        return self._groups[self.names[self._axis(name)]]

    __getitem__ = get_group

    def size(self, name: str) -> int:
        return self.shape[self._axis(name)]

    def local_rank(self, name: str) -> int:
        """This rank's index along axis ``name`` (its rank in ``get_group(name)``)."""
        return self.coordinate[self._axis(name)]

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape, strict=True))
        return f"DeviceMesh({dims}; this rank at {self.coordinate})"


def init_device_mesh(shape: Sequence[int], names: Sequence[str] | None = None,
                     timeout: float | None = None) -> DeviceMesh:
    """Build the mesh of ``shape`` over the world (its product must equal the world size).

    Args:
        names: one name per axis; default ``("dp", "tp", "pp")`` for three axes,
            ``("dp", "pp")``-style names must be given for other shapes.

    Raises:
        CommError: a shape that does not match the world size, or bad names.
    """
    shape = tuple(int(s) for s in shape)
    if names is None:
        if len(shape) != 3:
            raise CommError(f"init_device_mesh: names are required unless the shape has 3 "
                            f"axes (dp, tp, pp), got shape {shape}")
        names = ("dp", "tp", "pp")
    names = tuple(names)
    world = resolve(None, "init_device_mesh")
    if len(names) != len(shape) or len(set(names)) != len(names) or any(s < 1 for s in shape):
        raise CommError(f"init_device_mesh: expected positive sizes and one distinct name per "
                        f"axis, got shape {shape} and names {names}")
    if int(np.prod(shape)) != world.size:
        raise CommError(f"init_device_mesh: the mesh must cover the world, expected sizes "
                        f"whose product is {world.size}, got {shape}")
    grid = np.arange(world.size).reshape(shape)
    coordinate = tuple(int(c) for c in np.argwhere(grid == world.rank)[0])
    groups: dict[str, Any] = {}
    for axis, name in enumerate(names):
        others = [range(s) for i, s in enumerate(shape) if i != axis]
        for fixed in itertools.product(*others):
            index = list(fixed)
            index.insert(axis, slice(None))
            ranks = [int(r) for r in grid[tuple(index)]]
            group = new_group(ranks, timeout=timeout)
            if world.rank in ranks:
                groups[name] = group
    return DeviceMesh(shape, names, coordinate, groups)


def average_gradients(params: Sequence[Any], group: Any = None,
                      num_examples: float | None = None, bucket_cap_mb: float = 25) -> None:
    """Replace each parameter's ``.grad`` by its average over the ranks of ``group`` (data
    parallelism that DDP's hooks cannot serve: a pipeline step runs many backwards), through
    :class:`~needle.distributed.grad_sync.GradSync`, so the result is DDP's bit for bit.
    ``num_examples``: this rank's examples when ranks hold different numbers (the result is
    then ``sum_r n_r g_r / sum_r n_r``, each rank's loss being a mean over its examples).

    Example:
        >>> import numpy as np, needle.distributed as dist
        >>> from needle.autograd import Tensor
        >>> def job(rank):
        ...     p = Tensor([1.0]); p.grad = Tensor([float(rank + 1)])
        ...     average_gradients([p], num_examples=rank + 1)  # (1*1 + 2*2) / 3
        ...     return round(float(p.grad.numpy()[0]), 4)
        >>> dist.spawn_threads(job, 2)
        [1.6667, 1.6667]
    """
    from .grad_sync import AllReduceHook, GradSync

    sync = GradSync(params, group, AllReduceHook(label="mesh gradients", steps=False),
                    bucket_cap_mb=bucket_cap_mb, owner="average_gradients")
    if num_examples is not None:
        sync.set_num_examples(num_examples)
    sync.sync_now()
