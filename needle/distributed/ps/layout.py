"""Which server owns which parameter: shards balanced by bytes, grouped by dtype on the wire.

Parameters are dealt, largest first, to the server holding the fewest bytes so far (ties go
to the lower server index, then to the lower parameter index), so every rank computes the same
plan from the parameter shapes alone. On the wire a shard travels as one flat array per dtype
(dtypes in sorted order, parameters in model order inside each), so a shard with float32 and
float64 parameters costs two messages, never a conversion.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from needle._core.dtypes import numpy_dtype
from needle._core.errors import NeedleError


class ParameterServerConfigError(NeedleError, ValueError):
    """A parameter server was configured in a way that cannot work (names the setting)."""


@dataclass
class Shard:
    """One server's parameters: ``groups`` lists ``(dtype, [parameter index, ...])`` in wire
    order; ``nbytes`` is the shard's size (one push or one pull of it moves that many bytes)."""

    server: int
    params: list[int] = field(default_factory=list)
    groups: list[tuple[str, list[int]]] = field(default_factory=list)
    nbytes: int = 0

    def key(self, shapes: list[tuple[int, ...]]) -> int:
        """A 32-bit digest of the shard's keys (parameter indices, shapes, dtypes): it travels
        with every request, so a worker and a server that disagree on the layout fail loudly
        instead of mixing up parameters."""
        import zlib

        text = repr([(d, [(i, tuple(shapes[i])) for i in idx]) for d, idx in self.groups])
        return zlib.crc32(text.encode())

    def sizes(self, shapes: list[tuple[int, ...]]) -> list[int]:
        """Elements of each wire group."""
        return [int(sum(int(np.prod(shapes[i], dtype=np.int64)) for i in idx))
                for _, idx in self.groups]


def plan_shards(shapes: list[tuple[int, ...]], dtypes: list[str], servers: int) -> list[Shard]:
    """Shard the parameters over ``servers`` servers, balancing bytes.

    Example:
        >>> plan = plan_shards([(4, 4), (4,), (8,)], ["float32"] * 3, 2)
        >>> [(s.params, s.nbytes) for s in plan]
        [([0], 64), ([1, 2], 48)]
    """
    if servers < 1:
        raise ParameterServerConfigError(
            f"ParameterServer: servers must be >= 1, got {servers}")
    if servers > len(shapes):
        raise ParameterServerConfigError(
            f"ParameterServer: more servers than parameters, expected at most {len(shapes)} "
            f"servers (one parameter each at least), got {servers}")
    nbytes = [int(np.prod(s, dtype=np.int64)) * numpy_dtype(d).itemsize
              for s, d in zip(shapes, dtypes, strict=True)]
    plan = [Shard(k) for k in range(servers)]
    for i in sorted(range(len(shapes)), key=lambda i: (-nbytes[i], i)):
        target = min(plan, key=lambda s: (s.nbytes, s.server))
        target.params.append(i)
        target.nbytes += nbytes[i]
    for shard in plan:
        shard.params.sort()
        for dtype in sorted({dtypes[i] for i in shard.params}):
            shard.groups.append((dtype, [i for i in shard.params if dtypes[i] == dtype]))
    return plan


def buffer_groups(dtypes: list[str]) -> list[tuple[str, list[int]]]:
    """The model's buffers on the wire: ``(dtype, [buffer index, ...])`` per dtype, dtypes in
    sorted order, buffers in model order inside each (as a shard's parameters travel).

    Example:
        >>> buffer_groups(["float32", "int64", "float32"])
        [('float32', [0, 2]), ('int64', [1])]
    """
    return [(d, [i for i, x in enumerate(dtypes) if x == d]) for d in sorted(set(dtypes))]
