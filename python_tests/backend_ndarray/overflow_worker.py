"""Hypothesis properties over huge shapes, strides and offsets, run in a child process.

Usage: ``python overflow_worker.py [--examples N] DEVICE [PROPERTY ...]`` with DEVICE one of
``cpu``, ``cpu_numpy``, ``cuda`` (a real GPU), ``cuda_emulated`` (the CUDA backend's kernels
compiled for the host by _cuda_emulator.py). test_overflow_safety.py starts it once per
device, so that a segfault or an abort fails a test instead of ending the test run. Before each
example the worker writes ``CASE <property> <arguments>`` to stderr, so a crash names the case
that caused it; at the end it prints one ``RESULT <json>`` line: per property, how its examples
ended and, if it failed, the falsifying example and traceback.

Every property compares needle with the independent model of overflow_model.py. The NDArray
properties go through the public API, which checks first; the ``backend_*`` properties call the
device's backend module directly, so they test the checks of the backends' own entry points
(C++, CUDA launcher, NumPy reference): the second line of defence.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from overflow_model import (
    INT64_MAX,
    LIMIT,
    REFUSED_BYTES,
    SMALL,
    IndexOutOfRange,
    ShapeError,
    SizeLimitError,
    alloc_errors,
    check_outcome,
    corner_index,
    dims,
    dtypes,
    element_offsets,
    gather,
    offsets,
    shapes,
    strides_values,
    view_errors,
    views,
)

import needle.backend_ndarray as nd

# Reproducible runs, no example database on disk, no timing limits (emulated CUDA is slow).
settings.register_profile("overflow", deadline=None, database=None, derandomize=True,
                          print_blob=False, suppress_health_check=list(HealthCheck))
settings.load_profile("overflow")

TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3}
COUNTS: Counter = Counter()
PROPERTIES = {}


def prop(fn):
    PROPERTIES[fn.__name__.removeprefix("prop_")] = fn
    return fn


def log(name: str, **case) -> None:
    sys.stderr.write(f"CASE {name} {case!r}\n")
    sys.stderr.flush()


def values(n: int, dtype) -> np.ndarray:
    """Small values (-3..3) whose sums stay exact enough in float16."""
    return ((np.arange(n) % 7) - 3).astype(dtype)


def close(got: np.ndarray, want: np.ndarray, dtype, scale: int = 1) -> None:
    tol = TOLERANCE[dtype] * max(1, scale)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                               atol=tol)


def cut(shape, index) -> tuple:
    """The shape that ``corner_index`` leaves (``index`` None: the whole shape)."""
    return shape if index is None else tuple(min(n, 2) for n in shape)


def read_back(view, reference) -> None:
    """Compare a valid view (whole when small, else its corner) with ``reference(index)``."""
    if math.prod(view.shape) == 0:
        # NumPy itself cannot hold some empty shapes, e.g. (0, 2**61) of float32.
        label, got = check_outcome(view.numpy, {SizeLimitError}, success_ok=True)
        assert got is None or (got.shape == view.shape and got.dtype == view.dtype)
        return
    index = None if math.prod(view.shape) <= SMALL else corner_index(view.shape)
    got = view.numpy() if index is None else view[index].numpy()
    np.testing.assert_array_equal(got, reference(index))


def itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


# ---- NDArray (public API) properties -------------------------------------------------------
@prop
def prop_make(dev, examples):
    ctors = st.sampled_from(["make", "empty", "zeros", "full"])
    maybe_negative = st.one_of(shapes, shapes, shapes, shapes.map(lambda s: (-1,) + s))

    @settings(max_examples=examples)
    @example(shape=(2**31, 2**31), dtype="float32", ctor="zeros")
    @given(shape=maybe_negative, dtype=dtypes, ctor=ctors)
    def run(shape, dtype, ctor):
        log("make", shape=shape, dtype=dtype, ctor=ctor)
        allowed = ({ShapeError} if any(n < 0 for n in shape)
                   else {SizeLimitError} if any(n > LIMIT for n in shape)
                   else alloc_errors(math.prod(shape), itemsize(dtype)))

        def call():
            if ctor == "make":
                return nd.NDArray.make(shape, device=dev, dtype=dtype)
            if ctor == "empty":
                return nd.empty(shape, dtype=dtype, device=dev)
            if ctor == "zeros":
                return dev.zeros(*shape, dtype=dtype)
            return nd.full(shape, 2.5, dtype=dtype, device=dev)

        label, arr = check_outcome(call, allowed)
        if arr is not None:
            assert arr.shape == shape and arr.dtype == dtype
            if ctor in ("zeros", "full"):
                want = np.full(shape, 0.0 if ctor == "zeros" else 2.5, dtype=dtype)
                np.testing.assert_array_equal(arr.numpy(), want)
        return label

    return run


def base_array(dev, size: int, dtype, start: int):
    """Values, their NDArray, a 1-D slice of it from ``start``, and that slice's offset."""
    buf = values(size, dtype)
    arr = nd.NDArray(buf, device=dev, dtype=dtype)
    start = min(start, size)
    offset = start if start < size else 0  # an empty slice keeps its parent's offset
    return buf, arr, arr[start:], offset


@prop
def prop_as_strided(dev, examples):
    @settings(max_examples=examples)
    @example(size=12, start=0, view=((9,), (2**61,)), dtype="float32")
    @example(size=12, start=0, view=((5,), (2**62,)), dtype="float32")
    @example(size=12, start=0, view=((9, 2), (2**61, 1)), dtype="float32")
    @example(size=12, start=11, view=((2, 3), (-1, 2)), dtype="float32")
    @given(size=st.integers(0, 24), start=st.integers(0, 6), view=views, dtype=dtypes)
    def run(size, start, view, dtype):
        shape, strides = view
        log("as_strided", size=size, start=start, shape=shape, strides=strides, dtype=dtype)
        buf, _, base, offset = base_array(dev, size, dtype, start)
        allowed = view_errors(shape, strides, offset, size)
        label, out = check_outcome(lambda: base.as_strided(shape, strides), allowed)
        if out is not None:
            assert out.shape == shape and out.strides == strides
            read_back(out, lambda i: gather(buf, cut(shape, i), strides, offset))
        return label

    return run


@prop
def prop_make_view(dev, examples):
    @settings(max_examples=examples)
    @example(size=12, view=((9, 2), (2**61, 1)), offset=0, compact=False, dtype="float32")
    @example(size=12, view=((3,), (1,)), offset=2**63 - 1, compact=False, dtype="float32")
    @given(size=st.integers(0, 24), view=views, offset=offsets, compact=st.booleans(),
           dtype=dtypes)
    def run(size, view, offset, compact, dtype):
        shape, strides = view
        if compact:
            strides = compact_strides(shape)
        log("make_view", size=size, shape=shape, strides=strides, offset=offset, dtype=dtype)
        buf = values(size, dtype)
        handle = nd.NDArray(buf, device=dev, dtype=dtype)._handle
        allowed = view_errors(shape, strides, offset, size)

        def call():
            return nd.NDArray.make(shape, strides=None if compact else strides, device=dev,
                                   handle=handle, offset=offset, dtype=dtype)

        label, out = check_outcome(call, allowed)
        if out is not None:
            read_back(out, lambda i: gather(buf, cut(shape, i), strides, offset))
        return label

    return run


def compact_strides(shape) -> tuple:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


@st.composite
def broadcasts(draw):
    """(base shape, target shape): NumPy-compatible, with huge sizes on broadcast dims."""
    base = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    lead = tuple(draw(st.lists(dims, max_size=2)))
    tail = tuple(draw(dims) if b == 1 and draw(st.booleans()) else b for b in base)
    return base, lead + tail


def broadcast_reference(base_vals: np.ndarray, target, index) -> np.ndarray:
    if index is None:
        return np.broadcast_to(base_vals, target)
    piece = base_vals[tuple(slice(0, min(b, 2)) for b in base_vals.shape)]
    return np.broadcast_to(piece, cut(target, index))


def broadcast_view(dev, base, target, dtype):
    base_vals = values(math.prod(base), dtype).reshape(base)
    return base_vals, nd.NDArray(base_vals, device=dev, dtype=dtype).broadcast_to(target)


@prop
def prop_broadcast_to(dev, examples):
    @settings(max_examples=examples)
    @example(shapes_=((1, 1), (2**31, 2**31)), dtype="float32")
    @example(shapes_=((1,), (2**62, 2)), dtype="float32")
    @example(shapes_=((1,), (-1,)), dtype="float32")
    @example(shapes_=((2,), (3,)), dtype="float32")
    @given(shapes_=broadcasts(), dtype=dtypes)
    def run(shapes_, dtype):
        base, target = shapes_
        log("broadcast_to", base=base, target=target, dtype=dtype)
        count = math.prod(target)
        bad = any(t < 0 for t in target) or any(
            b not in (1, t) for b, t in zip(base[::-1], target[::-1], strict=False))
        huge = count > LIMIT or any(t > LIMIT for t in target)
        allowed = {ShapeError} if bad else ({SizeLimitError} if huge else set())
        base_vals = values(math.prod(base), dtype).reshape(base)
        arr = nd.NDArray(base_vals, device=dev, dtype=dtype)
        label, out = check_outcome(lambda: arr.broadcast_to(target), allowed)
        if out is not None:
            assert out.shape == target
            read_back(out, lambda i: broadcast_reference(base_vals, target, i))
        return label

    return run


@st.composite
def reductions(draw):
    base, target = draw(broadcasts())
    ndim = len(target)
    axis = None
    if ndim and draw(st.booleans()):
        axes = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
        axis = axes[0] - ndim if len(axes) == 1 else tuple(axes)
    op = draw(st.sampled_from(["sum", "max", "min"]))
    return base, target, axis, draw(st.booleans()), op


@prop
def prop_reduce(dev, examples):
    @settings(max_examples=examples)
    @example(case=((1, 1), (2**31, 2**31), None, False, "sum"), dtype="float32")
    @example(case=((1,), (0, 2**62), 0, False, "sum"), dtype="float32")
    @example(case=((1,), (0, 3), 0, False, "max"), dtype="float32")
    @given(case=reductions(), dtype=dtypes)
    def run(case, dtype):
        base, target, axis, keepdims, op = case
        assume(math.prod(target) <= LIMIT and max(target, default=0) <= LIMIT)
        log("reduce", base=base, target=target, axis=axis, keepdims=keepdims, op=op,
            dtype=dtype)
        base_vals, view = broadcast_view(dev, base, target, dtype)
        axes = tuple(range(len(target))) if axis is None else (
            (axis % len(target),) if isinstance(axis, int) else axis)
        count = math.prod(target)
        out_count = math.prod(n for a, n in enumerate(target) if a not in axes)
        reduce_size = math.prod(target[a] for a in axes)
        # The view is compacted (count elements) before the output (out_count) is made.
        allowed = alloc_errors(count if count else out_count, itemsize(dtype))
        if not allowed and op != "sum" and reduce_size == 0 and out_count:
            allowed = {ShapeError}
        label, out = check_outcome(
            lambda: getattr(view, op)(axis=axis, keepdims=keepdims), allowed)
        if out is not None:
            if count:
                full = np.broadcast_to(base_vals, target).astype(np.float64)
                ref = np.asarray(getattr(np, op)(full, axis=axes, keepdims=keepdims))
            else:  # an empty sum is 0 (NumPy cannot even form such a broadcast)
                ref = np.zeros(tuple(1 if a in axes else n for a, n in enumerate(target))
                               if keepdims else
                               tuple(n for a, n in enumerate(target) if a not in axes))
            close(out.numpy(), ref, dtype, reduce_size if op == "sum" else 1)
        return label

    return run


@st.composite
def reshapes(draw):
    base, target = draw(broadcasts())
    count = math.prod(target)
    options = [target, target[::-1], (count,), (-1,), (-1, -1), target + (1,), (1,) + target,
               draw(shapes)]
    if target:
        options.append((target[0], -1))
    return base, target, draw(st.sampled_from(options))


def resolve_reshape(count: int, new: tuple):
    """The reshape target with -1 resolved, or None when it cannot hold ``count`` elements."""
    if new.count(-1) > 1 or any(d < -1 for d in new):
        return None
    if -1 in new:
        known = math.prod(d for d in new if d != -1)
        if known == 0 or count % known:
            return None
        new = tuple(count // known if d == -1 else d for d in new)
    return new if math.prod(new) == count else None


@prop
def prop_reshape(dev, examples):
    @settings(max_examples=examples)
    @example(case=((1,), (2**52, 3), (3, 2**52)), dtype="float32")
    @example(case=((1,), (2**62, 1), (2**62,)), dtype="float32")
    @given(case=reshapes(), dtype=dtypes)
    def run(case, dtype):
        base, target, new = case
        assume(math.prod(target) <= LIMIT and max(target, default=0) <= LIMIT)
        log("reshape", base=base, target=target, new=new, dtype=dtype)
        base_vals, view = broadcast_view(dev, base, target, dtype)
        count = math.prod(target)
        resolved = resolve_reshape(count, new)
        if resolved is None:
            allowed = {ShapeError}
        elif max(resolved, default=0) > LIMIT:
            allowed = {SizeLimitError}  # only an empty shape can get here
        elif resolved == target:
            allowed = set()  # no copy: the same view comes back
        else:
            allowed = alloc_errors(count, itemsize(dtype))  # compacted first
        label, out = check_outcome(lambda: view.reshape(new), allowed)
        if out is not None:
            assert out.shape == resolved
            if 0 < count <= SMALL:
                want = np.broadcast_to(base_vals, target).reshape(resolved)
                np.testing.assert_array_equal(out.numpy(), want)
            else:  # empty, or a huge view reshaped to itself (a corner is compared)
                read_back(out, lambda i: broadcast_reference(base_vals, target, i))
        return label

    return run


mm_dims = st.integers(0, 3) | st.integers(1, 3) | st.sampled_from((2**50, 2**52, 2**62, 2**63))


@st.composite
def matmuls(draw):
    m, n, p = draw(mm_dims), draw(mm_dims), draw(mm_dims)
    batch = draw(st.none() | st.none() | dims)
    return m, n, p, batch, draw(st.booleans()), draw(st.booleans())


def operand(dev, rows, cols, dtype, flip: bool, transpose: bool, seed: int):
    """A (rows, cols) view broadcast from a small base, maybe flipped or transposed, and
    that small base (the reference broadcasts it only when the product is small)."""
    r, c = (rows if rows <= 3 else 1), (cols if cols <= 3 else 1)
    base = (values(r * c + seed, dtype)[seed:]).reshape(r, c)
    arr = (nd.NDArray(base.T.copy(), device=dev, dtype=dtype).permute((1, 0)) if transpose
           else nd.NDArray(base, device=dev, dtype=dtype))
    if flip:
        arr, base = arr[::-1, :], base[::-1, :]
    return base, arr.broadcast_to((rows, cols))


@prop
def prop_matmul(dev, examples):
    @settings(max_examples=examples)
    @example(case=(2**61, 2, 4, None, False, False), dtype="float32")
    @example(case=(2**50, 3, 2**50, None, True, True), dtype="float32")
    @example(case=(3, 2, 2, 2**52, False, False), dtype="float32")
    @given(case=matmuls(), dtype=dtypes)
    def run(case, dtype):
        m, n, p, batch, flip, transpose = case
        rows = m * (batch if batch is not None else 1)
        # operands that can exist as views
        assume(max(m * n, rows * n, n * p, batch or 0) <= LIMIT)
        out_bytes = rows * p * itemsize(dtype)
        # A long inner dimension with a small output is valid but 2**50 multiply-adds long.
        assume(n <= 3 or out_bytes >= REFUSED_BYTES)
        log("matmul", m=m, n=n, p=p, batch=batch, flip=flip, transpose=transpose, dtype=dtype)
        a_base, a = operand(dev, m, n, dtype, flip, transpose, 0)
        b_base, b = operand(dev, n, p, dtype, transpose, flip, 1)
        allowed = alloc_errors(rows * p, itemsize(dtype))
        a_shape = (m, n) if batch is None else (batch, m, n)
        if batch is not None:
            a = a.broadcast_to(a_shape)
            allowed = allowed | alloc_errors(rows * n, itemsize(dtype))  # a compacted first
        label, out = check_outcome(lambda: nd.matmul(a, b), allowed)
        if out is not None and out.size == 0:
            assert out.shape == a_shape[:-1] + (p,)
        elif out is not None:
            a_ref = np.broadcast_to(a_base, a_shape).astype(np.float64)
            b_ref = np.broadcast_to(b_base, (n, p)).astype(np.float64)
            close(out.numpy(), a_ref @ b_ref, dtype, n)
        return label

    return run


# ---- backend entry points, called directly (the second line of defence) --------------------
def put(mod, x: np.ndarray):
    arr = mod.Array(x.size, x.dtype.name)
    mod.from_numpy(np.ascontiguousarray(x), arr)
    return arr


def take(mod, arr) -> np.ndarray:
    return mod.to_numpy(arr, (arr.size,), (1,), 0)


def fits_int64(*ints) -> bool:
    return all(-INT64_MAX - 1 <= int(v) <= INT64_MAX for v in ints)


# Raised when an argument cannot even be passed (pybind11 refuses a Python int beyond int64).
UNPASSABLE = {TypeError, OverflowError}


@prop
def prop_backend_views(dev, examples):
    mod = dev.mod
    fns = st.sampled_from(["to_numpy", "compact", "ewise_setitem", "scalar_setitem"])

    @settings(max_examples=examples)
    @example(fn="to_numpy", size=12, other=12, view=((9,), (2**61,)), offset=0, dtype="float32")
    @example(fn="to_numpy", size=12, other=12, view=((5,), (2**62,)), offset=0, dtype="float32")
    @example(fn="compact", size=12, other=18, view=((9, 2), (2**61, 1)), offset=0,
             dtype="float32")
    @example(fn="scalar_setitem", size=4, other=4, view=((2**31, 2**31), (2**62, 2**62)),
             offset=0, dtype="float32")
    @given(fn=fns, size=st.integers(0, 24), other=st.integers(0, 24) | st.just(-1), view=views,
           offset=offsets, dtype=dtypes)
    def run(fn, size, other, view, offset, dtype):
        shape, strides = view
        count = math.prod(shape)
        other = count if other == -1 and count <= SMALL else max(other, 0)
        log("backend_views", fn=fn, size=size, other=other, shape=shape, strides=strides,
            offset=offset, dtype=dtype)
        allowed = view_errors(shape, strides, offset, size)
        if not fits_int64(offset, *shape, *strides, count if fn == "scalar_setitem" else 0):
            allowed |= UNPASSABLE
        success_ok = None
        if not allowed:
            if fn in ("compact", "ewise_setitem") and other < count:
                allowed = {ValueError}  # the compact side is too small
            elif fn == "to_numpy" and count > SMALL:
                allowed = {MemoryError, ValueError}  # a 2**50-element result
            elif fn == "to_numpy" and count == 0:
                allowed, success_ok = {ValueError}, True  # NumPy refuses (0, 2**61) float32
            elif fn == "scalar_setitem":
                assume(count <= SMALL)  # valid, but 2**50 writes long
        elif count == 0:
            success_ok = True  # touches nothing: a no-op is as safe as a refusal
        target = put(mod, values(size, dtype))
        src = put(mod, values(other, dtype) + 10)
        calls = {
            "to_numpy": lambda: mod.to_numpy(target, shape, strides, offset),
            "compact": lambda: mod.compact(target, src, shape, strides, offset),
            "ewise_setitem": lambda: mod.ewise_setitem(src, target, shape, strides, offset),
            "scalar_setitem": lambda: mod.scalar_setitem(count, 9.0, target, shape, strides,
                                                         offset),
        }
        label, result = check_outcome(calls[fn], allowed, success_ok)
        if label == "ok" and not allowed:
            check_view_call(mod, fn, result, target, src, size, shape, strides, offset, dtype)
        return label

    return run


def check_view_call(mod, fn, result, target, src, size, shape, strides, offset, dtype):
    """Compare a successful strided call with the element-by-element model."""
    buf = values(size, dtype)
    count = math.prod(shape)
    if fn == "to_numpy" and count == 0:
        assert result.shape == shape
    elif fn == "to_numpy":
        np.testing.assert_array_equal(result, gather(buf, shape, strides, offset))
    elif fn == "compact":
        np.testing.assert_array_equal(take(mod, src)[:count],
                                      gather(buf, shape, strides, offset).reshape(-1))
    else:
        positions = list(element_offsets(shape, strides, offset))
        if len(set(positions)) < len(positions):
            return  # repeated destinations: which write lands is backend-defined
        want = buf.copy()
        fill = values(src.size, dtype) + 10 if fn == "ewise_setitem" else None
        for i, pos in enumerate(positions):
            want[pos] = fill[i] if fill is not None else 9.0
        np.testing.assert_array_equal(take(mod, target), want)


@prop
def prop_backend_reduce(dev, examples):
    mod = dev.mod

    @settings(max_examples=examples)
    @example(size=12, rows=3, reduce_size=2**62, op="sum", dtype="float32")
    @example(size=12, rows=4, reduce_size=2**62 + 1, op="sum", dtype="float32")
    @given(size=st.integers(0, 24), rows=st.integers(0, 6), reduce_size=dims,
           op=st.sampled_from(["sum", "max", "min"]), dtype=dtypes)
    def run(size, rows, reduce_size, op, dtype):
        assume(op == "sum" or reduce_size > 0 or rows == 0)  # no identity for max/min
        log("backend_reduce", size=size, rows=rows, reduce_size=reduce_size, op=op, dtype=dtype)
        a, out = put(mod, values(size, dtype)), mod.Array(rows, dtype)
        need = rows * reduce_size
        allowed = {ValueError} if need > size else set()
        if not fits_int64(reduce_size):
            allowed |= UNPASSABLE
        success_ok = None
        if need == 0:  # reads nothing: done as a no-op or refused, both are safe
            allowed, success_ok = allowed | {ValueError}, True
        label, _ = check_outcome(lambda: getattr(mod, f"reduce_{op}")(a, out, reduce_size),
                                 allowed, success_ok)
        if label == "ok" and need:
            blocks = values(size, dtype)[:need].reshape(rows, reduce_size).astype(np.float64)
            close(take(mod, out), getattr(np, op)(blocks, axis=1), dtype, reduce_size)
        return label

    return run


@st.composite
def strided_operands(draw):
    """(m, n, p, a_offset, ars, acs, b_offset, brs, bcs) for matmul_strided: operands laid
    out row-major, transposed, or with strides and offsets from the huge mix."""
    m, n, p = draw(mm_dims), draw(mm_dims), draw(mm_dims)
    layout = draw(st.sampled_from(["rows", "columns", "mixed"]))
    if layout == "mixed":
        return (m, n, p, draw(offsets), draw(strides_values), draw(strides_values),
                draw(offsets), draw(strides_values), draw(strides_values))
    a_off, b_off = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    if layout == "rows":
        return m, n, p, a_off, n, 1, b_off, p, 1
    return m, n, p, a_off, 1, m, b_off, 1, n


@prop
def prop_backend_matmul(dev, examples):
    mod = dev.mod
    strided = getattr(mod, "matmul_strided", None)

    @settings(max_examples=examples)
    @example(use_strided=True, args=(9, 2, 1, 0, 2**61, 1, 0, 1, 1), sizes=(12, 12, 12),
             dtype="float32")
    @example(use_strided=False, args=(2**32, 2**32, 1, 0, 1, 1, 0, 1, 1), sizes=(12, 12, 12),
             dtype="float32")
    @given(use_strided=st.booleans(), args=strided_operands(),
           sizes=st.tuples(st.integers(0, 24), st.integers(0, 24), st.integers(0, 24)),
           dtype=st.sampled_from(["float32", "float64"]))
    def run(use_strided, args, sizes, dtype):
        m, n, p, a_off, ars, acs, b_off, brs, bcs = args
        if not use_strided or strided is None:
            a_off, ars, acs, b_off, brs, bcs = 0, n, 1, 0, p, 1  # plain compact operands
        log("backend_matmul", strided=use_strided, m=m, n=n, p=p, a=(a_off, ars, acs),
            b=(b_off, brs, bcs), sizes=sizes, dtype=dtype)
        allowed = matmul_errors(m, n, p, (a_off, ars, acs), (b_off, brs, bcs), sizes)
        if not allowed:
            assume(n <= SMALL)  # valid but long
        a, b = put(mod, values(sizes[0], dtype)), put(mod, values(sizes[1], dtype) + 1)
        out = mod.Array(sizes[2], dtype)
        if use_strided and strided is not None:
            def call():
                strided(a, b, out, m, n, p, a_off, ars, acs, b_off, brs, bcs)
        else:
            def call():
                mod.matmul(a, b, out, m, n, p)
        label, _ = check_outcome(call, allowed, True if m * p == 0 else None)
        if label == "ok" and m * p:
            a_ref = gather(values(sizes[0], dtype), (m, n), (ars, acs), a_off)
            b_ref = gather(values(sizes[1], dtype) + 1, (n, p), (brs, bcs), b_off)
            close(take(mod, out)[:m * p].reshape(m, p),
                  a_ref.astype(np.float64) @ b_ref.astype(np.float64), dtype, n)
        return label

    return run


def matmul_errors(m, n, p, a_view, b_view, sizes) -> set:
    """Errors allowed for out (m×p) = a (m×n, strided) @ b (n×p, strided)."""
    errors = set()
    if not fits_int64(m, n, p, *a_view, *b_view):
        errors |= UNPASSABLE | {ValueError, IndexError}
    if min(a_view[1:] + b_view[1:]) < 0:
        errors.add(ValueError)
    for (off, rs, cs), rows, cols, size in ((a_view, m, n, sizes[0]), (b_view, n, p, sizes[1])):
        if view_errors((rows, cols), (rs, cs), off, size):
            errors |= {IndexOutOfRange, ValueError}  # outside the buffer / buffer too small
    if m * p > sizes[2]:
        errors.add(ValueError)
    return errors


# ---- the child process ---------------------------------------------------------------------
def open_device(name: str):
    if name == "cuda_emulated":
        from _cuda_emulator import FakeCupy

        from needle.backend_ndarray import ndarray_backend_cuda
        from needle.backend_ndarray._cuda import runtime
        runtime._cupy, runtime._reason = FakeCupy(num_sms=2), None
        return nd.BackendDevice("cuda", ndarray_backend_cuda)
    dev = nd.device_by_name(name)
    if not dev.enabled():
        raise SystemExit(f"device {name} is not available here")
    return dev


def run_property(name: str, dev, examples: int) -> dict:
    outcomes: Counter = Counter()
    test = PROPERTIES[name](dev, examples)
    inner = test.hypothesis.inner_test

    def counted(*args, **kwargs):
        outcomes[inner(*args, **kwargs)] += 1

    test.hypothesis.inner_test = counted
    report = {"examples": 0, "outcomes": {}, "failure": None}
    try:
        test()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        report["failure"] = traceback.format_exc()
    report["examples"] = sum(outcomes.values())
    report["outcomes"] = dict(outcomes)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device")
    parser.add_argument("properties", nargs="*")
    parser.add_argument("--examples", type=int, default=60)
    args = parser.parse_args()
    dev = open_device(args.device)
    results = {name: run_property(name, dev, args.examples)
               for name in (args.properties or PROPERTIES)}
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
