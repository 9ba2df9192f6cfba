"""The CUDA backend: CuPy raw kernels behind the backend protocol (docs/backend_protocol.md).

Kernels are the ``extern "C"`` functions of ``cuda_kernels/*.cu``, one instantiation per dtype
(float32, float64, float16 and bfloat16 computed in float), compiled once per device by NVRTC
and launched through one typed launcher (``_cuda/launch.py`` + ``_cuda/runtime.py``).
``matmul`` uses cuBLAS through CuPy by default (bfloat16: widened to float32 around it) and
our own tiled kernel after ``set_matmul_impl("tiled")``.
Importing this module never fails; :func:`available` says whether it can run here, and the
device lookup of ``needle.backend_ndarray`` disables ``cuda()`` when it is False.

Example (on a machine with a GPU):
    >>> from needle.backend_ndarray import ndarray_backend_cuda as B
    >>> if B.available():
    ...     a = B.Array(3); B.fill(a, 2.0); print(B.to_numpy(a, (3,), (1,), 0).tolist())
    ... else:
    ...     print([2.0, 2.0, 2.0])
    [2.0, 2.0, 2.0]
"""
from __future__ import annotations

import math
import operator
import threading

import numpy as np

from .._core.dtypes import ITEMSIZE
from .._core.errors import DTypeError, IndexOutOfRange, ShapeError
from ._cuda import launch as L
from ._cuda import runtime
from .ewise_codes import MAX_REGISTERS, check_in_place, check_program
from .ndarray_checks import check_class_ids
from .ndarray_limits import check_view

# Availability (read by the device lookup) and the allocator seam; the device-wide sync is
# synchronize() below (it also runs the deferred label checks).
available = runtime.available
unavailable_reason = runtime.unavailable_reason
set_allocator = runtime.set_allocator
get_allocator = runtime.get_allocator

__device_name__ = "cuda"
__tile_size__ = 4
MATMUL_IMPLS = ("cublas", "tiled")
_matmul_impl = "cublas"  # expected faster; bench/bench_gpu.py measures both (docs/cuda.md)

_EW, _ST, _RD, _MM = "elementwise.cu", "strided.cu", "reduce.cu", "matmul.cu"
_FU, _CV, _BN = "fused.cu", "conv.cu", "batch_norm.cu"


# needle's table, not NumPy's: NumPy knows bfloat16 only once ml_dtypes is imported
_ITEMSIZE = dict(ITEMSIZE)
assert set(_ITEMSIZE) == set(L.SUFFIX)
# Most elements of each item size that fit the buffer limit (L.check_buffer_bytes).
_MAX_ELEMENTS = {n: L.MAX_BUFFER_BYTES // n for n in set(_ITEMSIZE.values())}


class Array:
    """A flat device buffer of ``size`` elements of ``dtype`` from the backend's allocator.

    ``size``, ``dtype`` and ``itemsize`` are plain attributes (read on every launch: a
    property costs a Python call each time); treat them as read-only.
    """

    # __weakref__: in-place write logs (needle._core.versions) go away with their buffer
    __slots__ = ("_owner", "_ptr", "size", "dtype", "itemsize", "__weakref__")

    def __init__(self, size: int, dtype: str = "float32"):
        itemsize = _ITEMSIZE.get(dtype)  # the canonical names without asking NumPy (hot path)
        if itemsize is None:
            dtype = np.dtype(dtype).name
            if dtype not in L.SUFFIX:
                raise DTypeError(f"cuda Array: unsupported dtype, expected one of "
                                 f"{tuple(L.SUFFIX)}, got {dtype!r}")
            itemsize = _ITEMSIZE[dtype]
        if size.__class__ is not int or not 0 <= size <= _MAX_ELEMENTS[itemsize]:
            L.check_buffer_bytes("cuda Array", size, itemsize)  # raises, or size is an int-like
            size = int(size)
        self.itemsize = itemsize
        self.size = size
        self.dtype = dtype
        # A zero-size array still owns a real (one-element) buffer so ptr() is a valid address.
        allocate = runtime._allocator or runtime.get_allocator()
        owner = self._owner = allocate((size or 1) * itemsize)
        self._ptr = int(owner.ptr)

    def ptr(self) -> int:
        return self._ptr

    def __repr__(self) -> str:
        return f"cuda.Array(size={self.size}, dtype={self.dtype}, ptr={self._ptr:#x})"


# CuPy has no bfloat16 arrays: its views of bfloat16 buffers hold the raw two bytes.
_CUPY_DTYPE = {"bfloat16": "uint16"}


def _cupy_view(a: Array, count: int, offset: int = 0, shape=None, strides=None,
               owned: bool = True):
    """A CuPy array over ``a`` from element ``offset``, no copy: ``count`` elements in 1-D,
    ``shape`` row-major, or ``shape`` with element ``strides`` (the caller checked that the
    view fits the buffer). ``owned``: the view keeps ``a`` alive (False: the caller keeps it
    only while a buffer lives at that address, see ``_KEPT_VIEWS``)."""
    cupy = runtime._cupy or runtime.cupy_module()
    if owned:
        mem = cupy.cuda.UnownedMemory(a._ptr, (a.size or 1) * a.itemsize, a)
    else:  # sized to the view: another buffer at this address may be smaller than ``a``
        if strides is not None and all(shape):
            count = 1 + sum((int(n) - 1) * int(s) for n, s in zip(shape, strides, strict=True))
        mem = cupy.cuda.UnownedMemory(a._ptr, (int(offset) + max(count, 1)) * a.itemsize, None)
    memptr = cupy.cuda.MemoryPointer(mem, int(offset) * a.itemsize)
    dtype = _CUPY_DTYPE.get(a.dtype, a.dtype)
    if strides is None:  # one array object, not a flat one and a reshape of it
        return cupy.ndarray((count,) if shape is None else shape, dtype=dtype, memptr=memptr)
    return cupy.ndarray(shape, dtype=dtype, memptr=memptr,
                        strides=tuple(int(s) * a.itemsize for s in strides))


# ---- transfers, fill and strided copies ----------------------------------------------------
def to_numpy(a: Array, shape, strides, offset) -> np.ndarray:
    """A NumPy copy of the strided view; non-contiguous views are compacted on the GPU first.
    The host waits for the device here: the deferred label checks run first."""
    check_pending()
    shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)
    count = check_view("to_numpy", shape, strides, int(offset), a.size)
    if count == 0:
        return np.zeros(shape, dtype=a.dtype)
    mstrides = L.merge_dims(shape, strides)[1]
    if mstrides in ((), (1,)):
        src, start = a, int(offset)
    else:
        src, start = Array(count, a.dtype), 0
        compact(a, src, shape, strides, offset)
    return _cupy_view(src, count, start).get().view(a.dtype).reshape(shape)


def from_numpy(np_array, out: Array) -> None:
    """Copy ``out.size`` elements of a C-contiguous array to the device, cast to out's dtype."""
    if out.size == 0:
        return
    src = np.ascontiguousarray(np.asarray(np_array).reshape(-1)[: out.size], dtype=out.dtype)
    _cupy_view(out, out.size).set(src.view(_CUPY_DTYPE.get(out.dtype, out.dtype)))


_FILL = L.KernelSpec(_ST, "fill", ("a", "scalar", "i64"))
# view_of: the launcher checks that the view lies inside that buffer (see launch.prepare).
_COMPACT = L.KernelSpec(_ST, "compact", ("a", "a", "view"), grid="indexed", view_of=0)
_EWISE_SETITEM = L.KernelSpec(_ST, "ewise_setitem", ("a", "a", "view"), grid="indexed",
                              view_of=1)
_SCALAR_SETITEM = L.KernelSpec(_ST, "scalar_setitem", ("scalar", "a", "view"),
                               grid="indexed", view_of=1)


def fill(out: Array, val) -> None:
    if out.size:
        runtime.launch(_FILL, out.dtype, out.size, out, val, out.size)


def compact(a: Array, out: Array, shape, strides, offset) -> None:
    count = math.prod(map(int, shape))
    if count:
        runtime.launch(_COMPACT, out.dtype, count, a, out, (shape, strides, offset))


def ewise_setitem(a: Array, out: Array, shape, strides, offset) -> None:
    count = math.prod(map(int, shape))
    if count:
        runtime.launch(_EWISE_SETITEM, out.dtype, count, a, out, (shape, strides, offset))


def scalar_setitem(size, val, out: Array, shape, strides, offset) -> None:
    if size or math.prod(int(n) for n in shape):
        runtime.launch(_SCALAR_SETITEM, out.dtype, int(size), val, out,
                       (shape, strides, offset))


# ---- elementwise -------------------------------------------------------------------------
def _binary(base: str):
    spec = L.KernelSpec(_EW, base, ("a", "a", "a", "i64"), grid="packed")

    def kernel(a: Array, b: Array, out: Array) -> None:
        if out.size:
            runtime.launch(spec, out.dtype, out.size, a, b, out, out.size)

    kernel.__name__ = kernel.__qualname__ = base
    return kernel


def _scalar(base: str):
    spec = L.KernelSpec(_EW, base, ("a", "scalar", "a", "i64"), grid="packed")

    def kernel(a: Array, val, out: Array) -> None:
        if out.size:
            runtime.launch(spec, out.dtype, out.size, a, val, out, out.size)

    kernel.__name__ = kernel.__qualname__ = base
    return kernel


def _unary(base: str):
    spec = L.KernelSpec(_EW, base, ("a", "a", "i64"), grid="packed")

    def kernel(a: Array, out: Array) -> None:
        if out.size:
            runtime.launch(spec, out.dtype, out.size, a, out, out.size)

    kernel.__name__ = kernel.__qualname__ = base
    return kernel


ewise_add, ewise_sub = _binary("ewise_add"), _binary("ewise_sub")
ewise_mul, ewise_div = _binary("ewise_mul"), _binary("ewise_div")
ewise_maximum, ewise_minimum = _binary("ewise_maximum"), _binary("ewise_minimum")
ewise_power, ewise_eq, ewise_ge = _binary("ewise_power"), _binary("ewise_eq"), _binary("ewise_ge")
# fused backward steps (NDArray.tanh_grad / relu_grad): one pass instead of three kernels
ewise_tanh_grad, ewise_relu_grad = _binary("ewise_tanh_grad"), _binary("ewise_relu_grad")

scalar_add, scalar_sub, scalar_rsub = _scalar("scalar_add"), _scalar("scalar_sub"), \
    _scalar("scalar_rsub")
scalar_mul, scalar_div, scalar_rdiv = _scalar("scalar_mul"), _scalar("scalar_div"), \
    _scalar("scalar_rdiv")
scalar_power, scalar_rpower = _scalar("scalar_power"), _scalar("scalar_rpower")
scalar_maximum, scalar_minimum = _scalar("scalar_maximum"), _scalar("scalar_minimum")
scalar_eq, scalar_ge, scalar_le = _scalar("scalar_eq"), _scalar("scalar_ge"), _scalar("scalar_le")

ewise_neg, ewise_log, ewise_exp = _unary("ewise_neg"), _unary("ewise_log"), _unary("ewise_exp")
ewise_tanh, ewise_sqrt, ewise_abs = _unary("ewise_tanh"), _unary("ewise_sqrt"), \
    _unary("ewise_abs")
ewise_sign, ewise_sigmoid = _unary("ewise_sign"), _unary("ewise_sigmoid")

# "indexed": the row is smaller than the launch; the extents are checked below instead
_ADD_ROWS = L.KernelSpec(_EW, "ewise_add_rows", ("a", "a", "a", "i64", "i64"), grid="indexed")


def ewise_add_rows(a: Array, row: Array, out: Array, m: int, n: int) -> None:
    """``out (m, n) = a (m, n) + row (n)``, the row added to every row; ``out`` may be ``a``."""
    m, n = int(m), int(n)
    if m < 0 or n < 0:
        raise ShapeError(f"ewise_add_rows: dimensions must be >= 0, got m={m}, n={n}")
    for what, arr, need in (("a", a, m * n), ("out", out, m * n), ("row", row, n)):
        L.check_extent("ewise_add_rows", what, arr, need)
    if row.ptr() == out.ptr():
        raise ValueError("ewise_add_rows: out must not share memory with row")
    if m * n:
        runtime.launch(_ADD_ROWS, out.dtype, m * n, a, row, out, m * n, n)


_CAST = L.KernelSpec(_EW, "ewise_cast", ("src", "a", "i64"), grid="packed")


def ewise_cast(a: Array, out: Array) -> None:
    """Compact ``a`` of any dtype into compact ``out`` of its own dtype (same size)."""
    if out.size:
        runtime.launch(_CAST, out.dtype, out.size, a, out, out.size, src_dtype=a.dtype)


# ---- reductions --------------------------------------------------------------------------
def _reduce(op: str):
    small = L.KernelSpec(_RD, f"reduce_small_{op}", ("a", "a", "i64", "i64"))
    warp = L.KernelSpec(_RD, f"reduce_warp_{op}", ("a", "a", "i64", "i64"), "rows")
    block = L.KernelSpec(_RD, f"reduce_block_{op}", ("a", "a", "i64", "i64", "i64"), "rows")
    partial = L.KernelSpec(_RD, f"reduce_partial_{op}", ("a", "acc", "i64", "i64", "i64"),
                           "rows")
    final = L.KernelSpec(_RD, f"reduce_final_{op}", ("acc", "a", "i64", "i64"), "rows")

    def kernel(a: Array, out: Array, reduce_size: int) -> None:
        rows, dtype = out.size, out.dtype
        if rows == 0:
            return
        if reduce_size < 0:
            raise ShapeError(f"reduce_{op}: reduce_size must be >= 0, got {reduce_size}")
        L.check_extent(f"reduce_{op}", "a", a, rows * reduce_size)
        plan = L.plan_reduce(rows, reduce_size, runtime.num_sms(runtime.device_id()))
        if plan.kind == "small":
            runtime.launch(small, dtype, rows, a, out, rows, reduce_size)
        elif plan.kind == "warp":
            runtime.launch(warp, dtype, plan.blocks, a, out, rows, reduce_size)
        elif plan.kind == "block":
            runtime.launch(block, dtype, rows, a, out, rows, reduce_size, 1)
        else:
            work = Array(rows * plan.chunks, L.ACC_DTYPE[dtype])
            runtime.launch(partial, dtype, plan.blocks, a, work, rows, reduce_size,
                           plan.chunks)
            runtime.launch(final, dtype, rows, work, out, rows, plan.chunks)

    kernel.__name__ = kernel.__qualname__ = f"reduce_{op}"
    return kernel


reduce_sum, reduce_max, reduce_min = _reduce("sum"), _reduce("max"), _reduce("min")

# ---- leading axes -------------------------------------------------------------------------
# (a, out, m, n, lanes, chunks, width); "rows": the grid is the plan's block count
_LEADING = ("i64",) * 5


def _leading(op: str):
    name = f"reduce_{op}_leading"
    direct = L.KernelSpec(_RD, name, ("a", "a") + _LEADING, "rows")
    partial = L.KernelSpec(_RD, f"{name}_partial", ("a", "acc") + _LEADING, "rows")
    final = L.KernelSpec(_RD, f"{name}_final", ("acc", "a") + _LEADING, "rows")

    def kernel(a: Array, out: Array, m: int, n: int) -> None:
        m, n = int(m), int(n)
        if m < 0 or n < 0:
            raise ShapeError(f"{name}: dimensions must be >= 0, got m={m}, n={n}")
        if op != "sum" and m == 0 and n:
            raise ShapeError(f"{name}: zero-size reduction has no identity, expected m >= 1, "
                             f"got m=0")
        L.check_extent(name, "a", a, m * n)
        L.check_extent(name, "out", out, n)
        if n and a.ptr() == out.ptr():
            raise ValueError(f"{name}: out must not share memory with a")
        if not n:
            return
        dtype = out.dtype
        plan = L.plan_reduce_leading(m, n, a.itemsize, a.ptr(),
                                     runtime.num_sms(runtime.device_id()))
        if plan.chunks == 1:
            runtime.launch(direct, dtype, plan.blocks, a, out, m, n, plan.lanes, 1, plan.width)
            return
        work = Array(plan.chunks * n, L.ACC_DTYPE[dtype])
        runtime.launch(partial, dtype, plan.blocks, a, work, m, n, plan.lanes, plan.chunks,
                       plan.width)
        last = L.plan_reduce_leading(plan.chunks, n, work.itemsize, work.ptr(), 1, split=False)
        runtime.launch(final, dtype, last.blocks, work, out, plan.chunks, n, last.lanes, 1,
                       last.width)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = (
        f"``out (n)`` = the {op} over the ``m`` rows of ``a (m, n)``, in the compute type "
        f"(float for float16). Up to 256 rows, each column row by row in order (bitwise the "
        f"NumPy and C++ backends); more rows are shared among threads and blocks whose "
        f"partials are combined in a fixed order (the same bits run to run).")
    return kernel


reduce_sum_leading = _leading("sum")
# max/min over leading axes: a column kernel instead of NDArray's transposing copy
reduce_max_leading, reduce_min_leading = _leading("max"), _leading("min")


# ---- matmul ------------------------------------------------------------------------------
_MATMUL = L.KernelSpec(_MM, "matmul", ("a", "a", "a", "i64", "i64", "i64"), grid="matmul")
_MATMUL_TILED = L.KernelSpec(_MM, "matmul_tiled", ("a", "a", "a", "i64", "i64", "i64", "i64"),
                             grid="indexed")


def set_matmul_impl(name: str) -> None:
    """Choose ``matmul``'s path: ``"cublas"`` (CuPy, default) or ``"tiled"`` (our kernel)."""
    global _matmul_impl
    if name not in MATMUL_IMPLS:
        raise ValueError(f"set_matmul_impl: unknown implementation, expected one of "
                         f"{MATMUL_IMPLS}, got {name!r}")
    _matmul_impl = name


def get_matmul_impl() -> str:
    return _matmul_impl


def matmul(a: Array, b: Array, out: Array, m: int, n: int, p: int) -> None:
    """``out (m×p) = a (m×n) @ b (n×p)``, compact row-major; overwrites ``out``."""
    _check_matmul("matmul", a, b, out, m, n, p)
    if m == 0 or p == 0:
        return
    if n == 0:
        fill(out, 0.0)
    elif _matmul_impl == "cublas" and out.dtype == "bfloat16":
        _matmul_widened(a, b, out, m, n, p)
    elif _matmul_impl == "cublas":
        _matmul_cublas(a, b, out, m, n, p)
    else:
        runtime.launch(_MATMUL, out.dtype, (m, p), a, b, out, m, n, p)


def matmul_strided(a: Array, b: Array, out: Array, m: int, n: int, p: int, a_offset: int,
                   ars: int, acs: int, b_offset: int, brs: int, bcs: int) -> None:
    """``out (m×p) = A @ B`` where A and B are strided views (element strides >= 0) of ``a``
    and ``b``: no compact copy of a transposed operand (every matmul backward multiplies by
    a transpose), which cuBLAS reads in place; CuPy copies other layouts itself."""
    op = "matmul_strided"
    if min(ars, acs, brs, bcs) < 0:
        raise ShapeError(f"{op}: strides must be >= 0, got a ({ars}, {acs}), b ({brs}, {bcs})")
    if min(m, n, p) < 0:
        raise ShapeError(f"{op}: dimensions must be >= 0, got m={m}, n={n}, p={p}")
    _same_dtype(op, out, a, b)
    if out.dtype == "bfloat16":  # CuPy would multiply the raw bits: NDArray compacts instead
        raise DTypeError(f"{op}: expected float32, float64 or float16, got bfloat16")
    L.check_extent(op, "out", out, m * p)
    if m == 0 or p == 0:
        return
    if n == 0:
        fill(out, 0.0)
        return
    views = []
    for arr, shape, strides, offset in ((a, (m, n), (ars, acs), a_offset),
                                        (b, (n, p), (brs, bcs), b_offset)):
        # the buffer's size is in the key: a smaller buffer later at this address is checked
        key = (arr._ptr, arr.dtype, arr.size, shape, strides, offset)
        view = _KEPT_VIEWS.get(key)
        if view is None:  # checked once per kept view: the key holds everything checked
            check_view(op, shape, strides, offset, arr.size)
            view = _keep(key, _cupy_view(arr, 0, offset, shape, strides, owned=False))
        views.append(view)
    _matmul_into(*views, _kept_view(out, m, p, False))


def _check_matmul(op: str, a: Array, b: Array, out: Array, m: int, n: int, p: int) -> None:
    if min(m, n, p) < 0:
        raise ShapeError(f"{op}: dimensions must be >= 0, got m={m}, n={n}, p={p}")
    L.check_extent(op, "a", a, m * n)
    L.check_extent(op, "b", b, n * p)
    L.check_extent(op, "out", out, m * p)


def _matmul_cublas(a: Array, b: Array, out: Array, m: int, n: int, p: int) -> None:
    _gemm(a, b, out, m, n, p)


def _matmul_widened(a: Array, b: Array, out: Array, m: int, n: int, p: int) -> None:
    """bfloat16 through cuBLAS (CuPy has no bfloat16 arrays): both operands widened to
    float32, multiplied, the result rounded once, as the C++ backend does."""
    wide = [Array(count, "float32") for count in (m * n, n * p, m * p)]
    runtime.launch(_CAST, "float32", m * n, a, wide[0], m * n, src_dtype="bfloat16")
    runtime.launch(_CAST, "float32", n * p, b, wide[1], n * p, src_dtype="bfloat16")
    _gemm(wide[0], wide[1], wide[2], m, n, p)
    runtime.launch(_CAST, "bfloat16", m * p, wide[2], out, m * p, src_dtype="float32")


def _gemm(a: Array, b: Array, out: Array, m: int, k: int, p: int, trans_a: bool = False,
          trans_b: bool = False) -> None:
    """``out (m, p) = op(a) @ op(b)`` through cuBLAS, ``op(a)`` being (m, k): ``a`` holds the
    row-major (k, m) matrix when ``trans_a`` (likewise ``b`` holds (p, k) when ``trans_b``);
    cuBLAS reads the transposes in place."""
    left = _kept_view(a, m, k, trans_a)
    right = _kept_view(b, k, p, trans_b)
    _matmul_into(left, right, _kept_view(out, m, p, False))


# A training step multiplies buffers at the same addresses with the same layouts step after
# step (the caching allocator hands its parked blocks out again), and making a CuPy view costs
# more host time than the rest of a product: the views are kept, keyed by address, dtype and
# layout. A kept view owns nothing (one that kept its buffer alive would pin the memory for as
# long as it is kept); it is used only while a live buffer sits at its address, and it reads
# exactly that buffer's elements, so it is what a fresh view would be.
MAX_KEPT_VIEWS = 4096
_KEPT_VIEWS: dict = {}


def _kept_view(a: Array, rows: int, cols: int, trans: bool):
    """The (rows, cols) matrix at ``a``'s address as a CuPy view: row-major, or the
    transpose of the row-major (cols, rows) matrix when ``trans``."""
    key = (a._ptr, a.dtype, rows, cols, trans)
    view = _KEPT_VIEWS.get(key)
    if view is None:
        view = _cupy_view(a, rows * cols, shape=(cols, rows) if trans else (rows, cols),
                          owned=False)
        view = _keep(key, view.T if trans else view)
    return view


def _keep(key: tuple, view):
    if len(_KEPT_VIEWS) >= MAX_KEPT_VIEWS:  # bounded: shapes seen once would pile up
        _KEPT_VIEWS.clear()
    _KEPT_VIEWS[key] = view
    return view


def _matmul_into(left, right, result) -> None:
    """``result[...] = left @ right`` for CuPy arrays, through cuBLAS."""
    cupy = runtime._cupy or runtime.cupy_module()
    try:
        cupy.matmul(left, right, out=result)
    except TypeError:  # older CuPy without out=: one extra device copy
        result[...] = cupy.matmul(left, right)


def matmul_tiled(a: Array, b: Array, out: Array, m: int, n: int, p: int) -> None:
    """The course's tiled layout with tile ``__tile_size__`` (see cuda_kernels/matmul.cu)."""
    _check_matmul("matmul_tiled", a, b, out, m, n, p)
    if m and p:
        runtime.launch(_MATMUL_TILED, out.dtype, m * p, a, b, out, m, n, p, __tile_size__)


# ---- fused kernels: softmax cross-entropy, embedding (cuda_kernels/fused.cu) ---------------
# Labels and ids are checked on the host, from one small copy (n values), before the launch:
# the kernels index with them. A compiled step on cuda() sees one kernel call either way.
_FLOATS = ("float32", "float64")  # fused.cu instantiates these only
_XENT_FWD = L.KernelSpec(_FU, "softmax_xent_forward", ("a", "a", "a", "a", "i64", "i64"),
                         grid="rows", dtypes=_FLOATS)
_XENT_BWD = L.KernelSpec(_FU, "softmax_xent_backward", ("a",) * 5 + ("i64", "i64"),
                         grid="indexed", dtypes=_FLOATS)
_EMB_FWD = L.KernelSpec(_FU, "embedding_forward", ("a", "a", "a", "i64", "i64", "i64"),
                        grid="indexed", dtypes=_FLOATS)
_EMB_BWD = L.KernelSpec(_FU, "embedding_backward", ("a", "a", "a", "i64", "i64", "i64"),
                        grid="indexed", dtypes=_FLOATS)


def _fused_checks(op: str, out: Array, sizes: dict, inputs: tuple) -> None:
    """float32/float64 only; each buffer of ``sizes`` ({name: (buffer, elements)}) big
    enough; ``out`` not one of ``inputs``."""
    if out.dtype not in _FLOATS:
        raise DTypeError(f"{op}: expected float32 or float64, got {out.dtype}")
    for what, (buffer, need) in sizes.items():
        if need < 0 or buffer.size < need:  # check_extent's test, before its call
            if need < 0:
                raise ShapeError(f"{op}: sizes must be >= 0, got {what} of {need} elements")
            L.check_extent(op, what, buffer, need)
    ptr = out._ptr
    for a in inputs:  # a loop, not any(generator): no Python frame per input
        if a._ptr == ptr:
            raise ValueError(f"{op}: out must not share memory with an input")


# ---- label and id checks, deferred to the next synchronisation -----------------------------
# Checking labels at the launch copies them to the host, which waits for every kernel queued
# before: twice per training step (loss forward and backward), so host and GPU took turns
# instead of overlapping. A launch records the check instead, over a device copy of the ids
# made in stream order (the ids' own buffer may be reused, e.g. by a compiled step's arena,
# before the check runs); the checks run, and the first failure raises naming the op and
# position, where the host waits for the device anyway: to_numpy and synchronize, or once
# MAX_PENDING_CHECKS have piled up. Meanwhile the kernels write NaN for a bad label and read
# nothing out of bounds (fused.cu).
MAX_PENDING_CHECKS = 64
_PENDING_CHECKS: list = []


def _defer_ids_check(ids: Array, n: int, k: int, what: str) -> None:
    if n:
        key = (ids._ptr, ids.dtype, n)
        view = _KEPT_VIEWS.get(key)
        if view is None:
            view = _keep(key, _cupy_view(ids, n, owned=False))
        _PENDING_CHECKS.append((view.copy(), k, what))
        if len(_PENDING_CHECKS) > MAX_PENDING_CHECKS:
            check_pending()


def pending_checks() -> int:
    """How many deferred label/id checks wait for the next synchronisation."""
    return len(_PENDING_CHECKS)


def check_pending() -> None:
    """Run the deferred label/id checks of earlier launches (waits for their copies).

    Raises:
        IndexOutOfRange: the first bad label or id, naming the op and position, as the check
            at the launch did.
    """
    if not _PENDING_CHECKS:
        return
    pending = list(_PENDING_CHECKS)
    _PENDING_CHECKS.clear()
    for snapshot, k, what in pending:
        try:
            check_class_ids(snapshot.get(), k, what)
        except IndexError as exc:
            raise IndexOutOfRange(f"{exc} (a launch before this synchronisation of the cuda "
                                  f"device; the checks wait for one)") from None


def synchronize() -> None:
    """Wait for every kernel queued on the current device, then run the deferred checks."""
    runtime.synchronize()
    check_pending()


def softmax_xent_forward(z: Array, labels: Array, loss: Array, lse: Array, n: int,
                         k: int) -> None:
    """Per row of ``z`` (n, k): ``lse = logsumexp(z)``, ``loss = lse - z[label]``."""
    op = "softmax_xent_forward"
    _fused_checks(op, loss, {"z": (z, n * k), "labels": (labels, n), "loss": (loss, n),
                             "lse": (lse, n)}, (z, labels))
    _defer_ids_check(labels, n, k, f"{op}: class label out of range at row")
    if n:
        runtime.launch(_XENT_FWD, loss.dtype, n, z, labels, loss, lse, n, k)


def softmax_xent_backward(z: Array, labels: Array, lse: Array, g: Array, dz: Array, n: int,
                          k: int) -> None:
    """``dz = g (softmax(z) - onehot(label))`` per row, from the saved ``lse``."""
    op = "softmax_xent_backward"
    _fused_checks(op, dz, {"z": (z, n * k), "labels": (labels, n), "lse": (lse, n),
                           "g": (g, n), "dz": (dz, n * k)}, (z, labels, lse, g))
    _defer_ids_check(labels, n, k, f"{op}: class label out of range at row")
    if n * k:
        runtime.launch(_XENT_BWD, dz.dtype, n * k, z, labels, lse, g, dz, n, k)


def embedding_forward(table: Array, ids: Array, out: Array, num: int, dim: int,
                      n: int) -> None:
    """``out[i] = table[ids[i]]``: rows of the (num, dim) ``table`` picked by ``n`` ids."""
    op = "embedding_forward"
    _fused_checks(op, out, {"table": (table, num * dim), "ids": (ids, n),
                            "out": (out, n * dim)}, (table, ids))
    _defer_ids_check(ids, n, num, "embedding: id out of range at position")
    if n * dim:
        runtime.launch(_EMB_FWD, out.dtype, n * dim, table, ids, out, num, dim, n)


def embedding_backward(g: Array, ids: Array, dtable: Array, num: int, dim: int,
                       n: int) -> None:
    """``dtable = 0``, then ``dtable[ids[i]] += g[i]`` in position order."""
    op = "embedding_backward"
    _fused_checks(op, dtable, {"g": (g, n * dim), "ids": (ids, n),
                               "dtable": (dtable, num * dim)}, (g, ids))
    _defer_ids_check(ids, n, num, "embedding: id out of range at position")
    if num * dim:
        runtime.launch(_EMB_BWD, dtable.dtype, num * dim, g, ids, dtable, num, dim, n)


# ---- convolution: im2col / col2im kernels (cuda_kernels/conv.cu) around cuBLAS products -----
# NHWC input (n, h, w, c), kernel (kh, kw, c, cout), output (n, ho, wo, cout), as the CPU
# backends. The patch matrix (n*ho*wo, kh*kw*c) is a workspace: callers that plan memory pass
# one of conv2d_workspace(...) elements as the last argument (needle.ops does: the buffer is
# then an allocation of the graph like any other, planned and measured); without it the call
# allocates its own. A 1x1 kernel with stride 1 and no padding needs none (its patch matrix
# is the input itself).
_IM2COL = L.KernelSpec(_CV, "im2col", ("a", "a") + ("i64",) * 10, grid="indexed",
                       dtypes=_FLOATS)
_COL2IM = L.KernelSpec(_CV, "col2im", ("a", "a") + ("i64",) * 10, grid="indexed",
                       dtypes=_FLOATS)


# Validated geometries by their arguments (a model has a few convolutions, each asked for its
# workspace and its products every step). Bounded; a refused geometry is never kept.
_GEOMETRIES: dict = {}


def _conv_geometry(op: str, n, h, w, c, kh, kw, cout, stride, pad) -> tuple:
    """The validated geometry plus ``(ho, wo)``, as the CPU backend validates it."""
    key = (n, h, w, c, kh, kw, cout, stride, pad)
    try:
        geometry = _GEOMETRIES.get(key)
    except TypeError:  # an unhashable size (a 0-d array): checked every time
        return _check_geometry(op, *key)
    if geometry is None:
        geometry = _check_geometry(op, *key)
        if len(_GEOMETRIES) >= 1024:
            _GEOMETRIES.clear()
        _GEOMETRIES[key] = geometry
    return geometry


def _check_geometry(op: str, n, h, w, c, kh, kw, cout, stride, pad) -> tuple:
    # map, not a generator: no Python frame per value (this runs for every conv call)
    n, h, w, c, kh, kw, cout, stride, pad = map(int, (n, h, w, c, kh, kw, cout, stride, pad))
    if (min(n, h, w, c, kh, kw, cout, stride) < 1 or pad < 0 or h + 2 * pad < kh
            or w + 2 * pad < kw):
        raise ShapeError(f"{op}: expected sizes >= 1, stride >= 1, pad >= 0 and a kernel that "
                         f"fits the padded input, got input ({n}, {h}, {w}, {c}), kernel "
                         f"({kh}, {kw}, {cout}), stride {stride}, pad {pad}")
    ho, wo = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
    return n, h, w, c, kh, kw, cout, stride, pad, ho, wo


def _is_pointwise(kh, kw, stride, pad) -> bool:
    return kh == kw == stride == 1 and pad == 0


def conv2d_workspace(n, h, wd, c, kh, kw, cout, stride, pad) -> int:
    """Elements of the workspace that ``conv2d_forward``/``_weight_grad``/``_input_grad`` use
    for this geometry (0: none)."""
    n, h, wd, c, kh, kw, cout, stride, pad, ho, wo = _conv_geometry(
        "conv2d_workspace", n, h, wd, c, kh, kw, cout, stride, pad)
    return 0 if _is_pointwise(kh, kw, stride, pad) else n * ho * wo * kh * kw * c


conv2d_workspace.query = True  # needle.compile calls it through (no buffer, no device state)


def _workspace(op: str, workspace, dtype: str, need: int, others: tuple) -> Array:
    if workspace is None:
        return Array(need, dtype)
    if workspace.dtype != dtype:
        raise DTypeError(f"{op}: dtypes differ, expected {dtype}, got workspace "
                         f"{workspace.dtype}")
    L.check_extent(op, "workspace", workspace, need)
    ptr = workspace._ptr
    for a in others:  # a loop, not any(generator): no Python frame per operand
        if a._ptr == ptr:
            raise ValueError(f"{op}: the workspace must not share memory with an operand")
    return workspace


def _im2col(x: Array, n, h, w, c, kh, kw, cout, stride, pad, ho, wo, workspace=None,
            op="conv2d", others=()) -> Array:
    if _is_pointwise(kh, kw, stride, pad):
        return x
    cols = _workspace(op, workspace, x.dtype, n * ho * wo * kh * kw * c, (x, *others))
    runtime.launch(_IM2COL, x.dtype, cols.size, x, cols, n, h, w, c, kh, kw, stride, pad, ho,
                   wo)
    return cols


def conv2d_forward(x: Array, w: Array, out: Array, n, h, wd, c, kh, kw, cout, stride,
                   pad, workspace: Array | None = None) -> None:
    """``out (n, ho, wo, cout) = conv(x (n, h, wd, c), w (kh, kw, c, cout))``, zero padding."""
    op = "conv2d_forward"
    g = n, h, wd, c, kh, kw, cout, stride, pad, ho, wo = _conv_geometry(
        op, n, h, wd, c, kh, kw, cout, stride, pad)
    _fused_checks(op, out, {"x": (x, n * h * wd * c), "w": (w, kh * kw * c * cout),
                            "out": (out, n * ho * wo * cout)}, (x, w))
    _same_dtype(op, out, x, w)
    _gemm(_im2col(x, *g, workspace, op, (w, out)), w, out, n * ho * wo, kh * kw * c, cout)


def conv2d_weight_grad(x: Array, dy: Array, dw: Array, n, h, wd, c, kh, kw, cout, stride,
                       pad, workspace: Array | None = None) -> None:
    """``dw (kh, kw, c, cout)``: the kernel gradient for the output gradient ``dy``."""
    op = "conv2d_weight_grad"
    g = n, h, wd, c, kh, kw, cout, stride, pad, ho, wo = _conv_geometry(
        op, n, h, wd, c, kh, kw, cout, stride, pad)
    _fused_checks(op, dw, {"x": (x, n * h * wd * c), "dy": (dy, n * ho * wo * cout),
                           "dw": (dw, kh * kw * c * cout)}, (x, dy))
    _same_dtype(op, dw, x, dy)
    cols = _im2col(x, *g, workspace, op, (dy, dw))
    _gemm(cols, dy, dw, kh * kw * c, n * ho * wo, cout, trans_a=True)


def conv2d_input_grad(dy: Array, w: Array, dx: Array, n, h, wd, c, kh, kw, cout, stride,
                      pad, workspace: Array | None = None) -> None:
    """``dx (n, h, wd, c)``: the input gradient for the output gradient ``dy``."""
    op = "conv2d_input_grad"
    n, h, wd, c, kh, kw, cout, stride, pad, ho, wo = _conv_geometry(
        op, n, h, wd, c, kh, kw, cout, stride, pad)
    _fused_checks(op, dx, {"dy": (dy, n * ho * wo * cout), "w": (w, kh * kw * c * cout),
                           "dx": (dx, n * h * wd * c)}, (dy, w))
    _same_dtype(op, dx, dy, w)
    if _is_pointwise(kh, kw, stride, pad):
        _gemm(dy, w, dx, n * ho * wo, cout, c, trans_b=True)
        return
    cols = _workspace(op, workspace, dx.dtype, n * ho * wo * kh * kw * c, (dy, w, dx))
    _gemm(dy, w, cols, n * ho * wo, cout, kh * kw * c, trans_b=True)
    runtime.launch(_COL2IM, dx.dtype, n * h * wd * c, cols, dx, n, h, wd, c, kh, kw, stride,
                   pad, ho, wo)


# ---- elementwise programs (cuda_kernels/elementwise.cu, ewise_program_*) ---------------------
# The whole program travels by value in one struct (ProgramArgs in elementwise.cu): pointers,
# scalars and instructions. Its capacity covers what needle builds: a fused run of
# needle.compiler.fusion holds at most MAX_REGISTERS buffers (inputs and outputs together)
# and so at most ~3 instructions per buffer; the optimizers' updates are shorter still.
PROGRAM_LIMITS = {"inputs": 16, "outputs": 16, "scalars": 32, "instructions": 96}
_PROGRAM_RECORD = np.dtype([("ins", "<u8", (16,)), ("outs", "<u8", (16,)),
                            ("scalars", "<f8", (32,)), ("code", "<i4", (5 * 96,)),
                            ("n_code", "<i4"), ("pad", "<i4")])
_PROGRAM = L.KernelSpec(_EW, "ewise_program", ("record", "i64"), grid="packed",
                        dtypes=_FLOATS)
_PROGRAM_PER_BLOCK = L.THREADS_PER_BLOCK * L.PACK  # launch_config's "packed" grid
# ewise_program writes pointers and scalars through 8-byte word views of the record
assert _PROGRAM_RECORD.fields["outs"][1] == 16 * 8
assert _PROGRAM_RECORD.fields["scalars"][1] == 32 * 8
assert MAX_REGISTERS == 16  # NEEDLE_PROGRAM_REGISTERS in elementwise.cu


def ewise_program(ins, outs, code, scalars, n) -> None:
    """Run the elementwise program ``code`` (instruction set: ``ewise_codes``) over the first
    ``n`` elements of every input, writing each output once: one launch, bitwise the result
    of this backend's separate kernels run one by one."""
    filled = _program_record(ins, outs, tuple(code), scalars, n)
    if filled is not None:
        runtime.launch(_PROGRAM, filled[0], filled[2], filled[1], filled[2])


def ewise_program_many(launches, code, scalars) -> None:
    """:func:`ewise_program` for each ``(ins, outs, n)`` of ``launches``, in order (an
    optimizer's step: one program over every parameter). Each launch is checked as a lone
    call checks it (those before a refused one have run); the kernel is looked up once."""
    code = tuple(code)
    kernel = scratch = None
    for ins, outs, n in launches:
        filled = _program_record(ins, outs, code, scalars, n, scratch)
        if filled is None:
            continue
        dtype, record, n, scratch = filled
        if kernel is None or kernel[0] != dtype:
            # the launcher's checks and grid once; its record check holds for every refill
            name, _, block, _ = L.prepare(_PROGRAM, dtype, n, (record, n))
            kernel = dtype, runtime.function(_PROGRAM.source, name), block
        blocks = -(-n // _PROGRAM_PER_BLOCK)
        grid = (blocks if 0 < blocks <= L.MAX_GRID_X else L.clamp_blocks(blocks),)
        kernel[1](grid, kernel[2], (record, L.kernel_i64(n)))


def _program_record(ins, outs, code: tuple, scalars, n, scratch=None) -> tuple | None:
    """``(dtype, record, n, scratch)`` of one checked program launch, the record filled
    (None: n is 0, nothing to run). ``scratch``: what an earlier call with this ``code`` and
    ``scalars`` returned (a batch's launches share it: the code tuple, dozens of ints, is
    hashed once per batch, not once per launch)."""
    op = "ewise_program"
    n = int(n)
    if n < 0:
        raise ValueError(f"{op}: expected n >= 0, got {n}")
    if not outs:
        raise ValueError(f"{op}: expected at least one output")
    dtype = outs[0].dtype
    if dtype not in _FLOATS:
        raise DTypeError(f"{op}: expected float32 or float64, got {dtype}")
    arrays = (*ins, *outs)
    # map: the common case checked without a Python step per buffer; the loop names the culprit
    if len(set(map(_DTYPE_OF, arrays))) > 1 or min(map(_SIZE_OF, arrays)) < n:
        for arr in arrays:
            if arr.dtype != dtype or arr.size < n:
                raise ValueError(f"{op}: every input and output must be {dtype} with at least "
                                 f"{n} elements, got {arr.dtype} with {arr.size}")
    if scratch is None or scratch[4] != len(ins) or scratch[5] != len(outs):
        scratch = _program_scratch(code, len(ins), len(outs), len(scalars))  # checks
    record, words, floats, in_place_ok = scratch[:4]
    in_ptrs = list(map(_PTR_OF, ins))  # map: no Python frame per buffer
    out_ptrs = list(map(_PTR_OF, outs))
    # which input (if any) each output shares its buffer with, in C (no Python step per
    # buffer): a pattern accepted before needs no check (an input given twice: every time)
    # (zip's strict=True, a keyword, takes its slow constructor: +0.2 us; equal lengths here)
    where = dict(zip(in_ptrs, range(len(in_ptrs))))  # noqa: B905
    aliases = tuple(map(where.get, out_ptrs))
    if aliases not in in_place_ok or len(where) < len(in_ptrs):
        _check_aliases(code, in_ptrs, out_ptrs, aliases, in_place_ok)
    if len(out_ptrs) > 1 and len(set(out_ptrs)) < len(out_ptrs):
        raise ValueError(f"{op}: two outputs share a buffer")
    if n == 0:
        return None
    # pointers and scalars into the record's first 64 eight-byte words (ins, outs, scalars);
    # the same slots every time for this key, so nothing of an earlier launch stays behind
    words[:len(ins)] = in_ptrs
    words[16:16 + len(outs)] = out_ptrs
    floats[32:32 + len(scalars)] = scalars
    return dtype, record, n, scratch


def _check_aliases(code: tuple, in_ptrs: list, out_ptrs: list, aliases: tuple,
                   in_place_ok: set) -> None:
    """An output may share its buffer with an input only where every read of that input
    comes first (a pure function of the program: checked once per program and pattern, as
    the template is). ``aliases``: the input each
    output shares with (None: none); ``in_place_ok`` holds the patterns accepted. (The
    caller checks that no two outputs share a buffer.)"""
    for j, ptr in enumerate(out_ptrs):
        for i, in_ptr in enumerate(in_ptrs):
            if in_ptr == ptr:
                check_in_place(code, i, j)
    if len(set(in_ptrs)) == len(in_ptrs):
        in_place_ok.add(aliases)


def _program_scratch(code: tuple, n_in: int, n_out: int, n_scalars: int) -> tuple:
    """This thread's ``(record, words, floats, in_place_ok, n_in, n_out)`` for a validated
    program (see :func:`_program_template`): the record to refill per launch, its 8-byte
    word views, and the patterns of outputs sharing inputs' buffers accepted (see
    :func:`_check_aliases`)."""
    key = (code, n_in, n_out, n_scalars, threading.get_ident())
    scratch = _SCRATCH.get(key)
    if scratch is None:
        record = _program_template(code, n_in, n_out, n_scalars).copy()
        if len(_SCRATCH) >= MAX_SCRATCH_RECORDS:
            _SCRATCH.clear()
        scratch = _SCRATCH[key] = (record, record.view(np.uint64), record.view(np.float64),
                                   set(), n_in, n_out)
    return scratch


_TEMPLATES: dict = {}
# One record per program (and thread) to fill for each launch: copying the template costs
# more than the launch (~3 µs, a structured NumPy copy). Refilling it is safe: a launch copies
# its arguments when it is queued (or captured), and a thread fills only its own. Bounded.
MAX_SCRATCH_RECORDS = 1024
_SCRATCH: dict = {}
_PTR_OF = operator.attrgetter("_ptr")
_DTYPE_OF = operator.attrgetter("dtype")
_SIZE_OF = operator.attrgetter("size")


def _program_template(code: tuple, n_in: int, n_out: int, n_scalars: int) -> np.ndarray:
    """The record of a validated program with its instructions filled in, cached: a compiled
    step or an optimizer runs the same few programs on every call."""
    key = (code, n_in, n_out, n_scalars)
    record = _TEMPLATES.get(key)
    if record is not None:
        return record
    if not all(type(c) is int for c in code):
        raise ValueError(f"ewise_program: instructions must be ints, got {code}")
    check_program(code, n_in, n_out, n_scalars)
    sizes = {"inputs": n_in, "outputs": n_out, "scalars": n_scalars,
             "instructions": len(code) // 5}
    for what, count in sizes.items():
        if count > PROGRAM_LIMITS[what]:
            raise ValueError(f"ewise_program: too many {what} for the CUDA kernel, expected at "
                             f"most {PROGRAM_LIMITS[what]}, got {count}")
    record = np.zeros(1, dtype=_PROGRAM_RECORD)
    record["code"][0, :len(code)] = code
    record["n_code"] = len(code) // 5
    if len(_TEMPLATES) >= 4096:  # bounded: programs built on the fly would grow it forever
        _TEMPLATES.clear()
    _TEMPLATES[key] = record
    return record


# ---- batch normalisation (cuda_kernels/batch_norm.cu) ----------------------------------------
# x viewed as (n, c, s); per-channel statistics by one block per channel (double sums in a
# fixed order), then an elementwise pass: two launches forward, two backward.
_BN_STATS = L.KernelSpec(_BN, "batch_norm_stats", ("a",) * 4 + ("i64",) * 3 + ("scalar",),
                         grid="rows", dtypes=_FLOATS)
_BN_APPLY = L.KernelSpec(_BN, "batch_norm_apply", ("a",) * 6 + ("i64",) * 4, grid="indexed",
                         dtypes=_FLOATS)
_BN_GRAD_STATS = L.KernelSpec(_BN, "batch_norm_grad_stats", ("a",) * 7 + ("i64",) * 4,
                              grid="rows", dtypes=_FLOATS)
_BN_GRAD_INPUT = L.KernelSpec(_BN, "batch_norm_grad_input", ("a",) * 9 + ("i64",) * 4,
                              grid="indexed", dtypes=_FLOATS)
# ops.batch_norm(..., relu=True) passes relu= / relu_out= to the two entry points below
batch_norm_fuses_relu = True


def _bn_sizes(op: str, n, c, s) -> tuple:
    n, c, s = int(n), int(c), int(s)
    if min(n, c, s) < 0:
        raise ShapeError(f"{op}: expected sizes n, c, s >= 0, got n={n}, c={c}, s={s}")
    return n, c, s


def batch_norm_forward(x: Array, w: Array, b: Array, y: Array, mean: Array, var: Array,
                       invstd: Array, n, c, s, eps, relu: bool = False) -> None:
    """Training-mode batch norm of ``x`` viewed as (n, c, s): per-channel ``mean``, biased
    ``var``, ``invstd = 1/sqrt(var + eps)`` and ``y = w (x - mean) invstd + b``; with
    ``relu``, ``max(y, 0)`` (rounded as ``scalar_maximum``)."""
    op = "batch_norm_forward"
    n, c, s = _bn_sizes(op, n, c, s)
    if not float(eps) >= 0:
        raise ValueError(f"{op}: expected eps >= 0, got {eps}")
    total = n * c * s
    _fused_checks(op, y, {"x": (x, total), "w": (w, c), "b": (b, c), "y": (y, total),
                          "mean": (mean, c), "var": (var, c), "invstd": (invstd, c)},
                  (x, w, b))
    _same_dtype(op, y, x, w, b, mean, var, invstd)
    if total == 0:
        return
    runtime.launch(_BN_STATS, y.dtype, c, x, mean, var, invstd, n, c, s, eps)
    runtime.launch(_BN_APPLY, y.dtype, total, x, w, b, mean, invstd, y, n, c, s,
                   1 if relu else 0)


def batch_norm_backward(dy: Array, x: Array, w: Array, mean: Array, invstd: Array, dx: Array,
                        dw: Array, db: Array, n, c, s, relu_out: Array | None = None) -> None:
    """``db = sum dy``, ``dw = sum dy xhat`` per channel and ``dx = w invstd (dy - db/m -
    xhat dw/m)`` (``m = n s``) from the statistics the forward pass saved. ``relu_out``: the
    output of a forward with ``relu``; ``dy`` is masked by it first (as ``ewise_relu_grad``)."""
    op = "batch_norm_backward"
    n, c, s = _bn_sizes(op, n, c, s)
    total = n * c * s
    arrays = {"dy": (dy, total), "x": (x, total), "w": (w, c), "mean": (mean, c),
              "invstd": (invstd, c), "dx": (dx, total), "dw": (dw, c), "db": (db, c)}
    inputs = (dy, x, w, mean, invstd)
    if relu_out is not None:
        arrays["relu_out"] = (relu_out, total)
        inputs += (relu_out,)
    _fused_checks(op, dx, arrays, inputs)
    _same_dtype(op, dx, *inputs, dw, db)
    if total == 0:
        return
    relu, r = (0, dy) if relu_out is None else (1, relu_out)
    runtime.launch(_BN_GRAD_STATS, dx.dtype, c, dy, x, mean, invstd, r, dw, db, n, c, s, relu)
    runtime.launch(_BN_GRAD_INPUT, dx.dtype, total, dy, x, w, mean, invstd, dw, db, r, dx, n,
                   c, s, relu)


def _same_dtype(op: str, out: Array, *inputs: Array) -> None:
    for a in inputs:
        if a.dtype != out.dtype:
            raise DTypeError(f"{op}: dtypes differ, expected {out.dtype}, got {a.dtype}")


# ---- threads -----------------------------------------------------------------------------
def set_num_threads(n: int) -> None:
    """Thread counts are the launcher's business on a GPU (256 per block): a no-op."""


def get_num_threads() -> int:
    return 1
