"""The NumPy reference backend: the oracle every other backend's kernels are tested against.

Follows docs/backend_protocol.md. Buffers are flat NumPy arrays; kernels assume the caller
(:class:`needle.backend_ndarray.NDArray`) validated sizes and dtypes.

Example:
    >>> from needle.backend_ndarray import ndarray_backend_numpy as B
    >>> a = B.Array(3); B.fill(a, 2.0); B.to_numpy(a, (3,), (1,), 0).tolist()
    [2.0, 2.0, 2.0]
"""
from __future__ import annotations

import math

import numpy as np

from .._core.dtypes import numpy_dtype
from .._core.errors import DTypeError, ShapeError
from .ndarray_limits import check_alloc, check_view

__device_name__ = "numpy"
__tile_size__ = 1
_ALIGNMENT = 256
# Installed by needle.memory (layer L2) at import: an object with ``allocate(nbytes)``
# returning a block with ``view(dtype, count)`` and ``release()``. L1 never imports L2.
_ALLOCATOR = None
# bfloat16 (ml_dtypes) ufuncs compute each element in float32 and round once, as the kernels
# do; its sums and products would round every partial result, so those widen explicitly.
_HALVES = ("float16", "bfloat16")


def set_allocator(allocator) -> None:
    """Route every buffer of this backend through ``allocator`` (None: plain NumPy)."""
    global _ALLOCATOR
    _ALLOCATOR = allocator


class Array:
    """A flat buffer of ``size`` elements of ``dtype``, aligned to 256 bytes."""

    __slots__ = ("array", "_raw", "_block", "__weakref__")

    def __init__(self, size: int, dtype: str = "float32"):
        size = int(size)
        if size < 0:
            raise ShapeError(f"Array: size must be >= 0, got {size}")
        itemsize = numpy_dtype(dtype).itemsize
        check_alloc("numpy Array", (size,), itemsize, dtype)
        nbytes = max(size, 1) * itemsize
        self._block = None
        if _ALLOCATOR is not None:
            self._block = _ALLOCATOR.allocate(nbytes)
            self._raw = None
            self.array = self._block.view(dtype, size)
            return
        # Over-allocate raw bytes and slice at an aligned address so ptr() is 256-aligned
        # like the compiled backends' buffers.
        raw = np.empty(nbytes + _ALIGNMENT, dtype=np.uint8)
        shift = (-raw.ctypes.data) % _ALIGNMENT
        self._raw = raw
        self.array = raw[shift:shift + nbytes].view(dtype)[:size]

    def __del__(self):
        block = self._block
        if block is not None:
            try:
                block.release()
            except Exception:  # noqa: BLE001 - interpreter shutdown may have torn L2 down
                pass

    @property
    def size(self) -> int:
        return self.array.size

    @property
    def dtype(self) -> str:
        return self.array.dtype.name

    @property
    def itemsize(self) -> int:
        return self.array.itemsize

    def ptr(self) -> int:
        return self.array.ctypes.data


def _view(a: Array, shape, strides, offset, op: str) -> np.ndarray:
    # np.lib.stride_tricks.as_strided reads wherever it is told: refuse views outside `a`.
    shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)
    check_view(op, shape, strides, int(offset), a.array.size)
    if not math.prod(shape):
        return np.empty(shape, dtype=a.array.dtype)
    item = a.array.itemsize
    return np.lib.stride_tricks.as_strided(
        a.array[offset:], shape, tuple(s * item for s in strides))


def to_numpy(a: Array, shape, strides, offset) -> np.ndarray:
    view = _view(a, shape, strides, offset, "to_numpy")
    return view.copy() if view.size else np.zeros(view.shape, dtype=a.array.dtype)


def from_numpy(a, out: Array) -> None:
    out.array[:] = np.asarray(a).reshape(-1)[: out.size]


def fill(out: Array, val) -> None:
    out.array.fill(val)


def _need(arr: Array, count: int, op: str, what: str) -> None:
    if arr.size < count:
        raise ShapeError(f"{op}: {what} too small, expected at least {count} elements, "
                         f"got {arr.size}")


def _same_dtype(op: str, out: Array, **inputs: Array) -> None:
    for what, arr in inputs.items():
        if arr.array.dtype != out.array.dtype:
            raise DTypeError(f"{op}: dtypes differ, expected {out.array.dtype} for {what}, "
                             f"got {arr.array.dtype}")


def compact(a: Array, out: Array, shape, strides, offset) -> None:
    view = _view(a, shape, strides, offset, "compact")
    _need(out, view.size, "compact", "out")
    out.array[:view.size] = view.reshape(-1)


def ewise_setitem(a: Array, out: Array, shape, strides, offset) -> None:
    view = _view(out, shape, strides, offset, "ewise_setitem")
    _need(a, view.size, "ewise_setitem", "a")
    view[...] = a.array[:view.size].reshape(view.shape)


def scalar_setitem(size, val, out: Array, shape, strides, offset) -> None:
    view = _view(out, shape, strides, offset, "scalar_setitem")
    if int(size) != view.size:
        raise ShapeError(f"scalar_setitem: size differs from the view, expected {view.size}, "
                         f"got {size}")
    view[...] = val


def _cast(val, out: Array):
    return out.array.dtype.type(val)


def _binary(fn):
    def kernel(a: Array, b: Array, out: Array) -> None:
        out.array[:] = fn(a.array, b.array)
    return kernel


def _scalar(fn):
    def kernel(a: Array, val, out: Array) -> None:
        out.array[:] = fn(a.array, _cast(val, out))
    return kernel


def _unary(fn):
    def kernel(a: Array, out: Array) -> None:
        out.array[:] = fn(a.array)
    return kernel


ewise_add = _binary(np.add)
ewise_sub = _binary(np.subtract)
ewise_mul = _binary(np.multiply)
ewise_div = _binary(np.divide)
ewise_maximum = _binary(np.maximum)
ewise_minimum = _binary(np.minimum)
ewise_power = _binary(np.power)
ewise_eq = _binary(lambda a, b: a == b)
ewise_ge = _binary(lambda a, b: a >= b)
# the backward of tanh and relu from their saved outputs (see NDArray.tanh_grad/relu_grad)
ewise_tanh_grad = _binary(lambda g, t: g * (1 - t * t))
ewise_relu_grad = _binary(lambda g, r: g * np.sign(r))


def ewise_add_rows(a: Array, row: Array, out: Array, m: int, n: int) -> None:
    """out (m x n) = a (m x n) + row (n) added to every row; out may be a."""
    if min(m, n) < 0:
        raise ShapeError(f"ewise_add_rows: dimensions must be >= 0, got m={m}, n={n}")
    for what, arr, need in (("a", a, m * n), ("out", out, m * n), ("row", row, n)):
        _need(arr, need, "ewise_add_rows", what)
    _same_dtype("ewise_add_rows", out, a=a, row=row)
    if row is out:
        raise ValueError("ewise_add_rows: out must not share memory with row")
    out.array[:m * n] = (a.array[:m * n].reshape(m, n) + row.array[:n]).reshape(-1)


scalar_add = _scalar(np.add)
scalar_sub = _scalar(np.subtract)
scalar_rsub = _scalar(lambda a, v: v - a)
scalar_mul = _scalar(np.multiply)
scalar_div = _scalar(np.divide)
scalar_rdiv = _scalar(lambda a, v: v / a)
scalar_power = _scalar(np.power)
scalar_rpower = _scalar(lambda a, v: np.power(v, a))
scalar_maximum = _scalar(np.maximum)
scalar_minimum = _scalar(np.minimum)
scalar_eq = _scalar(lambda a, v: a == v)
scalar_ge = _scalar(lambda a, v: a >= v)
scalar_le = _scalar(lambda a, v: a <= v)

ewise_neg = _unary(np.negative)
ewise_log = _unary(np.log)
ewise_exp = _unary(np.exp)
ewise_tanh = _unary(np.tanh)
ewise_sqrt = _unary(np.sqrt)
ewise_abs = _unary(np.abs)
ewise_sign = _unary(np.sign)


def ewise_sigmoid(a: Array, out: Array) -> None:
    x = a.array.astype(np.float64) if a.array.dtype.name in _HALVES else a.array
    # Split by sign so neither branch overflows exp.
    e = np.exp(-np.abs(x))
    out.array[:] = np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def ewise_cast(a: Array, out: Array) -> None:
    out.array[:] = a.array.astype(out.array.dtype)


def _need_matmul(op: str, a: Array, b: Array, out: Array, m: int, n: int, p: int) -> None:
    if min(m, n, p) < 0:
        raise ShapeError(f"{op}: dimensions must be >= 0, got m={m}, n={n}, p={p}")
    _need(out, m * p, op, "out")  # (NumPy would broadcast one value into an empty out)


def matmul(a: Array, b: Array, out: Array, m: int, n: int, p: int) -> None:
    _need_matmul("matmul", a, b, out, m, n, p)
    _need(a, m * n, "matmul", "a")
    _need(b, n * p, "matmul", "b")
    out.array[: m * p] = _product(a.array[: m * n].reshape(m, n),
                                  b.array[: n * p].reshape(n, p)).reshape(-1)


def _product(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    if left.dtype.name == "bfloat16":  # widen, multiply in float32, round the result once
        return (left.astype(np.float32) @ right.astype(np.float32)).astype(left.dtype)
    return left @ right


def matmul_strided(a: Array, b: Array, out: Array, m: int, n: int, p: int,
                   a_offset: int, ars: int, acs: int, b_offset: int, brs: int, bcs: int) -> None:
    if min(ars, acs, brs, bcs) < 0:
        raise ShapeError(f"matmul_strided: strides must be >= 0, got a ({ars}, {acs}), "
                         f"b ({brs}, {bcs})")
    _need_matmul("matmul_strided", a, b, out, m, n, p)
    if m and p:
        left = _view(a, (m, n), (ars, acs), a_offset, "matmul_strided")
        right = _view(b, (n, p), (brs, bcs), b_offset, "matmul_strided")
        out.array[: m * p] = _product(left, right).reshape(-1)


def _blocks(a: Array, out: Array, reduce_size: int) -> np.ndarray:
    if reduce_size < 0:
        raise ShapeError(f"reduce: reduce_size must be >= 0, got {reduce_size}")
    _need(a, out.size * reduce_size, "reduce", "a")
    # reshape(out.size, k), not (-1, k): the latter cannot infer -1 when k == 0
    return a.array[: out.size * reduce_size].reshape(out.size, reduce_size)


def reduce_sum(a: Array, out: Array, reduce_size: int) -> None:
    blocks = _blocks(a, out, reduce_size)
    out.array[:] = blocks.sum(axis=1, dtype=np.float32 if blocks.dtype.name == "bfloat16" else None)


def reduce_sum_leading(a: Array, out: Array, m: int, n: int) -> None:
    """out (n) = the m rows of a (m x n) added up, rows in order, in the element type (float32
    for float16 and bfloat16), as the C++ and CUDA kernels add them."""
    if min(m, n) < 0:
        raise ShapeError(f"reduce_sum_leading: dimensions must be >= 0, got m={m}, n={n}")
    _need(a, m * n, "reduce_sum_leading", "a")
    _need(out, n, "reduce_sum_leading", "out")
    _same_dtype("reduce_sum_leading", out, a=a)
    if n and a is out:
        raise ValueError("reduce_sum_leading: out must not share memory with a")
    rows = a.array[:m * n].reshape(m, n)
    total = np.zeros(n, np.float32 if rows.dtype.name in _HALVES else rows.dtype)
    for row in rows:  # one row at a time: the kernels' order (NumPy's own sum over axis 0
        total += row  # pairs them up when the columns are one apart, n = 1)
    out.array[:n] = total


def reduce_max(a: Array, out: Array, reduce_size: int) -> None:
    out.array[:] = _blocks(a, out, reduce_size).max(axis=1)


def reduce_min(a: Array, out: Array, reduce_size: int) -> None:
    out.array[:] = _blocks(a, out, reduce_size).min(axis=1)


def set_num_threads(n: int) -> None:
    """NumPy's own kernels are single threaded here; BLAS threads are threadpoolctl's job."""


def get_num_threads() -> int:
    return 1


# The fused kernels' reference (conv2d_*, lstm_cell_*), kept in their own module.
from .ndarray_backend_numpy_fused import *  # noqa: E402,F401,F403
