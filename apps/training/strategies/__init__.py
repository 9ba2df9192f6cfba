"""Training strategies by name: each module holds one, registered here.

Adding a strategy: write ``strategies/<name>.py`` with a subclass of ``base.Strategy`` and add
it to :data:`STRATEGIES`.
"""
from __future__ import annotations

from .base import StepResult, Strategy
from .ddp import DataParallel
from .single import SingleProcess

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleProcess,
    "ddp": DataParallel,
}

__all__ = ["STRATEGIES", "Strategy", "StepResult"]
