"""One error hierarchy for needle, rooted at :class:`NeedleError`.

Messages follow one pattern: ``"<op>: <what is wrong>, expected <x>, got <y>"`` so the
reader learns the operation, the expectation and the actual value in one line.

Every class is also importable from the top level (``ndl.NeedleError``, ``ndl.ShapeError``...).

Example:
    >>> import needle as ndl
    >>> issubclass(ndl.ShapeError, ndl.NeedleError) and issubclass(ndl.ShapeError, ValueError)
    True
"""
from __future__ import annotations

__all__ = ["NeedleError", "ShapeError", "DTypeError", "DeviceError", "AxisError",
           "IndexOutOfRange", "BackendUnavailable", "GraphError", "ReleasedDataError",
           "CommError", "CheckpointError", "RNGStateError", "MemoryArgumentError",
           "MemoryPlanError", "OutOfMemoryError", "CompileError", "OptimizerError",
           "SerializationError"]


class NeedleError(Exception):
    """Root of every error needle raises on bad input or bad state."""


class ShapeError(NeedleError, ValueError):
    """Shapes (or sizes) that an operation cannot combine."""


class DTypeError(NeedleError, TypeError):
    """An unknown dtype, or dtypes mixed without a promotion rule."""


class DeviceError(NeedleError, ValueError):
    """An unknown device, or operands on different devices."""


class AxisError(NeedleError, IndexError):
    """An axis out of range for the array's number of dimensions."""


class IndexOutOfRange(NeedleError, IndexError):
    """An index or slice that falls outside the array."""


class SizeLimitError(ShapeError):
    """An array, view or byte count beyond what needle can address (see docs/limits.md).

    Raised before anything is allocated or read; the message names the op, the shape and the
    limit.
    """


class BackendUnavailable(NeedleError, RuntimeError):
    """A backend (compiled CPU module, CuPy/GPU) that is not installed or not usable."""


class BackendAttributeError(BackendUnavailable, AttributeError):
    """An attribute of a disabled device: also an ``AttributeError``, so ``getattr(dev, name,
    default)`` and ``hasattr`` probes (pytest's parametrize ids) see "absent"."""


class GraphError(NeedleError, RuntimeError):
    """Misuse of the autograd graph (backward through a freed graph, bad gradient from an op)."""


class ReleasedDataError(GraphError, AttributeError):
    """A read of an intermediate's data that autograd released (nothing saved or named it).

    Also an ``AttributeError`` so that ``getattr(array, name, default)`` probes see "absent".
    """


class DataError(NeedleError, ValueError):
    """A data file whose content is not what its format allows (refused, never executed)."""


class CommError(NeedleError, RuntimeError):
    """A distributed operation that failed or timed out; names the op and the ranks."""


class CheckpointError(NeedleError, RuntimeError):
    """A checkpoint region whose recomputation differed from its first forward."""


class RNGStateError(NeedleError, ValueError):
    """A random-stream state that does not fit the stream(s) it is given to."""


class MemoryArgumentError(NeedleError, ValueError):
    """A bad argument to a ``needle.memory`` function (unknown category, bad size, ...)."""


class MemoryPlanError(NeedleError, RuntimeError):
    """A memory plan or trace that cannot be built or executed."""


class OutOfMemoryError(NeedleError, MemoryError):
    """An allocation the device's allocator refused: a buffer within the size limits that a
    limit set with ``needle.memory.set_limit``, or the system, could not provide. ``details``
    holds what the message reports: the request, live bytes by category, the largest live
    tensors, reserved vs allocated bytes and the largest free block."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = dict(details or {})


class CompileError(NeedleError, RuntimeError):
    """``needle.compile`` cannot capture a step (data-dependent Python, bad arguments)."""


class OptimizerError(NeedleError, ValueError):
    """A bad optimizer or learning-rate scheduler argument (hyper-parameter, parameter group)."""


class SerializationError(NeedleError, ValueError):
    """A file that ``ndl.load`` cannot read back, or an object ``ndl.save`` cannot write."""


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` as ``BaseException.add_note`` does (Python 3.11+).

    On Python 3.10 the note is kept in ``exc.__notes__`` all the same, so code that reads
    the notes works on every supported version; only 3.11+ tracebacks print them.

    >>> e = ValueError("bad")
    >>> add_note(e, "in a hook")
    >>> e.__notes__
    ['in a hook']
    """
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
