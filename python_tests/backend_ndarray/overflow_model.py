"""An independent model of needle's size limits, and hypothesis strategies of huge arguments.

The model answers "what must happen" for a request from first principles (docs/limits.md),
without calling needle's own checks: a view is read by enumerating its elements one by one
(small views) or from the extreme corners of its index space (large ones), and a buffer request
is refused past 2**62 bytes. It returns the set of error classes that a correct implementation
may raise (several conditions can hold at once and the order of the checks is not part of the
contract), or an empty set when the request must succeed.

The strategies mix small values with huge ones (2**50 and up): every huge request either passes
a limit or lies beyond any machine's address space (so that a correct implementation refuses it
with OutOfMemoryError, deterministically, without touching memory), and everything that must
succeed is small enough to read and compare with a reference built element by element.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import strategies as st

from needle._core.errors import IndexOutOfRange, OutOfMemoryError, ShapeError, SizeLimitError

LIMIT = 2**62            # bytes per buffer, elements per view
INT64_MAX = 2**63 - 1
# Requests below LIMIT but at or above this many bytes exceed the 47-bit user address space of
# x86-64 Linux (and any real memory): the allocation must fail with OutOfMemoryError.
REFUSED_BYTES = 2**50
SMALL = 4096             # views up to this many elements are read and compared in full

HUGE_DIMS = (2**50, 2**52, 2**61, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64)
HUGE_STRIDES = tuple(s * sign for s in (2**31, 2**32, 2**61, 2**62, 2**63 - 1, 2**63, 2**64)
                     for sign in (1, -1))
OFFSETS = (0, 0, 1, 3, 7, 2**31, 2**62, 2**63 - 1, 2**63, -1)
DTYPES = ("float32", "float64", "float16")

small_dims = st.integers(0, 4)
dims = small_dims | small_dims | st.sampled_from(HUGE_DIMS)
shapes = st.lists(dims, min_size=0, max_size=4).map(tuple)
strides_values = st.integers(-3, 3) | st.integers(-3, 3) | st.sampled_from(HUGE_STRIDES)
offsets = st.sampled_from(OFFSETS)
dtypes = st.sampled_from(DTYPES)


def strides_for(shape) -> st.SearchStrategy:
    return st.lists(strides_values, min_size=len(shape), max_size=len(shape)).map(tuple)


# (shape, strides) pairs of equal length.
views = shapes.flatmap(lambda s: st.tuples(st.just(s), strides_for(s)))


# ---- the model ----------------------------------------------------------------------------
def alloc_errors(count: int, itemsize: int) -> set:
    """Errors allowed for a new buffer of ``count`` elements (empty set: it must succeed)."""
    nbytes = count * itemsize
    if nbytes > LIMIT:
        return {SizeLimitError}
    if nbytes >= REFUSED_BYTES:
        return {OutOfMemoryError}
    assert count <= SMALL * 16, f"strategy made a risky request of {nbytes} bytes"
    return set()


def element_offsets(shape, strides, offset):
    """Every element's offset in the buffer, in row-major order (small views only)."""
    if math.prod(shape) == 0:
        return  # (itertools.product would first list every range, however long)
    for index in itertools.product(*(range(n) for n in shape)):
        yield offset + sum(i * s for i, s in zip(index, strides, strict=True))


def view_inside(shape, strides, offset, buffer_size) -> bool:
    """Whether every element of a non-empty view lies in [0, buffer_size)."""
    if math.prod(shape) <= SMALL:
        return all(0 <= o < buffer_size for o in element_offsets(shape, strides, offset))
    # Large views: the offset is linear in each index, so its extremes sit at corners.
    corners = itertools.product(*((0, n - 1) for n in shape))
    ends = [offset + sum(i * s for i, s in zip(c, strides, strict=True)) for c in corners]
    return min(ends) >= 0 and max(ends) < buffer_size


def view_errors(shape, strides, offset, buffer_size) -> set:
    """Errors allowed for a view of a ``buffer_size``-element buffer."""
    if len(shape) != len(strides) or any(n < 0 for n in shape):
        return {ShapeError}
    errors = set()
    count = math.prod(shape)
    if count > LIMIT or any(n > LIMIT for n in shape):  # kernels take every dim as int64
        errors.add(SizeLimitError)
    if not 0 <= offset <= INT64_MAX or any(abs(s) > INT64_MAX for s in strides):
        errors.add(IndexOutOfRange)
    elif count and not view_inside(shape, strides, offset, buffer_size):
        errors.add(IndexOutOfRange)
    return errors


def gather(buffer: np.ndarray, shape, strides, offset) -> np.ndarray:
    """The reference values of a valid small view, read element by element."""
    flat = [buffer[o] for o in element_offsets(shape, strides, offset)]
    return np.array(flat, dtype=buffer.dtype).reshape(shape) if flat else np.zeros(
        shape, dtype=buffer.dtype)


def corner_index(shape) -> tuple:
    """Index of the first (up to) two entries along every dimension: a small piece of a view."""
    return tuple(slice(0, min(n, 2)) for n in shape)


def check_outcome(run, allowed: set, success_ok: bool | None = None):
    """Run ``run()``: it must raise one of ``allowed``, or succeed.

    Success is required when ``allowed`` is empty and refused otherwise, unless
    ``success_ok`` says (requests that touch no element may be refused or done as a no-op).
    Returns ``(label, value)``: the outcome's name (for the report) and ``run()``'s result.
    """
    if success_ok is None:
        success_ok = not allowed
    try:
        value = run()
    except Exception as exc:  # noqa: BLE001 - every exception is compared with the model
        if not isinstance(exc, tuple(allowed)):
            want = sorted(c.__name__ for c in allowed) or ["success"]
            raise AssertionError(f"expected {' or '.join(want)}, "
                                 f"got {type(exc).__name__}: {exc}") from exc
        return type(exc).__name__, None
    if not success_ok:
        raise AssertionError(f"expected one of {sorted(c.__name__ for c in allowed)}, "
                             f"got success")
    return "ok", value
