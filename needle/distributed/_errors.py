"""Error classes used by needle.distributed.

The real classes live in ``needle._core.errors``; the fallback below only exists so that this
package can be imported while that module is being written.
"""
from __future__ import annotations

try:
    from needle._core.errors import CommError, DTypeError, NeedleError, ShapeError
except ImportError:  # pragma: no cover - transitional fallback

    class NeedleError(Exception):
        """Base class of needle's errors (fallback)."""

    class CommError(NeedleError):
        """A communication operation failed or timed out (fallback)."""

    class ShapeError(NeedleError, ValueError):
        """Wrong shape (fallback)."""

    class DTypeError(NeedleError, TypeError):
        """Wrong dtype (fallback)."""


__all__ = ["CommError", "DTypeError", "NeedleError", "ShapeError"]
