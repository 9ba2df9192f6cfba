"""needle.compiler (layer L5): ``ndl.compile``, capture a step once, replay it in one arena.

See :mod:`needle.compiler.compiled` for what a compiled step does per call signature (warm-up,
trace, plan, replay), :mod:`needle.compiler.guard` for the refusal of data-dependent Python and
:mod:`needle.compiler.signature` for what triggers a new trace.

Example:
    >>> import numpy as np, needle as ndl
    >>> step = ndl.compile(lambda x: (x * 2 + 1).sum())
    >>> x = ndl.Tensor(np.ones((2, 3)), device=ndl.cpu_numpy())
    >>> [step(x).numpy().item() for _ in range(3)]
    [18.0, 18.0, 18.0]
"""
from __future__ import annotations

from .compiled import CompiledStep, compile
from .guard import refuse_host_reads
from .signature import signature

__all__ = ["compile", "CompiledStep", "refuse_host_reads", "signature"]
