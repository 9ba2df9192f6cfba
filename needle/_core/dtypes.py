"""dtype names, their NumPy equivalents and the promotion rule.

needle names dtypes by string. As the course framework does, it coerces every dtype it
does not store (bool, ints, ``None``) to ``"float32"``; ``"float64"``, ``"float16"`` and
``"bfloat16"`` are kept when asked for explicitly. ``"bfloat16"`` is NumPy's through the
``ml_dtypes`` package, imported the first time a bfloat16 is asked for (:func:`numpy_dtype`,
:func:`canonical_dtype`), not by ``import needle``: its import takes most of a second, which
every process of a multi-process job would pay without ever using bfloat16.

Promotion rule: elementwise ops between arrays of *different* dtypes raise
:class:`DTypeError` (convert explicitly with ``.astype``). Python and NumPy scalars are
"weak": they take the array's dtype.

Example:
    >>> canonical_dtype("bool"), canonical_dtype(None), canonical_dtype("float64")
    ('float32', 'float32', 'float64')
"""
from __future__ import annotations

import numpy as np

from .errors import DTypeError

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")
# the two-byte dtypes that store their values and compute in float32
LOW_PRECISION = ("float16", "bfloat16")
DEFAULT_DTYPE = "float32"
# bytes per element of each supported dtype, known without asking NumPy (bfloat16 would need
# ml_dtypes imported)
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
_bfloat16 = None  # np.dtype of ml_dtypes.bfloat16 once imported


def bfloat16_dtype() -> np.dtype:
    """NumPy's bfloat16 dtype; imports ``ml_dtypes`` on the first call, which also makes
    ``np.dtype("bfloat16")`` work from then on.

    Example:
        >>> bfloat16_dtype().itemsize
        2
    """
    global _bfloat16
    if _bfloat16 is None:
        import ml_dtypes  # registers np.dtype("bfloat16") as a side effect

        _bfloat16 = np.dtype(ml_dtypes.bfloat16)
    return _bfloat16


def canonical_dtype(dtype, op: str = "dtype") -> str:
    """Map any dtype spelling to one of :data:`SUPPORTED_DTYPES` (course coercion rules).

    Raises:
        DTypeError: for something that is not a dtype at all (e.g. ``"floot32"``).
    """
    if dtype is None:
        return DEFAULT_DTYPE
    if isinstance(dtype, str) and dtype in SUPPORTED_DTYPES:
        if dtype == "bfloat16" and _bfloat16 is None:
            bfloat16_dtype()  # what follows may spell it np.dtype("bfloat16")
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


def numpy_dtype(dtype) -> np.dtype:
    """The NumPy dtype with the same layout as the needle dtype name (or of a NumPy dtype).

    Example:
        >>> numpy_dtype("bfloat16").name, numpy_dtype("float16").itemsize
        ('bfloat16', 2)
    """
    if type(dtype) is str and dtype == "bfloat16":
        return bfloat16_dtype()
    return np.dtype(dtype)

