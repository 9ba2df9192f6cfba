"""The typed kernel launcher of the CUDA backend, as pure Python (no CuPy needed).

Everything that decides *how* a kernel is called lives here, so it is tested on machines
without a GPU: which instantiation to pick for a dtype (:func:`kernel_name`), the exact element
type a scalar is cast to (:func:`scalar_arg`: a bare Python float would reach the kernel as an
8-byte double, wrong for a ``float`` or ``__half`` parameter), the grid for every kind of kernel
(:func:`launch_config`), the packed strided view (:func:`pack_view`), the reduction plans
(:func:`plan_reduce`, :func:`plan_reduce_leading`), and the argument checks
(:func:`prepare`). The CuPy side (``runtime.py``) only compiles, caches and calls.

Example:
    >>> from needle.backend_ndarray._cuda import launch as L
    >>> L.kernel_name("ewise_add", "float16"), L.launch_config("elementwise", 1000)
    ('ewise_add_f16', ((4,), (256,)))
    >>> type(L.scalar_arg(0.1, "float32")).__name__
    'float32'
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..._core.dtypes import numpy_dtype
from ..._core.errors import DTypeError, ShapeError, SizeLimitError
from ..ndarray_limits import MAX_BUFFER_BYTES, check_view

THREADS_PER_BLOCK = 256
MAX_DIMS = 8
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535
# Elements per thread of the "packed" kernels (NEEDLE_PACK in cuda_kernels/elementwise.cu).
PACK = 4
# Rows of at most this many elements are reduced by one thread each (reduce_small_*).
SMALL_REDUCE = 32
# Rows of at most this many elements are reduced by one warp each (reduce_warp_*).
WARP_REDUCE = 1024
WARPS_PER_BLOCK = THREADS_PER_BLOCK // 32
# Each block of a split reduction gets at least this many elements.
MIN_CHUNK = THREADS_PER_BLOCK * 16
# Split reductions aim at this many blocks per SM: 1,024 threads, each with four 16-byte
# loads in flight, cover the memory latency of an H100/H200.
BLOCKS_PER_SM = 4
# Column reductions of at most this many rows add every column in row order (one thread per
# column group); of at least SPLIT_LEADING elements they may take a second pass over a
# workspace; each row lane of a chunk walks at least MIN_LEADING_ROWS rows.
ORDERED_ROWS = 256
SPLIT_LEADING = 1 << 20
MIN_LEADING_ROWS = 16

SUFFIX = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}
# The type kernels compute in; reduction workspaces hold it.
ACC_DTYPE = {"float32": "float32", "float64": "float64", "float16": "float32",
             "bfloat16": "float32"}
# (BM, BN) of matmul_<suffix> in cuda_kernels/matmul.cu.
MATMUL_TILES = {"float32": (128, 128), "float16": (128, 128), "bfloat16": (128, 128),
                "float64": (64, 64)}

# Host image of `struct StridedView` in cuda_kernels/common.cuh: 19 int64, no padding.
VIEW_DTYPE = np.dtype([("size", "<i8"), ("offset", "<i8"), ("ndim", "<i8"),
                       ("shape", "<i8", (MAX_DIMS,)), ("strides", "<i8", (MAX_DIMS,))])
assert VIEW_DTYPE.itemsize == 19 * 8


@dataclass(frozen=True)
class KernelSpec:
    """A kernel family: its source file, base name, parameter kinds and grid kind.

    Parameter kinds: ``"a"`` array of the kernel dtype, ``"acc"`` array of its compute dtype,
    ``"src"`` array of any dtype (the name gains the source suffix: casts), ``"scalar"``
    (cast to the kernel dtype), ``"i64"`` (int64), ``"view"`` (a ``(shape, strides, offset)``
    triple packed as a StridedView), ``"record"`` (a one-element structured NumPy array, passed
    by value: a kernel's argument struct). ``view_of`` is the position of the array the view
    addresses: :func:`prepare` checks that the view lies inside it and that the other arrays
    hold the view's element count. ``dtypes``: the dtypes the source instantiates the kernel
    for (all four unless said).
    """

    source: str
    base: str
    params: tuple
    grid: str = "elementwise"
    view_of: int | None = None
    dtypes: tuple = ("float32", "float64", "float16", "bfloat16")
    # (dtype, src_dtype) -> what prepare() works out once per instantiation (_launch_plan).
    # Kept on the spec: a dict keyed by the spec would hash all its fields on every launch.
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)


def kernel_name(base: str, dtype: str, src_dtype: str | None = None) -> str:
    """The extern "C" name of ``base`` for ``dtype`` (casts: ``ewise_cast_<src>_<dst>``)."""
    if dtype not in SUFFIX:
        raise DTypeError(f"cuda kernel {base}: unsupported dtype, expected one of "
                         f"{tuple(SUFFIX)}, got {dtype!r}")
    if src_dtype is not None:
        return f"{base}_{SUFFIX[src_dtype]}_{SUFFIX[dtype]}"
    return f"{base}_{SUFFIX[dtype]}"


def scalar_arg(value, dtype: str) -> np.generic:
    """``value`` as the kernel's exact element type (np.float32 / np.float64 / np.float16; a
    bfloat16 as its two bytes, np.uint16, rounded to nearest even: CuPy passes no ml_dtypes
    scalar)."""
    return _scalar_type(dtype)(value)


def _bfloat16_bits(value) -> np.uint16:
    return np.asarray(value, dtype=numpy_dtype("bfloat16")).view(np.uint16)[()]


def _scalar_type(dtype: str):
    return _bfloat16_bits if dtype == "bfloat16" else np.dtype(dtype).type


def grid_1d(n: int, threads: int = THREADS_PER_BLOCK) -> int:
    """Blocks for ``n`` work items, one per thread; capped (kernels loop grid-stride)."""
    return max(1, min(-(-int(n) // threads), MAX_GRID_X))


def launch_config(kind: str, work, dtype: str = "float32") -> tuple:
    """``(grid, block)`` for a kernel kind: the one place grids are computed.

    Kinds: ``"elementwise"`` (``work`` = element count; buffers are size-checked against
    it), ``"packed"`` (the same for the kernels of elementwise.cu, which move :data:`PACK`
    elements per thread: a grid for ``work / PACK`` threads), ``"indexed"`` (the
    elementwise grid for kernels that index their inputs themselves: strided views, which
    may broadcast a small buffer, and the tiled layout), ``"rows"``
    (``work`` = number of blocks: one per row or per (row, chunk)), ``"matmul"``
    (``work`` = ``(m, p)``; tiles of :data:`MATMUL_TILES` for ``dtype``).

    Raises:
        ShapeError: when the output needs more tile rows than a grid can hold.
    """
    block = (THREADS_PER_BLOCK,)
    if kind in ("elementwise", "indexed"):
        return (grid_1d(work),), block
    if kind == "packed":
        return (grid_1d(-(-int(work) // PACK)),), block
    if kind == "rows":
        return (max(1, min(int(work), MAX_GRID_X)),), block
    if kind == "matmul":
        m, p = work
        bm, bn = MATMUL_TILES[dtype]
        rows = -(-int(m) // bm)
        if rows > MAX_GRID_Y:
            raise ShapeError(f"matmul: too many rows for the tiled kernel, expected "
                             f"m <= {MAX_GRID_Y * bm}, got {m}")
        return (max(1, -(-int(p) // bn)), max(1, rows)), block
    raise ValueError(f"launch_config: unknown kernel kind {kind!r}")


def merge_dims(shape, strides) -> tuple:
    """Drop size-1 dims and merge neighbours that are contiguous with each other.

    The merged view addresses the same elements in the same order, with fewer dims: cheaper
    index arithmetic, and views of more than 8 dims usually fit the kernels' limit.
    """
    dims = [(int(n), int(s)) for n, s in zip(shape, strides, strict=True) if int(n) != 1]
    merged: list[list[int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == s * n:
            merged[-1][0] *= n
            merged[-1][1] = s
        else:
            merged.append([n, s])
    return tuple(n for n, _ in merged), tuple(s for _, s in merged)


def pack_view(shape, strides, offset, op: str = "strided") -> np.ndarray:
    """A one-element StridedView array (CuPy passes size-1 NumPy arrays by value).

    Raises:
        ShapeError: if the view still has more than :data:`MAX_DIMS` dims after merging.
    """
    size = math.prod(int(n) for n in shape)
    mshape, mstrides = merge_dims(shape, strides)
    if len(mshape) > MAX_DIMS:
        raise ShapeError(f"{op}: too many dimensions for the CUDA kernels, expected at most "
                         f"{MAX_DIMS} after merging, got shape {tuple(shape)} strides "
                         f"{tuple(strides)}")
    view = np.zeros(1, dtype=VIEW_DTYPE)
    view["size"], view["offset"], view["ndim"] = size, int(offset), len(mshape)
    view["shape"][0, :len(mshape)] = mshape
    view["strides"][0, :len(mshape)] = mstrides
    return view


@dataclass(frozen=True)
class ReducePlan:
    """How to reduce ``rows`` rows of ``reduce_size``: kernel kind and chunks per row.

    ``blocks``: the first launch's grid (the work it spreads over the GPU); ``launches``: 2
    when a second pass combines the chunks' partials.
    """

    kind: str  # "small" | "warp" | "block" | "split"
    chunks: int = 1
    blocks: int = 1

    @property
    def launches(self) -> int:
        return 2 if self.kind == "split" else 1


def plan_reduce(rows: int, reduce_size: int, num_sms: int) -> ReducePlan:
    """Pick the row-reduction kernels (see cuda_kernels/reduce.cu).

    Short rows: one thread per row. Rows up to :data:`WARP_REDUCE`: one warp per row. Enough
    long rows to fill the GPU: one block per row. Few long rows: split each row into chunks
    so that about :data:`BLOCKS_PER_SM` blocks per SM are busy, then reduce the chunks'
    partials (two launches).
    """
    rows, reduce_size = int(rows), int(reduce_size)
    if reduce_size <= SMALL_REDUCE:
        return ReducePlan("small", 1, grid_1d(rows))
    if reduce_size <= WARP_REDUCE:
        return ReducePlan("warp", 1, -(-rows // WARPS_PER_BLOCK))
    target_blocks = BLOCKS_PER_SM * max(1, num_sms)
    if rows >= target_blocks:
        return ReducePlan("block", 1, rows)
    chunks = min(-(-target_blocks // rows), -(-reduce_size // MIN_CHUNK))
    if chunks > 1:
        return ReducePlan("split", chunks, rows * chunks)
    return ReducePlan("block", 1, rows)


@dataclass(frozen=True)
class LeadingPlan:
    """How to reduce an (m, n) array over its rows (see cuda_kernels/reduce.cu).

    ``width`` elements per load, ``lanes`` threads per row (the block's other threads walk
    other rows), ``chunks`` row ranges on different blocks, ``col_blocks`` blocks across the
    columns of one range. ``ordered``: every column is added row by row in order (what the
    NumPy and C++ backends do).
    """

    width: int
    lanes: int
    chunks: int
    col_blocks: int

    @property
    def blocks(self) -> int:
        return self.chunks * self.col_blocks

    @property
    def launches(self) -> int:
        return 2 if self.chunks > 1 else 1

    @property
    def ordered(self) -> bool:
        return self.lanes == THREADS_PER_BLOCK and self.chunks == 1


def _load_width(n: int, itemsize: int, address: int) -> int:
    """The widest load (elements, at most 16 bytes) that every row start of an (m, n) array
    at ``address`` is aligned to."""
    width = max(1, 16 // itemsize)
    while width > 1 and (n % width or address % (width * itemsize)):
        width //= 2
    return width


def plan_reduce_leading(m: int, n: int, itemsize: int, address: int, num_sms: int,
                        split: bool = True) -> LeadingPlan:
    """Pick the column-reduction launch for an (m, n) array of ``itemsize``-byte elements at
    device ``address``.

    Up to :data:`ORDERED_ROWS` rows (a batch's bias gradient), or with ``split=False``: one
    thread per ``width`` columns adds its rows in order, bitwise the other backends. More
    rows: a block's threads share the columns (``lanes``, a power of two) and walk different
    rows, so a few columns still fill a block; and when the array holds at least
    :data:`SPLIT_LEADING` elements and too few blocks would run, the rows are cut into
    ``chunks`` so that about :data:`BLOCKS_PER_SM` blocks per SM are busy (two launches).
    """
    m, n = int(m), int(n)
    width = _load_width(n, itemsize, int(address))
    groups = max(1, n // width)
    if not split or m <= ORDERED_ROWS:
        return LeadingPlan(width, THREADS_PER_BLOCK, 1, -(-groups // THREADS_PER_BLOCK))
    lanes = min(THREADS_PER_BLOCK, 1 << (groups - 1).bit_length())
    col_blocks = -(-groups // lanes)
    row_lanes = THREADS_PER_BLOCK // lanes
    chunks = 1
    if m * n >= SPLIT_LEADING:
        target_blocks = BLOCKS_PER_SM * max(1, num_sms)
        chunks = max(1, min(-(-target_blocks // col_blocks),
                            m // (row_lanes * MIN_LEADING_ROWS)))
    return LeadingPlan(width, lanes, chunks, col_blocks)


def _expected_dtype(kind: str, dtype: str) -> str | None:
    if kind == "a":
        return dtype
    return ACC_DTYPE[dtype] if kind == "acc" else None


def prepare(spec: KernelSpec, dtype: str, work, args, src_dtype: str | None = None):
    """Check and convert the arguments of one launch: ``(name, grid, block, kernel_args)``.

    Array arguments must be backend buffers (flat and contiguous by construction: they expose
    ``ptr()``, ``dtype`` and ``size``; the fast path reads the address from ``_ptr``, which
    must equal ``ptr()`` where present) of the expected dtype; for elementwise kernels each must
    hold at least ``work`` elements. What depends only on ``(spec, dtype, src_dtype)`` is
    worked out on the first launch and kept (the host cost of a launch is most of a
    small-kernel GPU step); the arguments are checked on every launch.

    Raises:
        DTypeError: an array of the wrong dtype or a non-buffer where an array is expected.
        ShapeError: an array too small for the launch.
    """
    if len(args) != len(spec.params):
        raise TypeError(f"{spec.base}: expected {len(spec.params)} arguments, got {len(args)}")
    plan = spec._plans.get((dtype, src_dtype))
    if plan is None:
        plan = _launch_plan(spec, dtype, src_dtype)
    name, params, scalar_type, per_block, fast = plan
    if fast is not None:
        try:
            kernel_args = fast(args, work)
        except Exception:  # noqa: BLE001 - the checks below raise the exact error
            kernel_args = None
        if kernel_args is not None:
            if per_block and work.__class__ is int:
                # launch_config's 1-D grid, written out (max/min cost ~1,000 instructions each)
                blocks = -(-work // per_block)
                return name, (blocks if 0 < blocks <= MAX_GRID_X else clamp_blocks(blocks),), \
                    _BLOCK, kernel_args
            return (name, *launch_config(spec.grid, work, dtype), kernel_args)
    return _prepare_checked(spec, dtype, work, args, plan)


def _prepare_checked(spec: KernelSpec, dtype: str, work, args, plan: tuple) -> tuple:
    # every check one by one, each with its own message: launches the fast converter of
    # the plan refused (or has none: views), and so every bad argument
    name, params, scalar_type, per_block, _ = plan
    view = None if spec.view_of is None else _checked_view(spec, args, work)
    kernel_args = []
    for (kind, expected, sized), arg in zip(params, args):  # noqa: B905 - lengths checked
        if kind in _POINTER_KINDS:
            try:
                ptr, have, size = arg.ptr(), arg.dtype, arg.size
            except (AttributeError, TypeError):
                raise DTypeError(f"{spec.base}: expected a contiguous CUDA buffer (Array), "
                                 f"got {type(arg).__name__}") from None
            if have != expected and expected is not None:
                raise DTypeError(f"{spec.base}: wrong buffer dtype, expected {expected}, "
                                 f"got {have}")
            if sized and size < work:
                raise ShapeError(f"{spec.base}: buffer too small, expected at least {work} "
                                 f"elements, got {size}")
            kernel_args.append(kernel_u64(ptr))
        elif kind == "scalar":
            kernel_args.append(scalar_type(arg))
        elif kind == "i64":
            kernel_args.append(kernel_i64(arg))
        elif kind == "view":
            kernel_args.append(view)
        elif kind == "record":  # a one-element structured array, passed by value
            if not (isinstance(arg, np.ndarray) and arg.shape == (1,) and arg.dtype.names):
                raise TypeError(f"{spec.base}: expected a one-element structured array, got "
                                f"{type(arg).__name__}")
            kernel_args.append(arg)
        else:
            raise ValueError(f"{spec.base}: unknown parameter kind {kind!r}")
    if per_block and work.__class__ is int:  # launch_config's 1-D grids, written out
        return name, (clamp_blocks(-(-work // per_block)),), _BLOCK, tuple(kernel_args)
    grid, block = launch_config(spec.grid, work, dtype)
    return name, grid, block, tuple(kernel_args)


_POINTER_KINDS = frozenset(("a", "acc", "src"))
_BLOCK = (THREADS_PER_BLOCK,)
# Work items per block of the 1-D grid kinds (see launch_config).
_PER_BLOCK = {"elementwise": THREADS_PER_BLOCK, "indexed": THREADS_PER_BLOCK,
              "packed": THREADS_PER_BLOCK * PACK}


def clamp_blocks(blocks: int) -> int:
    """A 1-D grid's block count within CUDA's limits: at least 1, at most ``MAX_GRID_X``."""
    return blocks if 0 < blocks <= MAX_GRID_X else (MAX_GRID_X if blocks > 0 else 1)


# The NumPy scalars of kernel arguments, kept by value: making one (``np.uint64(ptr)``,
# ``np.int64(n)``) goes through NumPy's array conversion, ~2,000 instructions, and an eager
# step passes the same few hundred addresses and sizes every step (a parked buffer comes back
# at its address). NumPy scalars are immutable, so one may serve every launch. Bounded.
MAX_KEPT_SCALARS = 1 << 16
_U64: dict = {}
_I64: dict = {}


def kernel_u64(value: int) -> np.uint64:
    """``np.uint64(value)``, kept (see ``_U64``): a buffer address as a kernel argument."""
    scalar = _U64.get(value)
    if scalar is None:
        if len(_U64) >= MAX_KEPT_SCALARS:
            _U64.clear()
        scalar = _U64[value] = np.uint64(value)
    return scalar


def kernel_i64(value) -> np.int64:
    """``np.int64(value)``, kept (see ``_U64``): a size or count as a kernel argument."""
    scalar = _I64.get(value)
    if scalar is None or value.__class__ is not int:
        scalar = np.int64(value)
        if value.__class__ is int:  # 3.0 == 3 and True == 1: only ints are keys
            if len(_I64) >= MAX_KEPT_SCALARS:
                _I64.clear()
            _I64[value] = scalar
    return scalar


def _launch_plan(spec: KernelSpec, dtype: str, src_dtype: str | None) -> tuple:
    """``(kernel name, ((kind, expected dtype, size-checked), ...), the scalar type, work
    items per block of a 1-D grid or None)``, kept in ``spec._plans``."""
    if dtype not in spec.dtypes:
        raise DTypeError(f"cuda kernel {spec.base}: unsupported dtype, expected one of "
                         f"{spec.dtypes}, got {dtype!r}")
    # elementwise kernels read as many elements of each input and output as they write
    sized = spec.grid in ("elementwise", "packed")
    params = tuple((kind, _expected_dtype(kind, dtype), sized and kind in ("a", "src"))
                   for kind in spec.params)
    scalar_type = _scalar_type(dtype)
    plan = (kernel_name(spec.base, dtype, src_dtype), params, scalar_type,
            _PER_BLOCK.get(spec.grid), _fast_converter(spec, params, scalar_type))
    spec._plans[(dtype, src_dtype)] = plan
    return plan


# Parameter kinds a fast converter handles (views take the checked path).
_FAST_KINDS = frozenset(("a", "acc", "src", "scalar", "i64", "record"))


def _fast_converter(spec: KernelSpec, params: tuple, scalar_type):
    """``convert(args, work)``: the kernel arguments, or None when a check fails, as one
    generated expression for this spec and dtype (the loop of :func:`_prepare_checked` costs
    ~30 bytecodes an argument on every launch). It checks what that loop checks, so a None
    (or an exception) only sends the launch there for the error message."""
    if (spec.view_of is not None or not params
            or any(kind not in _FAST_KINDS for kind, _, _ in params)):
        return None
    names = [f"a{i}" for i in range(len(params))]
    checks, values = [], []
    for name, (kind, expected, sized) in zip(names, params):  # noqa: B905 - same length
        if kind == "scalar":
            values.append(f"scalar({name})")
        elif kind == "i64":
            # kept scalars (see _U64): a dict read, and a call only for a new int
            values.append(f"(i64s.get({name}) if {name}.__class__ is int else None) "
                          f"or i64({name})")
        elif kind == "record":
            checks.append(f"isinstance({name}, ndarray) and {name}.shape == (1,) "
                          f"and {name}.dtype.names")
            values.append(name)
        else:
            if expected is not None:
                checks.append(f"{name}.dtype == {expected!r}")
            if sized:
                checks.append(f"{name}.size >= work")
            # the address from the ``_ptr`` field the backend's Array keeps (what its ptr()
            # returns) without a Python call; a buffer without one fails here and takes the
            # checked path, which calls ptr()
            values.append(f"(u64s.get(p{name} := {name}._ptr) or u64(p{name}))")
    unpack = ", ".join(names) + ("," if len(names) == 1 else "")
    source = (f"def convert(args, work):\n"
              f"    {unpack} = args\n"
              f"    if {' and '.join(checks) or 'True'}:\n"
              f"        return ({', '.join(values)},)\n"
              f"    return None\n")
    scope = {"u64": kernel_u64, "i64": kernel_i64, "u64s": _U64, "i64s": _I64,
             "scalar": scalar_type, "ndarray": np.ndarray}
    exec(compile(source, f"<cuda launch {spec.base}>", "exec"), scope)  # noqa: S102
    return scope["convert"]


def check_buffer_bytes(op: str, size: int, itemsize: int) -> int:
    """``size`` elements of ``itemsize`` bytes as a byte count within the buffer limit.

    Raises:
        ShapeError: a negative size. SizeLimitError: more than 2**62 bytes.
    """
    size = int(size)
    if size < 0:
        raise ShapeError(f"{op}: size must be >= 0, got {size}")
    if size * itemsize > MAX_BUFFER_BYTES:
        raise SizeLimitError(f"{op}: buffer too large, expected at most {MAX_BUFFER_BYTES} "
                             f"bytes (2**62), got {size} elements = {size * itemsize} bytes")
    return size * itemsize


def check_extent(op: str, what: str, arg, need: int) -> None:
    """Raise :class:`ShapeError` unless buffer ``arg`` holds at least ``need`` elements."""
    if arg.size < need:
        raise ShapeError(f"{op}: {what} too small, expected at least {need} elements, "
                         f"got {arg.size}")


# Packed views of launches that passed _view_record's checks, by (kernel, view, size of the
# viewed buffer, launch size): everything those checks read. A model copies the same few
# layouts every step, and checking and packing one costs ~40 Python frames. The records are
# only read (CuPy copies a by-value argument at the launch). Bounded.
MAX_KEPT_VIEWS = 4096
_KEPT_VIEWS: dict = {}


def _checked_view(spec: KernelSpec, args, work) -> np.ndarray:
    """The packed view argument of a launch of ``spec``, checked (see _view_record); the
    compact buffers must hold the view's elements."""
    shape, strides, offset = args[spec.params.index("view")]
    key = (spec.base, shape, strides, offset, args[spec.view_of].size, work)
    try:
        record = _KEPT_VIEWS.get(key)
    except TypeError:  # unhashable parts (lists): checked and packed every time
        key = record = None
    if record is None:
        record = _view_record(spec, (shape, strides, offset), args[spec.view_of].size, work)
        if key is not None:
            if len(_KEPT_VIEWS) >= MAX_KEPT_VIEWS:
                _KEPT_VIEWS.clear()
            _KEPT_VIEWS[key] = record
    for i, kind in enumerate(spec.params):  # the launch covers exactly the view's elements
        if kind == "a" and i != spec.view_of:
            check_extent(spec.base, "compact buffer", args[i], work)
    return record


def _view_record(spec: KernelSpec, view, size: int, work) -> np.ndarray:
    # The view must address only elements of its own buffer (of ``size`` elements), and the
    # launch must cover exactly those elements.
    shape, strides, offset = view
    shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)
    if len(shape) != len(strides) or any(n < 0 for n in shape):
        raise ShapeError(f"{spec.base}: bad view, expected equal-length shape and strides "
                         f"with dims >= 0, got {shape} and {strides}")
    count = check_view(spec.base, shape, strides, int(offset), size)
    if count != work:
        raise ShapeError(f"{spec.base}: launch size differs from the view, expected {count}, "
                         f"got {work}")
    return pack_view(shape, strides, offset, op=spec.base)
