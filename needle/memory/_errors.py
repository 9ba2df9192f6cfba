"""Errors of needle.memory, re-exported from the one hierarchy in :mod:`needle._core.errors`."""
from __future__ import annotations

from needle._core.errors import MemoryArgumentError, MemoryPlanError

__all__ = ["MemoryArgumentError", "MemoryPlanError"]
