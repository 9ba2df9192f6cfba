"""Training strategies by name: each module holds one, registered here.

Adding a strategy: write ``strategies/<name>.py`` with a subclass of ``base.Strategy`` and add
it to :data:`STRATEGIES`.
"""
from __future__ import annotations

from .base import StepResult, Strategy
from .ddp import DataParallel
from .mesh3d import Mesh3D
from .pipeline import Pipeline
from .ps import ParameterServerStrategy
from .single import SingleProcess
from .tp import TensorParallel
from .zero import Zero

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleProcess,
    "ddp": DataParallel,
    "pipeline": Pipeline,
    "tp": TensorParallel,
    "3d": Mesh3D,
    "zero": Zero,
    "ps": ParameterServerStrategy,
}

__all__ = ["STRATEGIES", "Strategy", "StepResult"]
