"""dtype names, their NumPy equivalents and the promotion rule.

needle names dtypes by string. As the course framework does, it coerces every dtype it
does not store (bool, ints, ``None``) to ``"float32"``; ``"float64"``, ``"float16"`` and
``"bfloat16"`` are kept when asked for explicitly. ``"bfloat16"`` is NumPy's through the
``ml_dtypes`` package (``np.dtype("bfloat16")`` once it is imported).

Promotion rule: elementwise ops between arrays of *different* dtypes raise
:class:`DTypeError` (convert explicitly with ``.astype``). Python and NumPy scalars are
"weak": they take the array's dtype.

Example:
    >>> canonical_dtype("bool"), canonical_dtype(None), canonical_dtype("float64")
    ('float32', 'float32', 'float64')
"""
from __future__ import annotations

import ml_dtypes  # noqa: F401 - registers np.dtype("bfloat16")
import numpy as np

from .errors import DTypeError

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")
# the two-byte dtypes that store their values and compute in float32
LOW_PRECISION = ("float16", "bfloat16")
DEFAULT_DTYPE = "float32"


def canonical_dtype(dtype, op: str = "dtype") -> str:
    """Map any dtype spelling to one of :data:`SUPPORTED_DTYPES` (course coercion rules).

    Raises:
        DTypeError: for something that is not a dtype at all (e.g. ``"floot32"``).
    """
    if dtype is None:
        return DEFAULT_DTYPE
    if isinstance(dtype, str) and dtype in SUPPORTED_DTYPES:
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError as exc:
        raise DTypeError(
            f"{op}: unknown dtype, expected one of {SUPPORTED_DTYPES} or a NumPy dtype, "
            f"got {dtype!r}") from exc
    if name in SUPPORTED_DTYPES:
        return name
    if name == "bool" or np.issubdtype(np.dtype(name), np.number):
        return DEFAULT_DTYPE
    raise DTypeError(
        f"{op}: unsupported dtype, expected a numeric dtype, got {dtype!r}")


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype with the same layout as the needle dtype name."""
    return np.dtype(dtype)

