"""Kernel tests of the CUDA backend, shared by the GPU run and the host-emulation run.

Each ``check_*`` takes a backend module ``B`` that follows docs/backend_protocol.md and
compares it with the NumPy reference backend ``R`` (the oracle) on the same data, on compact
and non-compact views, for one dtype. The ``test_*`` functions at the end use a ``backend``
fixture: test_cuda_backend.py imports them with the real GPU backend, test_cuda_emulated.py
with the same .cu sources compiled for the host (this file is not collected by itself).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from needle._core.errors import DTypeError, ShapeError
from needle.backend_ndarray import ndarray_backend_numpy as R
from needle.backend_ndarray import ndarray_backend_numpy_fused as RF
from needle.backend_ndarray.ewise_codes import BINARY_OPS, UNARY_OPS

DTYPES = ("float32", "float64", "float16")
EPS = {"float32": 1.2e-7, "float64": 2.3e-16, "float16": 9.8e-4}
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "power", "eq", "ge", "tanh_grad",
          "relu_grad")
SCALAR = ("add", "sub", "rsub", "mul", "div", "rdiv", "power", "rpower", "maximum", "minimum",
          "eq", "ge", "le")
UNARY = ("neg", "log", "exp", "tanh", "sqrt", "abs", "sign", "sigmoid")


def compact_strides(shape) -> tuple:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


# (base size, shape, strides, offset): views of a flat buffer, including negative and zero
# strides, and a 9-dim view that only fits the kernels' 8 dims after merging.
VIEWS = {
    "compact": (24, (2, 3, 4), (12, 4, 1), 0),
    "transpose": (24, (4, 3, 2), (1, 4, 12), 0),
    "step_slice": (60, (3, 4), (20, 2), 5),
    "flipped": (24, (2, 3, 4), (-12, 4, -1), 15),
    "broadcast": (4, (3, 4, 5), (0, 1, 0), 0),
    "five_dims_permuted": (72, (2, 3, 2, 3, 2), (1, 6, 36, 2, 18), 0),
    "nine_dims": (512, (2,) * 9, (256, 128, 64, 32, 16, 8, 4, 2, 1), 0),
    "scalar_like": (5, (1, 1), (1, 1), 3),
}
# Views with no repeated element: valid destinations of a scatter.
SCATTER_VIEWS = ("compact", "transpose", "step_slice", "flipped", "five_dims_permuted",
                 "nine_dims", "scalar_like")


def rand(rng, shape, dtype, low=-2.0, high=2.0) -> np.ndarray:
    return rng.uniform(low, high, size=shape).astype(dtype)


def put(B, x: np.ndarray):
    """A buffer of backend ``B`` holding ``x`` (flattened)."""
    arr = B.Array(x.size, x.dtype.name)
    B.from_numpy(np.ascontiguousarray(x), arr)
    return arr


def get(B, arr, shape=None) -> np.ndarray:
    shape = (arr.size,) if shape is None else tuple(shape)
    return B.to_numpy(arr, shape, compact_strides(shape), 0)


def assert_close(got, want, dtype, scale=None, ulps=8.0) -> None:
    """Equal up to ``ulps`` units of ``dtype`` relative to ``scale`` (default: |want|).

    Where ``want`` is NaN or infinite, ``got`` must be the same NaN or infinity.
    """
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got64.shape == want64.shape, (got64.shape, want64.shape)
    finite = np.isfinite(want64)
    np.testing.assert_array_equal(got64[~finite], want64[~finite])
    scale = np.abs(want64) if scale is None else np.asarray(scale, np.float64)
    scale = np.broadcast_to(scale, want64.shape)[finite]
    tol = ulps * EPS[dtype] * scale + (6e-8 if dtype == "float16" else 1e-300)
    err = np.abs(got64[finite] - want64[finite])
    assert np.all(err <= tol), (
        f"max error {np.nanmax(err / tol, initial=0):.3g} x tolerance; got {got64[finite][:8]}, "
        f"want {want64[finite][:8]}")


# ---- buffers and transfers ------------------------------------------------------------------
def check_array_and_transfer(B, dtype: str) -> None:
    x = rand(np.random.default_rng(1), (37,), dtype)
    a = put(B, x)
    assert (a.size, a.dtype, a.itemsize) == (37, dtype, np.dtype(dtype).itemsize)
    assert isinstance(a.ptr(), int) and a.ptr() != 0
    np.testing.assert_array_equal(get(B, a), x)
    empty = B.Array(0, dtype)
    assert empty.size == 0 and get(B, empty).shape == (0,)
    # from_numpy casts to the buffer's dtype.
    c = B.Array(4, dtype)
    B.from_numpy(np.arange(4, dtype=np.float64), c)
    np.testing.assert_array_equal(get(B, c), np.arange(4).astype(dtype))
    B.fill(c, -1.5)
    np.testing.assert_array_equal(get(B, c), np.full(4, -1.5, dtype))


def check_to_numpy_view(B, dtype: str, view: str) -> None:
    base, shape, strides, offset = VIEWS[view]
    x = rand(np.random.default_rng(2), (base,), dtype)
    want = R.to_numpy(put(R, x), shape, strides, offset)
    np.testing.assert_array_equal(B.to_numpy(put(B, x), shape, strides, offset), want)


# ---- strided kernels --------------------------------------------------------------------------
def check_compact(B, dtype: str, view: str) -> None:
    base, shape, strides, offset = VIEWS[view]
    x = rand(np.random.default_rng(3), (base,), dtype)
    size = math.prod(shape)
    want, got = R.Array(size, dtype), B.Array(size, dtype)
    R.compact(put(R, x), want, shape, strides, offset)
    B.compact(put(B, x), got, shape, strides, offset)
    np.testing.assert_array_equal(get(B, got), want.array)


def check_setitem(B, dtype: str, view: str) -> None:
    base, shape, strides, offset = VIEWS[view]
    rng = np.random.default_rng(4)
    x, vals = rand(rng, (base,), dtype), rand(rng, (math.prod(shape),), dtype)
    want, got = put(R, x), put(B, x)
    R.ewise_setitem(put(R, vals), want, shape, strides, offset)
    B.ewise_setitem(put(B, vals), got, shape, strides, offset)
    np.testing.assert_array_equal(get(B, got), want.array)
    R.scalar_setitem(math.prod(shape), 0.1, want, shape, strides, offset)
    B.scalar_setitem(math.prod(shape), 0.1, got, shape, strides, offset)
    np.testing.assert_array_equal(get(B, got), want.array)


# ---- elementwise ------------------------------------------------------------------------------
def _operands(name: str, dtype: str, n: int = 1000):
    rng = np.random.default_rng(5)
    a, b = rand(rng, (n,), dtype), rand(rng, (n,), dtype)
    if name in ("power", "rpower", "log", "sqrt"):
        a = np.abs(a) + np.asarray(0.25, dtype)  # real results (NaN cases are checked apart)
    if name in ("eq", "ge", "le", "maximum", "minimum"):
        b[::3] = a[::3]  # ties
    if name == "relu_grad":
        b[:4], b[4] = 0, -0.0  # sign(+-0) is the zero itself: a signed zero product
    if name in ("div", "rdiv"):
        a, b = np.where(np.abs(a) < 0.1, 1, a).astype(dtype), np.where(
            np.abs(b) < 0.1, 1, b).astype(dtype)
    return a, b


def _run(M, fn_name: str, *arrays_and_scalars, n: int, dtype: str):
    out = M.Array(n, dtype)
    args = [put(M, v) if isinstance(v, np.ndarray) else v for v in arrays_and_scalars]
    with np.errstate(all="ignore"):  # overflow to inf is part of what is compared
        getattr(M, fn_name)(*args, out)
    return get(M, out) if M is not R else out.array


def check_binary(B, dtype: str, name: str) -> None:
    a, b = _operands(name, dtype)
    want = _run(R, f"ewise_{name}", a, b, n=a.size, dtype=dtype)
    scale = None
    if name == "tanh_grad":  # 1 - t*t cancels: float16 (computed in float) is off by ulps of t*t
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        scale = np.abs(a64) * (1 + b64 * b64)
    assert_close(_run(B, f"ewise_{name}", a, b, n=a.size, dtype=dtype), want, dtype, scale)


def check_scalar(B, dtype: str, name: str) -> None:
    a, _ = _operands(name, dtype)
    val = 1.7 if name not in ("eq", "ge", "le") else float(a[7])
    want = _run(R, f"scalar_{name}", a, val, n=a.size, dtype=dtype)
    assert_close(_run(B, f"scalar_{name}", a, val, n=a.size, dtype=dtype), want, dtype)


def check_unary(B, dtype: str, name: str) -> None:
    a, _ = _operands(name, dtype)
    if name in ("sign", "abs", "neg"):
        a[:5] = 0
    if name in ("exp", "sigmoid", "tanh"):
        a = a * np.asarray(20, dtype)  # saturating arguments on both sides
    want = _run(R, f"ewise_{name}", a, n=a.size, dtype=dtype)
    assert_close(_run(B, f"ewise_{name}", a, n=a.size, dtype=dtype), want, dtype)


def check_nan_semantics(B, dtype: str) -> None:
    """maximum/minimum propagate NaN; power of a negative base to a fraction is NaN."""
    a = np.array([np.nan, 1.0, -2.0, 3.0], dtype)
    b = np.array([0.0, np.nan, 0.5, 1.0], dtype)
    for name in ("maximum", "minimum", "power"):
        want = _run(R, f"ewise_{name}", a, b, n=4, dtype=dtype)
        assert_close(_run(B, f"ewise_{name}", a, b, n=4, dtype=dtype), want, dtype)
    want = _run(R, "ewise_sign", a, n=4, dtype=dtype)
    assert_close(_run(B, "ewise_sign", a, n=4, dtype=dtype), want, dtype)


def check_cast(B, src: str, dst: str) -> None:
    x = rand(np.random.default_rng(6), (513,), src, -70000.0, 70000.0) if src != "float16" \
        else rand(np.random.default_rng(6), (513,), src)
    out = B.Array(x.size, dst)
    B.ewise_cast(put(B, x), out)
    # NumPy's astype is the reference (overflow to inf included).
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(get(B, out), x.astype(dst))


# ---- reductions -------------------------------------------------------------------------------
REDUCE_SHAPES = ((7, 5), (1, 1), (3, 33), (40, 100), (2, 100_000), (1, 70_001))


def check_reduce(B, dtype: str, op: str, rows: int, size: int) -> None:
    x = rand(np.random.default_rng(7), (rows, size), dtype)
    out = B.Array(rows, dtype)
    getattr(B, f"reduce_{op}")(put(B, x), out, size)
    x64 = x.astype(np.float64)
    want = {"sum": x64.sum(axis=1), "max": x64.max(axis=1), "min": x64.min(axis=1)}[op]
    # A sum is compared with the exact one, to within a few roundings of its magnitude.
    scale = np.abs(x64).sum(axis=1) if op == "sum" else None
    ulps = 4.0 if op == "sum" and dtype != "float16" else 8.0
    assert_close(get(B, out), want.astype(dtype) if op != "sum" else want, dtype, scale, ulps)


def check_reduce_nan(B, dtype: str) -> None:
    x = np.arange(200, dtype=dtype).reshape(2, 100)
    x[1, 57] = np.nan
    for op in ("max", "min", "sum"):
        out = B.Array(2, dtype)
        getattr(B, f"reduce_{op}")(put(B, x), out, 100)
        got = get(B, out)
        assert not np.isnan(got[0]) and np.isnan(got[1]), (op, got)


# ---- matmul -----------------------------------------------------------------------------------
MATMUL_SHAPES = ((1, 1, 1), (5, 3, 7), (64, 64, 64), (130, 20, 140), (129, 257, 65), (3, 0, 4))


def check_matmul(B, dtype: str, m: int, n: int, p: int) -> None:
    rng = np.random.default_rng(8)
    a, b = rand(rng, (m, n), dtype), rand(rng, (n, p), dtype)
    out = B.Array(m * p, dtype)
    B.fill(out, 123.0)  # must be overwritten
    B.matmul(put(B, a), put(B, b), out, m, n, p)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert_close(get(B, out, (m, p)), want, dtype, scale, ulps=4.0 * max(n, 1) ** 0.5 + 4)


def _strided_operand(rng, rows, cols, layout, dtype):
    """(values, buffer values, offset, row stride, col stride) of a rows x cols operand laid
    out as 'n' (row-major), 't' (a transposed view), 's' (a column slice of a wider matrix)
    or 'b' (one row broadcast down the rows: row stride 0, as NDArray's column sums)."""
    values = rand(rng, (rows, cols), dtype)
    if layout == "n":
        return values, values, 0, cols, 1
    if layout == "t":
        return values, values.T, 0, 1, rows
    if layout == "b":
        values[:] = values[0]
        return values, np.concatenate([rand(rng, (3,), dtype), values[0]]), 3, 0, 1
    wide = rand(rng, (rows, cols + 5), dtype)
    wide[:, 2:2 + cols] = values
    return values, wide, 2, cols + 5, 1


def check_matmul_strided(B, dtype: str, m: int, n: int, p: int, la: str, lb: str) -> None:
    rng = np.random.default_rng(m * 10007 + n * 101 + p)
    a, a_buf, a_off, ars, acs = _strided_operand(rng, m, n, la, dtype)
    b, b_buf, b_off, brs, bcs = _strided_operand(rng, n, p, lb, dtype)
    out = B.Array(m * p, dtype)
    B.fill(out, float("nan"))  # must be overwritten, never accumulated into
    B.matmul_strided(put(B, np.ascontiguousarray(a_buf)), put(B, np.ascontiguousarray(b_buf)),
                     out, m, n, p, a_off, ars, acs, b_off, brs, bcs)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert_close(get(B, out, (m, p)), want, dtype, scale, ulps=4.0 * max(n, 1) ** 0.5 + 4)


def check_matmul_strided_refusals(B) -> None:
    a, out = put(B, np.ones(12, np.float32)), B.Array(4)
    with pytest.raises(ShapeError, match="matmul_strided: strides must be >= 0"):
        B.matmul_strided(a, a, out, 2, 3, 2, 0, 3, 1, 11, -1, 1)
    with pytest.raises(IndexError, match="matmul_strided: view reaches outside its buffer"):
        B.matmul_strided(a, a, out, 2, 3, 2, 0, 3, 1, 7, 2, 1)
    with pytest.raises(DTypeError, match="matmul_strided: dtypes differ"):
        B.matmul_strided(a, put(B, np.ones(12)), out, 2, 3, 2, 0, 3, 1, 0, 2, 1)


def check_matmul_tiled(B, dtype: str, m: int, n: int, p: int) -> None:
    t = B.__tile_size__
    rng = np.random.default_rng(9)
    a, b = rand(rng, (m, n), dtype), rand(rng, (n, p), dtype)

    def tiled(x):
        r, c = x.shape
        return np.ascontiguousarray(x.reshape(r // t, t, c // t, t).transpose(0, 2, 1, 3))

    out = B.Array(m * p, dtype)
    B.matmul_tiled(put(B, tiled(a)), put(B, tiled(b)), out, m, n, p)
    got = get(B, out, (m // t, p // t, t, t)).transpose(0, 2, 1, 3).reshape(m, p)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert_close(got, want, dtype, scale, ulps=4.0 * max(n, 1) ** 0.5 + 4)


# ---- fused kernels: softmax cross-entropy, embedding -------------------------------------------
def check_softmax_xent(B, dtype: str, n: int, k: int, spread: float) -> None:
    """Forward and backward against the NumPy reference (float64 inside); ``spread`` 30 makes
    an unshifted exp under- and overflow, and k > 256 gives each thread several columns."""
    rng = np.random.default_rng(n * 1000 + k)
    z = (rng.standard_normal(n * k) * spread).astype(dtype)
    y = rng.integers(0, k, n).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    za, ya, ga = put(B, z), put(B, y), put(B, g)
    loss, lse, dz = B.Array(n, dtype), B.Array(n, dtype), B.Array(n * k, dtype)
    B.softmax_xent_forward(za, ya, loss, lse, n, k)
    B.softmax_xent_backward(za, ya, lse, ga, dz, n, k)
    want = [R.Array(n, "float64"), R.Array(n, "float64"), R.Array(n * k, "float64")]
    zr, yr = put(R, z.astype(np.float64)), put(R, y.astype(np.float64))
    RF.softmax_xent_forward(zr, yr, want[0], want[1], n, k)
    RF.softmax_xent_backward(zr, yr, want[1], put(R, g.astype(np.float64)), want[2], n, k)
    for got, ref in zip((loss, lse, dz), want, strict=True):
        assert_close(get(B, got), ref.array, dtype, scale=spread * max(1.0, math.log(k)),
                     ulps=64.0)


def check_embedding(B, dtype: str, num: int, dim: int, n: int) -> None:
    """Rows gathered exactly; gradients of repeated ids summed in position order (as
    numpy.add.at): the same numbers as the reference."""
    rng = np.random.default_rng(num * 100 + n)
    table = rand(rng, (num * dim,), dtype)
    ids = rng.integers(0, num, n).astype(dtype)
    if n > 2:
        ids[1] = ids[n - 1] = ids[0]  # a repeated id
    g = rand(rng, (n * dim,), dtype)
    out, dtable = B.Array(n * dim, dtype), B.Array(num * dim, dtype)
    B.fill(dtable, 7.0)  # every element is overwritten, not only the rows that ids pick
    B.embedding_forward(put(B, table), put(B, ids), out, num, dim, n)
    B.embedding_backward(put(B, g), put(B, ids), dtable, num, dim, n)
    want_out, want_dtable = R.Array(n * dim, dtype), R.Array(num * dim, dtype)
    RF.embedding_forward(put(R, table), put(R, ids), want_out, num, dim, n)
    RF.embedding_backward(put(R, g), put(R, ids), want_dtable, num, dim, n)
    np.testing.assert_array_equal(get(B, out), want_out.array)
    np.testing.assert_array_equal(get(B, dtable), want_dtable.array)


# (n, h, w, c, kh, kw, cout, stride, pad): padding wider than some taps reach, strides above
# 1 (ResNet9's 7x7 stride 4), a stride longer than the kernel (inputs no tap reads: zero
# gradient), a 1x1 image under a 3x3 kernel, and the pointwise case that skips im2col.
CONV_GEOMETRIES = ((1, 4, 4, 2, 3, 3, 5, 1, 1), (2, 7, 5, 3, 3, 3, 4, 2, 1),
                   (1, 9, 10, 3, 7, 7, 4, 4, 3), (1, 3, 3, 2, 2, 3, 3, 3, 0),
                   (2, 1, 1, 6, 3, 3, 5, 1, 1), (2, 4, 3, 8, 1, 1, 6, 1, 0))


def check_conv(B, dtype: str, geom: tuple) -> None:
    """Forward, kernel gradient and input gradient against the NumPy reference kernels
    (float64 of the same rounded inputs); every output element is written (NaN-filled)."""
    n, h, w, c, kh, kw, cout, stride, pad = geom
    ho, wo = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
    rng = np.random.default_rng(sum(geom))
    x, wt = rand(rng, (n * h * w * c,), dtype), rand(rng, (kh * kw * c * cout,), dtype)
    dy = rand(rng, (n * ho * wo * cout,), dtype)
    got = [B.Array(size, dtype) for size in (dy.size, wt.size, x.size)]
    for arr in got:
        B.fill(arr, float("nan"))
    bx, bw, bdy = put(B, x), put(B, wt), put(B, dy)
    B.conv2d_forward(bx, bw, got[0], *geom)
    B.conv2d_weight_grad(bx, bdy, got[1], *geom)
    B.conv2d_input_grad(bdy, bw, got[2], *geom)
    want = [R.Array(size, "float64") for size in (dy.size, wt.size, x.size)]
    rx, rw, rdy = (put(R, v.astype(np.float64)) for v in (x, wt, dy))
    RF.conv2d_forward(rx, rw, want[0], *geom)
    RF.conv2d_weight_grad(rx, rdy, want[1], *geom)
    RF.conv2d_input_grad(rdy, rw, want[2], *geom)
    k = kh * kw * c
    for name, arr, ref, terms in zip(("forward", "weight_grad", "input_grad"), got, want,
                                     (k, n * ho * wo, k), strict=True):
        result = get(B, arr)
        assert not np.isnan(result).any(), f"conv2d {name}: elements left unwritten"
        assert_close(result, ref.array, dtype, scale=2.0 * terms ** 0.5, ulps=16.0)
    # a caller's workspace (what needle.ops passes) gives the same bits as the call's own
    size = B.conv2d_workspace(*geom)
    assert size == (0 if (kh, kw, stride, pad) == (1, 1, 1, 0) else n * ho * wo * k)
    workspace = B.Array(max(size, 1), dtype)
    again = [B.Array(arr.size, dtype) for arr in got]
    B.conv2d_forward(bx, bw, again[0], *geom, workspace)
    B.conv2d_weight_grad(bx, bdy, again[1], *geom, workspace)
    B.conv2d_input_grad(bdy, bw, again[2], *geom, workspace)
    for first, second in zip(got, again, strict=True):
        np.testing.assert_array_equal(get(B, first), get(B, second))


# ---- elementwise programs ------------------------------------------------------------------
def _separately(M, ins, code, scalars, n, dtype):
    """The program run with module ``M``'s own separate kernels, op by op: the oracle that
    ``M.ewise_program`` must match bit for bit."""
    from needle.backend_ndarray.ewise_codes import BINARY, LOAD, SCALAR, STORE, UNARY

    binary, scalar, rscalar, unary = RF.kernel_tables(M)
    regs, outs = {}, {}
    for k in range(0, len(code), 5):
        kind, op, dst, a, b = code[k:k + 5]
        if kind == LOAD:
            regs[dst] = ins[a]
            continue
        if kind == STORE:
            outs[dst] = regs[a]
            continue
        result = M.Array(n, dtype)
        if kind == BINARY:
            binary[op](regs[a], regs[b], result)
        elif kind == UNARY:
            unary[op](regs[a], result)
        else:
            table = scalar if kind == SCALAR else rscalar
            if op in table:
                table[op](regs[a], scalars[b], result)
            else:  # tanh_grad / relu_grad with a scalar: the binary kernel on a filled array
                full = M.Array(n, dtype)
                M.fill(full, scalars[b])
                pair = (regs[a], full) if kind == SCALAR else (full, regs[a])
                binary[op](*pair, result)
        regs[dst] = result
    return [get(M, outs[j])[:n] for j in sorted(outs)]


def _every_op_programs():
    """Programs that together use every op in every instruction kind, plus an SGD update
    with momentum and a chain as long as a fused run gets."""
    from needle.backend_ndarray.ewise_codes import BINARY, LOAD, RSCALAR, SCALAR, STORE, UNARY

    programs = []
    for op in range(len(BINARY_OPS)):
        programs.append(("binary-" + list(BINARY_OPS)[op], 2, 3, [
            LOAD, 0, 0, 0, 0, LOAD, 0, 1, 1, 0, BINARY, op, 2, 0, 1, SCALAR, op, 3, 0, 0,
            RSCALAR, op, 4, 1, 1, STORE, 0, 0, 2, 0, STORE, 0, 1, 3, 0, STORE, 0, 2, 4, 0]))
    for op in range(len(UNARY_OPS)):
        programs.append(("unary-" + list(UNARY_OPS)[op], 1, 1, [
            LOAD, 0, 0, 0, 0, UNARY, op, 1, 0, 0, STORE, 0, 0, 1, 0]))
    # v' = momentum v + g; w' = w - lr v'
    programs.append(("sgd-momentum", 3, 2, [
        LOAD, 0, 0, 0, 0, LOAD, 0, 1, 1, 0, LOAD, 0, 2, 2, 0, SCALAR, 2, 3, 1, 0,
        BINARY, 0, 4, 3, 2, SCALAR, 2, 5, 4, 1, BINARY, 1, 6, 0, 5, STORE, 0, 0, 6, 0,
        STORE, 0, 1, 4, 0]))
    chain = [LOAD, 0, 0, 0, 0, LOAD, 0, 1, 1, 0]
    for step in range(14):  # 14 more registers, each op reading the last two
        chain += [BINARY, step % 4, step + 2, step, step + 1]
    programs.append(("long-chain", 2, 1, chain + [STORE, 0, 0, 15, 0]))
    return programs


PROGRAMS = _every_op_programs()


def check_ewise_program(B, dtype: str, name: str, n: int) -> None:
    _, n_in, n_out, code = next(p for p in PROGRAMS if p[0] == name)
    rng = np.random.default_rng(len(name) * 31 + n)
    values = [rand(rng, (n,), dtype, 0.25, 2.0) for _ in range(n_in)]  # pow/log/sqrt: real
    if n > 4:
        values[0][:3] = (0.0, -0.0, 1.0)
        if n_in > 1:
            values[1][:3] = (0.0, 1.0, 1.0)  # ties for max/min/eq/ge, zeros for relu_grad
    scalars = [1.25, 0.5]
    ins = [put(B, v) for v in values]
    outs = [B.Array(n, dtype) for _ in range(n_out)]
    for o in outs:
        B.fill(o, float("nan"))
    B.ewise_program(ins, outs, code, scalars, n)
    with np.errstate(all="ignore"):
        want = _separately(B, ins, code, scalars, n, dtype)
    for j, (o, w) in enumerate(zip(outs, want, strict=True)):
        np.testing.assert_array_equal(get(B, o), w, err_msg=f"{name}: output {j}")


def _shifted(B, x: np.ndarray, shift: int):
    """A buffer of ``B`` holding ``x`` that starts ``shift`` elements past an allocator
    address (a second handle sharing the owner of a larger buffer): the backend never makes
    one, so this is how the kernels' unaligned path is reached."""
    base = put(B, np.concatenate([np.zeros(shift, x.dtype), x]))
    view = object.__new__(type(base))
    for slot in ("_owner", "dtype", "itemsize"):
        setattr(view, slot, getattr(base, slot))
    view._ptr, view.size = base.ptr() + shift * base.itemsize, x.size
    return view


def check_packs_and_tails(B, dtype: str) -> None:
    """The elementwise kernels move four elements per thread when every pointer is aligned to
    four of them, single elements for the tail and for unaligned buffers: every size around a
    pack gives the same bits aligned and one element off, and the reference's values."""
    rng = np.random.default_rng(11)
    other = "float64" if dtype != "float64" else "float32"
    _, n_in, n_out, code = next(p for p in PROGRAMS if p[0] == "sgd-momentum")
    for n in (1, 2, 3, 4, 5, 7, 8, 9, 1001):
        a, b = rand(rng, (n,), dtype, 0.25, 2.0), rand(rng, (n,), dtype, 0.25, 2.0)
        results = []
        for shift in (0, 1):
            ha, hb = _shifted(B, a, shift), _shifted(B, b, shift)
            outs = {}
            for name, kernel, args in (("add", B.ewise_add, (ha, hb)),
                                       ("mul", B.scalar_mul, (ha, 1.7)),
                                       ("exp", B.ewise_exp, (ha,))):
                out = _shifted(B, np.full(n, np.nan, dtype), shift)
                kernel(*args, out)
                outs[name] = get(B, out)
            cast = _shifted(B, np.zeros(n, other), shift)
            B.ewise_cast(ha, cast)
            outs["cast"] = get(B, cast)
            if dtype != "float16":  # programs run in float32 and float64
                ins = [ha, hb, _shifted(B, a[::-1].copy(), shift)]
                prog = [_shifted(B, np.full(n, np.nan, dtype), shift) for _ in range(n_out)]
                B.ewise_program(ins, prog, code, [0.9, 0.1], n)
                outs["program"] = [get(B, o) for o in prog]
                assert n_in == len(ins)
            results.append(outs)
        aligned, unaligned = results
        for name in aligned:
            np.testing.assert_array_equal(aligned[name], unaligned[name], err_msg=f"{name}, n={n}")
        assert_close(aligned["add"], _run(R, "ewise_add", a, b, n=n, dtype=dtype), dtype)
        assert_close(aligned["mul"], _run(R, "scalar_mul", a, 1.7, n=n, dtype=dtype), dtype)
        assert_close(aligned["exp"], _run(R, "ewise_exp", a, n=n, dtype=dtype), dtype)
        np.testing.assert_array_equal(aligned["cast"], a.astype(other))


def check_ewise_program_refusals(B) -> None:
    a, b, c = (put(B, np.ones(4, np.float32)) for _ in range(3))
    copy = [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]  # LOAD r0 = in0; STORE out0 = r0
    with pytest.raises(ValueError, match="output 0 shares its buffer with input 0"):
        B.ewise_program([a], [a], copy, [], 4)  # a copy onto itself
    with pytest.raises(ValueError, match="two outputs share a buffer"):
        B.ewise_program([a], [b, b], copy + [1, 0, 1, 0, 0], [], 4)
    with pytest.raises(ValueError, match="register 3 read before set"):
        B.ewise_program([a], [b], [1, 0, 0, 3, 0], [], 4)
    with pytest.raises(ValueError, match="at least 5 elements"):
        B.ewise_program([a], [b], copy, [], 5)
    with pytest.raises(DTypeError, match="float32 or float64"):
        B.ewise_program([B.Array(4, "float16")], [B.Array(4, "float16")], copy, [], 4)
    too_long = [0, 0, 0, 0, 0] + [3, 0, 1, 0, 0] * 96 + [1, 0, 0, 1, 0]
    with pytest.raises(ValueError, match="too many instructions"):
        B.ewise_program([a], [c], too_long, [1.0], 4)


def check_ewise_program_in_place(B, dtype: str, n: int) -> None:
    """The optimizers' update programs with outputs written into their inputs' buffers (SGD
    with momentum and decay: u and θ; Adam's second pass: v and θ; Adam's one-pass update: m,
    v and θ) give the bits of the same programs run into fresh outputs; a program that reads
    an input after storing over it is refused before anything is written."""
    from needle.optim import _adam_program, _adam_v_theta_program, _sgd_program

    rng = np.random.default_rng(n)
    cases = (
        (_sgd_program(True, True, True), 3, [0.1, 0.01, 0.9, 0.1], {0: 2, 1: 0}),
        (_adam_v_theta_program(False, True), 4,
         [0.01, 0.9, 0.1, 0.999, 0.001, 0.19, 0.1, 0.002, 1e-8], {0: 3, 1: 0}),
        (_adam_program(False, True), 4,
         [0.01, 0.9, 0.1, 0.999, 0.001, 0.19, 0.1, 0.002, 1e-8], {0: 2, 1: 3, 2: 0}),
    )
    for prog, n_in, scalars, aliases in cases:  # aliases: output -> the input it overwrites
        values = [rand(rng, n, dtype, 0.5, 2.0) for _ in range(n_in)]  # v > 0 for Adam's sqrt
        fresh = [put(B, np.full(n, np.nan, dtype)) for _ in range(prog.n_outputs)]
        B.ewise_program([put(B, v) for v in values], fresh, prog.code, scalars, n)
        ins = [put(B, v) for v in values]
        B.ewise_program(ins, [ins[aliases[j]] for j in range(prog.n_outputs)], prog.code,
                        scalars, n)
        for j in range(prog.n_outputs):
            np.testing.assert_array_equal(get(B, ins[aliases[j]]), get(B, fresh[j]),
                                          err_msg=f"output {j}, n={n}")
        untouched = [i for i in range(n_in) if i not in aliases.values()]
        for i in untouched:
            np.testing.assert_array_equal(get(B, ins[i]), values[i])
    # out0 = 2·in0 into in0's buffer, then out1 = in0 + 1 reads in0 after it was overwritten
    late_read = [0, 0, 0, 0, 0, 3, 2, 1, 0, 0, 1, 0, 0, 1, 0, 3, 0, 2, 0, 1, 1, 0, 1, 2, 0]
    x = put(B, np.arange(n, dtype=dtype))
    other = put(B, np.zeros(n, dtype))
    with pytest.raises(ValueError, match="output 0 shares its buffer with input 0 and the "
                                         "program reads that input after storing"):
        B.ewise_program([x], [x, other], late_read, [2.0, 1.0], n)
    np.testing.assert_array_equal(get(B, x), np.arange(n, dtype=dtype))
    B.ewise_program([x], [other, put(B, np.zeros(n, dtype))], late_read, [2.0, 1.0], n)
    np.testing.assert_array_equal(get(B, other), 2 * np.arange(n, dtype=dtype))


def check_batch_norm(B, dtype: str, n: int, c: int, s: int) -> None:
    """Statistics, output and the three gradients against the NumPy reference kernels
    (float64 of the same rounded inputs); a mean far from zero, so centring matters."""
    rng = np.random.default_rng(n * 1000 + c * 10 + s)
    x = (rng.standard_normal(n * c * s) * 4 + 3).astype(dtype)
    w, b = rand(rng, (c,), dtype), rand(rng, (c,), dtype)
    dy = rand(rng, (n * c * s,), dtype)
    results = {}
    for M, dt in ((B, dtype), (R, "float64")):
        stats = [M.Array(c, dt) for _ in range(3)]
        y, grads = M.Array(n * c * s, dt), [M.Array(n * c * s, dt), M.Array(c, dt),
                                             M.Array(c, dt)]
        for arr in [y] + stats + grads:
            M.fill(arr, float("nan"))
        xa, wa = put(M, x.astype(dt)), put(M, w.astype(dt))
        fwd = B.batch_norm_forward if M is B else RF.batch_norm_forward
        bwd = B.batch_norm_backward if M is B else RF.batch_norm_backward
        fwd(xa, wa, put(M, b.astype(dt)), y, *stats, n, c, s, 1e-5)
        bwd(put(M, dy.astype(dt)), xa, wa, stats[0], stats[2], *grads, n, c, s)
        results[M] = [get(M, a) if M is B else a.array for a in [y] + stats + grads]
    names = ("y", "mean", "var", "invstd", "dx", "dw", "db")
    for name, got, want in zip(names, results[B], results[R], strict=True):
        if n * c * s == 0:  # nothing is written: the NaN fill stays
            assert np.isnan(got).all(), name
        else:
            # invstd reaches 1/sqrt(eps) for a constant channel (eps rounded to the dtype)
            scale = np.maximum(float(n * s), np.abs(want))
            assert_close(got, want, dtype, scale=scale, ulps=16.0)


def check_batch_norm_refusals(B, errors: dict | None = None) -> None:
    """Every backend's batch-norm kernels refuse the same bad calls with the same messages;
    ``errors`` overrides the exception class per refusal (``size``, ``dtype``, ``mixed``;
    the C++ backend raises the builtin classes its bindings map to)."""
    e = {"size": ShapeError, "dtype": DTypeError, "mixed": DTypeError, **(errors or {})}
    a = [B.Array(8) for _ in range(7)]
    with pytest.raises(e["size"], match="batch_norm_forward: x too small"):
        B.batch_norm_forward(*a, 3, 2, 2, 1e-5)
    with pytest.raises(e["size"], match="expected sizes n, c, s >= 0"):
        B.batch_norm_backward(*a, B.Array(8), -1, 2, 2)
    with pytest.raises(ValueError, match="eps >= 0"):
        B.batch_norm_forward(*a, 1, 2, 2, -1.0)
    with pytest.raises(e["dtype"], match="expected float32 or float64"):
        B.batch_norm_forward(*[B.Array(8, "float16") for _ in range(7)], 2, 2, 2, 1e-5)
    with pytest.raises(e["mixed"], match="dtypes differ"):
        B.batch_norm_backward(*a[:5], B.Array(8, "float64"), a[5], a[6], 2, 2, 2)
    with pytest.raises(ValueError, match="share memory"):
        B.batch_norm_forward(a[0], a[1], a[2], a[0], a[3], a[4], a[5], 2, 2, 2, 1e-5)


def check_deferred_checks(B) -> None:
    """A deferred label check sees the labels as they were at the launch (a copy made in
    stream order), runs at the first copy to the host of any array, and piles up at most
    MAX_PENDING_CHECKS launches before it runs by itself."""
    z, loss, lse = put(B, np.zeros(6, np.float32)), B.Array(2), B.Array(2)
    labels = put(B, np.array([0.0, 5.0], np.float32))
    B.softmax_xent_forward(z, labels, loss, lse, 2, 3)
    B.fill(labels, 1.0)  # the buffer is reused before the check runs: the launch's values count
    other = put(B, np.ones(3, np.float32))
    with pytest.raises(IndexError, match="at row 1, expected an integer in \\[0, 3\\), got 5.0"):
        get(B, other)
    np.testing.assert_array_equal(get(B, other), np.ones(3))  # checked once: nothing left
    B.fill(labels, 2.0)
    for _ in range(B.MAX_PENDING_CHECKS):
        B.softmax_xent_forward(z, labels, loss, lse, 2, 3)
    assert B.pending_checks() == B.MAX_PENDING_CHECKS
    B.softmax_xent_forward(z, labels, loss, lse, 2, 3)
    assert B.pending_checks() == 0


def check_conv_refusals(B) -> None:
    x = put(B, np.zeros(4 * 4 * 2, np.float32))
    with pytest.raises(ShapeError, match="conv2d_forward: expected sizes >= 1"):
        B.conv2d_forward(x, B.Array(50), B.Array(16), 1, 4, 4, 2, 5, 5, 1, 1, 0)
    with pytest.raises(ShapeError, match="conv2d_forward: w too small"):
        B.conv2d_forward(x, B.Array(3), B.Array(16), 1, 4, 4, 2, 3, 3, 1, 1, 1)
    with pytest.raises(DTypeError, match="float16"):
        B.conv2d_weight_grad(B.Array(32, "float16"), B.Array(16, "float16"),
                             B.Array(18, "float16"), 1, 4, 4, 2, 3, 3, 1, 1, 1)
    with pytest.raises(DTypeError, match="conv2d_input_grad: dtypes differ"):
        B.conv2d_input_grad(B.Array(16, "float64"), B.Array(18), x, 1, 4, 4, 2, 3, 3, 1, 1, 1)
    with pytest.raises(ValueError, match="share memory"):
        B.conv2d_forward(x, B.Array(18), x, 1, 4, 4, 2, 3, 3, 1, 1, 1)
    assert B.conv2d_workspace(1, 4, 4, 2, 3, 3, 1, 1, 1) == 16 * 18
    with pytest.raises(ShapeError, match="conv2d_forward: workspace too small"):
        B.conv2d_forward(x, B.Array(18), B.Array(16), 1, 4, 4, 2, 3, 3, 1, 1, 1, B.Array(10))
    with pytest.raises(ValueError, match="workspace must not share memory"):
        big = B.Array(16 * 18)
        B.conv2d_input_grad(B.Array(16), B.Array(18), big, 1, 4, 4, 2, 3, 3, 1, 1, 1, big)


def check_fused_refusals(B) -> None:
    """Bad labels and ids: the kernels write NaN where a value would come from one (and read
    nothing out of bounds); the host check, deferred from the launch, raises at the next
    synchronisation naming the op, the position and the value."""
    z, loss, lse = put(B, np.zeros(6, np.float32)), B.Array(2), B.Array(2)
    for bad, name in ((3.0, "3.0"), (-1.0, "-1.0"), (1.5, "1.5"), (float("nan"), "nan"),
                      (1e30, r"1\.00000001504")):  # float32(1e30), past any int64 too
        labels = put(B, np.array([0.0, bad], np.float32))
        B.softmax_xent_forward(z, labels, loss, lse, 2, 3)
        with pytest.raises(IndexError, match=f"softmax_xent_forward: class label out of range "
                                             f"at row 1, expected an integer in \\[0, 3\\), "
                                             f"got {name}"):
            B.synchronize()
        assert B.pending_checks() == 0
        np.testing.assert_allclose(get(B, loss), [np.log(3.0), np.nan], rtol=1e-6)
        dz = B.Array(6)
        B.softmax_xent_backward(z, labels, lse, put(B, np.ones(2, np.float32)), dz, 2, 3)
        with pytest.raises(IndexError, match="softmax_xent_backward: class label out of range "
                                             "at row 1"):
            get(B, dz)  # any copy to the host waits, so it runs the checks first
        got = get(B, dz).reshape(2, 3)
        np.testing.assert_allclose(got[0], [1 / 3 - 1, 1 / 3, 1 / 3], rtol=1e-6)
        assert np.isnan(got[1]).all()
        out = B.Array(4)
        B.embedding_forward(z, labels, out, 3, 2, 2)
        with pytest.raises(IndexError, match="embedding: id out of range at position 1"):
            B.synchronize()
        assert np.isnan(get(B, out)[2:]).all()
        table = B.Array(6)
        B.embedding_backward(put(B, np.ones(4, np.float32)), labels, table, 3, 2, 2)
        with pytest.raises(IndexError, match="embedding: id out of range at position 1"):
            B.synchronize()
        np.testing.assert_array_equal(get(B, table), [1, 1, 0, 0, 0, 0])  # the bad id skipped
    ok = put(B, np.array([0.0, 2.0], np.float32))
    with pytest.raises(ShapeError, match="z too small"):
        B.softmax_xent_forward(z, ok, loss, lse, 2, 4)
    with pytest.raises(ValueError, match="share memory"):
        B.softmax_xent_backward(z, ok, lse, loss, z, 2, 3)
    with pytest.raises(DTypeError, match="float32 or float64"):
        B.embedding_backward(*(B.Array(4, "float16") for _ in range(3)), 2, 2, 2)
    with pytest.raises(DTypeError):
        B.softmax_xent_forward(z, put(B, np.zeros(2, np.float64)), loss, lse, 2, 3)


# ---- the tests (collected where a module imports them and defines ``backend``) -----------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_array_and_transfer(backend, dtype):
    check_array_and_transfer(backend, dtype)


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_to_numpy_of_views(backend, dtype, view):
    check_to_numpy_view(backend, dtype, view)


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_compact(backend, dtype, view):
    check_compact(backend, dtype, view)


@pytest.mark.parametrize("view", SCATTER_VIEWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_setitem(backend, dtype, view):
    check_setitem(backend, dtype, view)


@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ewise_binary(backend, dtype, name):
    check_binary(backend, dtype, name)


@pytest.mark.parametrize("name", SCALAR)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_ops(backend, dtype, name):
    check_scalar(backend, dtype, name)


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unary_ops(backend, dtype, name):
    check_unary(backend, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_semantics(backend, dtype):
    check_nan_semantics(backend, dtype)


@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("src", DTYPES)
def test_ewise_cast(backend, src, dst):
    check_cast(backend, src, dst)


@pytest.mark.parametrize("shape", REDUCE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", ("sum", "max", "min"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce(backend, dtype, op, shape):
    check_reduce(backend, dtype, op, *shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_nan(backend, dtype):
    check_reduce_nan(backend, dtype)


@pytest.mark.parametrize("impl", ("cublas", "tiled"))
@pytest.mark.parametrize("shape", MATMUL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul(backend, dtype, shape, impl):
    before = backend.get_matmul_impl()
    backend.set_matmul_impl(impl)
    try:
        check_matmul(backend, dtype, *shape)
    finally:
        backend.set_matmul_impl(before)


@pytest.mark.parametrize("layouts", ("nn", "tn", "nt", "tt", "sn", "ns", "bn", "tb"))
@pytest.mark.parametrize("shape", ((1, 1, 1), (5, 3, 7), (33, 17, 9)),
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_matmul_strided(backend, dtype, shape, layouts):
    check_matmul_strided(backend, dtype, *shape, *layouts)


def test_matmul_strided_refusals(backend):
    check_matmul_strided_refusals(backend)


@pytest.mark.parametrize("shape", ((4, 4, 4), (8, 12, 16), (12, 4, 8)),
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_tiled(backend, dtype, shape):
    check_matmul_tiled(backend, dtype, *shape)


@pytest.mark.parametrize("spread", (1.0, 30.0))
@pytest.mark.parametrize("n, k", ((1, 1), (3, 7), (5, 300), (2, 1000)),
                         ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_softmax_xent(backend, dtype, n, k, spread):
    check_softmax_xent(backend, dtype, n, k, spread)


@pytest.mark.parametrize("geom", CONV_GEOMETRIES, ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_conv(backend, dtype, geom):
    check_conv(backend, dtype, geom)


def test_conv_refusals(backend):
    check_conv_refusals(backend)


@pytest.mark.parametrize("n", (1, 1000))
@pytest.mark.parametrize("name", [p[0] for p in PROGRAMS])
@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_ewise_program(backend, dtype, name, n):
    check_ewise_program(backend, dtype, name, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packs_and_tails(backend, dtype):
    check_packs_and_tails(backend, dtype)


def test_deferred_checks(backend):
    check_deferred_checks(backend)


def test_ewise_program_refusals(backend):
    check_ewise_program_refusals(backend)


@pytest.mark.parametrize("n", (1, 255, 257, 1000))
@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_ewise_program_in_place(backend, dtype, n):
    check_ewise_program_in_place(backend, dtype, n)


# (n, c, s): one element; (N, C) rows; NCHW planes; planes longer than a block; channels of
# more than a block's worth of rows; an empty batch (nothing written).
@pytest.mark.parametrize("n, c, s", ((1, 1, 1), (5, 3, 1), (4, 3, 7), (2, 5, 300), (600, 2, 1),
                                     (0, 3, 2)), ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_batch_norm(backend, dtype, n, c, s):
    check_batch_norm(backend, dtype, n, c, s)


def test_batch_norm_refusals(backend):
    check_batch_norm_refusals(backend)


@pytest.mark.parametrize("num, dim, n", ((1, 1, 1), (5, 3, 9), (40, 7, 300)),
                         ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_embedding(backend, dtype, num, dim, n):
    check_embedding(backend, dtype, num, dim, n)


def test_fused_kernels_refuse_bad_ids_and_buffers(backend):
    check_fused_refusals(backend)
