"""The C++ backend's matmul, convolution, LSTM-cell, batch-norm, softmax cross-entropy and
elementwise-program kernels against the NumPy reference.

Every case runs on each kernel build the CPU can execute (``_available_isas()``: avx512,
avx2, baseline), so an AVX-512 machine checks both vector families and an AVX2 one its own;
hypothesis draws the shapes, strides (transposed and sliced operands), dtypes, thread counts
and convolution geometries. The reference is ``ndarray_backend_numpy`` (float64 products for
float32 inputs, so the tolerance only covers the C++ side's rounding).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from cuda_checks import check_batch_norm_refusals, check_ewise_program_in_place
from hypothesis import given, settings
from hypothesis import strategies as st

from needle.backend_ndarray import ndarray_backend_numpy as ref

cpu = pytest.importorskip("needle.backend_ndarray.ndarray_backend_cpu")

ISAS = list(cpu._available_isas())
TOL = {"float32": 2e-5, "float64": 1e-12}


def put(backend, values: np.ndarray, dtype: str):
    arr = backend.Array(values.size, dtype)
    backend.from_numpy(np.ascontiguousarray(values, dtype=dtype).reshape(-1), arr)
    return arr


def flat(backend, arr, n=None) -> np.ndarray:
    return backend.to_numpy(arr, (arr.size if n is None else n,), (1,), 0)


def assert_close(actual, expected, dtype, scale=1.0):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    bound = TOL[dtype] * max(scale, float(np.abs(expected).max(initial=0.0)), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=bound)


@pytest.fixture(autouse=True)
def _restore_isa_and_threads():
    threads = cpu.get_num_threads()
    yield
    cpu._set_isa("auto")
    cpu.set_num_threads(threads)


# ---- kernel families -----------------------------------------------------------------------

def test_available_isas_and_kernel_info():
    assert ISAS[-1] == "baseline" and len(set(ISAS)) == len(ISAS)
    for isa in ISAS:
        cpu._set_isa(isa)
        info = cpu._kernel_info()
        assert info["isa"] == isa == cpu._get_isa()
        assert info["sgemm"].startswith({"avx512": "avx512", "avx2": "avx2",
                                         "baseline": "portable"}[isa])
    cpu._set_isa("auto")
    assert cpu._get_isa() == ISAS[0]  # auto picks the widest build the CPU runs
    with pytest.raises(ValueError, match="_set_isa: expected 'auto', 'avx512'"):
        cpu._set_isa("sse9")


@pytest.mark.parametrize("isa", ISAS)
def test_env_var_forces_a_kernel_family(isa):
    code = ("from needle.backend_ndarray import ndarray_backend_cpu as c; "
            "print(c._get_isa(), c._kernel_info()['sgemm'])")
    env = dict(os.environ, NEEDLE_CPU_ISA=isa)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[0] == isa


# ---- matmul: shapes, strides, dtypes, both vector families ---------------------------------

@st.composite
def matmul_cases(draw):
    """(m, n, p, a layout, b layout, dtype): layouts 'n' (row-major), 't' (transposed view),
    's' (a column slice of a wider matrix)."""
    sizes = st.one_of(st.integers(1, 40), st.integers(41, 200))
    m, n, p = draw(sizes), draw(sizes), draw(sizes)
    return (m, n, p, draw(st.sampled_from("nts")), draw(st.sampled_from("nts")),
            draw(st.sampled_from(["float32", "float64"])))


def _operand(rng, rows, cols, layout, dtype):
    """(values, buffer values, offset, row stride, col stride) of a rows x cols operand."""
    values = rng.standard_normal((rows, cols))
    if layout == "n":
        return values, values, 0, cols, 1
    if layout == "t":  # stored transposed: element (i, j) at j * rows + i
        return values, values.T, 0, 1, rows
    wide = rng.standard_normal((rows, cols + 5))  # a slice [:, 2:2+cols] of a wider matrix
    wide[:, 2:2 + cols] = values
    return values, wide, 2, cols + 5, 1


@settings(max_examples=60, deadline=None)
@given(case=matmul_cases(), isa=st.sampled_from(ISAS), threads=st.sampled_from([1, 2]))
def test_matmul_strided_matches_reference(case, isa, threads):
    m, n, p, la, lb, dtype = case
    cpu._set_isa(isa)
    cpu.set_num_threads(threads)
    rng = np.random.default_rng(m * 10007 + n * 101 + p)
    a, a_buf, a_off, ars, acs = _operand(rng, m, n, la, dtype)
    b, b_buf, b_off, brs, bcs = _operand(rng, n, p, lb, dtype)
    ca, cb = put(cpu, a_buf, dtype), put(cpu, b_buf, dtype)
    out = cpu.Array(m * p, dtype)
    cpu.fill(out, np.nan)  # must be overwritten, never accumulated into
    cpu.matmul_strided(ca, cb, out, m, n, p, a_off, ars, acs, b_off, brs, bcs)
    ra, rb = put(ref, a_buf, "float64"), put(ref, b_buf, "float64")
    rout = ref.Array(m * p, "float64")
    ref.matmul_strided(ra, rb, rout, m, n, p, a_off, ars, acs, b_off, brs, bcs)
    assert_close(flat(cpu, out), flat(ref, rout), dtype, scale=n ** 0.5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(64, 64, 64), (512, 64, 8), (1024, 128, 16), (300, 257, 33),
                                   (25, 1000, 7), (2048, 48, 260), (96, 512, 512),
                                   (200, 1100, 100), (130, 700, 60), (64, 1024, 100),
                                   (140, 300, 200)])
def test_matmul_kernel_paths(shape, dtype, isa):
    """Shapes that take each path: B and A read in place (narrow C), two-panel and 256-bit
    narrow kernels, half tiles, packed operands, several KC blocks; A read in place against a
    packed B (B over 256 KiB, C at most 8 panels wide: (130, 700, 60) float64) and against B
    read in place up to 8 panels ((200, 1100, 100), (140, 300, 200) float32), with edge rows
    and a narrow last panel, and A with a 4 KiB row stride (64, 1024, 100), which is packed
    instead (the values are checked; which path ran is not observable here)."""
    cpu._set_isa(isa)
    m, n, p = shape
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((m, n)), rng.standard_normal((n, p))
    out = cpu.Array(m * p, dtype)
    cpu.fill(out, np.nan)
    cpu.matmul(put(cpu, a, dtype), put(cpu, b, dtype), out, m, n, p)
    expected = a.astype(dtype).astype(np.float64) @ b.astype(dtype).astype(np.float64)
    assert_close(flat(cpu, out), expected.reshape(-1), dtype, scale=n ** 0.5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layouts", ["nn", "tn", "nt", "sn"])
def test_matmul_narrow_c_paths(layouts, dtype, isa):
    """Few rows of C, many columns, B packed (the LSTM LM's X.T @ dY): each thread packs its
    own blocks of columns. Two K blocks, a last block and a last panel cut short, rows not a
    multiple of the tile; A and B transposed or sliced. The result must not depend on the
    thread count (bitwise), and a block of its columns must be bitwise what the ordinary path
    gives for that slice of B alone (the same K blocks and tiles)."""
    cpu._set_isa(isa)
    m, n, p = 50, 300, 2100 + 13
    rng = np.random.default_rng(7)
    a, a_buf, a_off, ars, acs = _operand(rng, m, n, layouts[0], dtype)
    b, b_buf, b_off, brs, bcs = _operand(rng, n, p, layouts[1], dtype)
    ca, cb = put(cpu, a_buf, dtype), put(cpu, b_buf, dtype)
    results = []
    for threads in (1, 2):
        cpu.set_num_threads(threads)
        out = cpu.Array(m * p, dtype)
        cpu.fill(out, np.nan)
        cpu.matmul_strided(ca, cb, out, m, n, p, a_off, ars, acs, b_off, brs, bcs)
        results.append(flat(cpu, out))
    cols = slice(1000, 1064)  # 64 columns: too few for the narrow path
    part = cpu.Array(m * 64, dtype)
    cpu.matmul_strided(ca, cb, part, m, n, 64, a_off, ars, acs, b_off + cols.start * bcs,
                       brs, bcs)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0].reshape(m, p)[:, cols],
                                  flat(cpu, part).reshape(m, 64))
    expected = a.astype(dtype).astype(np.float64) @ b.astype(dtype).astype(np.float64)
    assert_close(results[0], expected.reshape(-1), dtype, scale=n ** 0.5)


# ---- convolution ---------------------------------------------------------------------------

@st.composite
def conv_cases(draw):
    """A valid convolution geometry: (n, h, w, c, kh, kw, cout, stride, pad)."""
    kh, kw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    pad = draw(st.integers(0, 3))
    h = draw(st.integers(max(1, kh - 2 * pad), 12))
    w = draw(st.integers(max(1, kw - 2 * pad), 12))
    return (draw(st.integers(1, 4)), h, w, draw(st.integers(1, 20)), kh, kw,
            draw(st.integers(1, 40)), draw(st.integers(1, 4)), pad)


# ResNet9's layers at batch 64: enough work (> 1e7 flop) for the threaded paths.
RESNET9_CONVS = [(64, 32, 32, 3, 7, 7, 16, 4, 3), (64, 8, 8, 16, 3, 3, 32, 2, 1),
                 (64, 4, 4, 32, 3, 3, 32, 1, 1), (64, 4, 4, 32, 3, 3, 64, 2, 1),
                 (64, 2, 2, 64, 3, 3, 128, 2, 1), (64, 1, 1, 128, 3, 3, 128, 1, 1)]


def _conv_both(geom, dtype, seed):
    n, h, w, c, kh, kw, cout, stride, pad = geom
    ho, wo = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n * h * w * c)
    wt = rng.standard_normal(kh * kw * c * cout)
    dy = rng.standard_normal(n * ho * wo * cout)
    bias = rng.standard_normal(cout) * 3
    results = {}
    for backend, dt in ((cpu, dtype), (ref, "float64")):
        bx, bw, bdy = put(backend, x, dt), put(backend, wt, dt), put(backend, dy, dt)
        out, dw, dx, out_b = (backend.Array(size, dt)
                              for size in (dy.size, wt.size, x.size, dy.size))
        for arr in (out, dw, dx, out_b):
            backend.fill(arr, np.nan)
        backend.conv2d_forward(bx, bw, out, *geom)
        backend.conv2d_weight_grad(bx, bdy, dw, *geom)
        backend.conv2d_input_grad(bdy, bw, dx, *geom)
        backend.conv2d_forward_bias(bx, bw, put(backend, bias, dt), out_b, *geom)
        results[backend] = [flat(backend, arr) for arr in (out, dw, dx, out_b)]
    k = kh * kw * c
    for got, want, scale in zip(results[cpu], results[ref], (k, n * ho * wo, k, k),
                                strict=True):
        assert_close(got, want, dtype, scale=scale ** 0.5)
    # the bias is exactly what a separate addition would add to the same sums
    with_bias = results[cpu][0].reshape(-1, cout) + bias.astype(dtype)
    np.testing.assert_array_equal(results[cpu][3].reshape(-1, cout), with_bias)


@settings(max_examples=50, deadline=None)
@given(geom=conv_cases(), dtype=st.sampled_from(["float32", "float64"]),
       isa=st.sampled_from(ISAS), threads=st.sampled_from([1, 2]))
def test_conv_kernels_match_reference(geom, dtype, isa, threads):
    cpu._set_isa(isa)
    cpu.set_num_threads(threads)
    _conv_both(geom, dtype, seed=sum(geom))


@pytest.mark.timeout(120)  # a deadlock between nested parallel regions would hang here
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("geom", RESNET9_CONVS)
def test_conv_kernels_on_resnet9_layers(geom, isa):
    cpu._set_isa(isa)
    cpu.set_num_threads(2)  # the threaded split (chunks, images for dx, partial dW sums)
    _conv_both(geom, "float32", seed=7)


@st.composite
def layouts(draw):
    """How an (N, H, W, C) operand lies in its buffer: the storage order of its axes
    (outermost first; (0, 3, 1, 2) is NCHW), values of padding after each innermost row and
    an offset."""
    return (tuple(draw(st.permutations(range(4)))), draw(st.integers(0, 2)),
            draw(st.integers(0, 5)))


def _strided(values: np.ndarray, layout) -> tuple:
    """``(buffer, view)``: ``values`` (N, H, W, C) stored per ``layout`` in a flat buffer,
    and the (offset, four strides) view that reads them back."""
    order, extra, offset = layout
    storage = [values.shape[a] for a in order]
    storage[-1] += extra
    strides_of_storage = np.cumprod([1] + storage[:0:-1])[::-1]
    strides = [0] * 4
    for axis, stride in zip(order, strides_of_storage, strict=True):
        strides[axis] = int(stride)
    buffer = np.full(offset + int(np.prod(storage)), np.nan)
    item = buffer.itemsize
    np.lib.stride_tricks.as_strided(buffer[offset:], values.shape,
                                    tuple(st_ * item for st_ in strides))[...] = values
    return buffer, (offset, *strides)


def _conv_views_both(geom, dtype, x_layout, dy_layout, seed):
    """Each backend's kernels on x and dy stored per the layouts (x_view / dy_view) against
    the reference on compact copies."""
    n, h, w, c, kh, kw, cout, stride, pad = geom
    ho, wo = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h, w, c))
    wt = rng.standard_normal(kh * kw * c * cout)
    dy = rng.standard_normal((n, ho, wo, cout))
    (xbuf, x_view), (dybuf, dy_view) = _strided(x, x_layout), _strided(dy, dy_layout)
    want = []
    bx, bw, bdy = put(ref, x, "float64"), put(ref, wt, "float64"), put(ref, dy, "float64")
    outs = [ref.Array(size, "float64") for size in (dy.size, wt.size, x.size)]
    ref.conv2d_forward(bx, bw, outs[0], *geom)
    ref.conv2d_weight_grad(bx, bdy, outs[1], *geom)
    ref.conv2d_input_grad(bdy, bw, outs[2], *geom)
    bias = rng.standard_normal(cout)
    want = [flat(ref, arr) for arr in outs]
    want.append((want[0].reshape(-1, cout) + bias).reshape(-1))
    for backend, dt in ((cpu, dtype), (ref, "float64")):
        bx, bw, bdy = put(backend, xbuf, dt), put(backend, wt, dt), put(backend, dybuf, dt)
        outs = [backend.Array(size, dt) for size in (dy.size, wt.size, x.size, dy.size)]
        for arr in outs:
            backend.fill(arr, np.nan)
        backend.conv2d_forward(bx, bw, outs[0], *geom, x_view=x_view)
        backend.conv2d_weight_grad(bx, bdy, outs[1], *geom, x_view=x_view, dy_view=dy_view)
        backend.conv2d_input_grad(bdy, bw, outs[2], *geom, dy_view=dy_view)
        backend.conv2d_forward_bias(bx, bw, put(backend, bias, dt), outs[3], *geom,
                                    x_view=x_view)
        k = kh * kw * c
        for arr, expected, scale in zip(outs, want, (k, n * ho * wo, k, k), strict=True):
            assert_close(flat(backend, arr), expected, dt, scale=scale ** 0.5)


@settings(max_examples=40, deadline=None)
@given(geom=conv_cases(), dtype=st.sampled_from(["float32", "float64"]),
       isa=st.sampled_from(ISAS), threads=st.sampled_from([1, 2]), x_layout=layouts(),
       dy_layout=layouts())
def test_conv_kernels_read_strided_operands(geom, dtype, isa, threads, x_layout, dy_layout):
    cpu._set_isa(isa)
    cpu.set_num_threads(threads)
    _conv_views_both(geom, dtype, x_layout, dy_layout, seed=sum(geom))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("geom", RESNET9_CONVS)
def test_conv_kernels_read_nchw_operands_on_resnet9_layers(geom, isa):
    """nn.Conv's case: the NCHW input and output gradient read as NHWC views."""
    cpu._set_isa(isa)
    cpu.set_num_threads(2)
    nchw = ((0, 3, 1, 2), 0, 0)
    _conv_views_both(geom, "float32", nchw, nchw, seed=5)


def test_conv_kernels_refuse_bad_views():
    assert cpu.conv2d_takes_views and ref.conv2d_takes_views
    x, w, out = cpu.Array(32), cpu.Array(18), cpu.Array(16)
    geom = (1, 4, 4, 2, 3, 3, 1, 1, 1)
    with pytest.raises(ValueError, match=r"conv2d_forward: x_view must be \(offset, and four "
                                         r"strides\), all >= 0, got \(0, 1, 2\)"):
        cpu.conv2d_forward(x, w, out, *geom, x_view=(0, 1, 2))
    with pytest.raises(ValueError, match="x_view must be .* got \\(0, 32, 8, 2, -1\\)"):
        cpu.conv2d_forward(x, w, out, *geom, x_view=(0, 32, 8, 2, -1))
    # offset 1 with compact strides reads element 32 of a 32-element buffer
    with pytest.raises(ValueError, match="conv2d_forward: x_view reads past its buffer, "
                                         "expected its last element below 32, got 32"):
        cpu.conv2d_forward(x, w, out, *geom, x_view=(1, 32, 8, 2, 1))
    with pytest.raises(ValueError, match="conv2d_input_grad: dy_view reads past"):
        cpu.conv2d_input_grad(cpu.Array(16), w, x, *geom, dy_view=(0, 16, 4, 2, 1))
    with pytest.raises(ValueError, match="conv2d_weight_grad: dy_view must be"):
        cpu.conv2d_weight_grad(x, cpu.Array(16), w, *geom, dy_view="0,1,2,3,4")
    # N = 1: its stride is never used, so any value is accepted
    cpu.conv2d_forward(x, w, out, *geom, x_view=(0, 10**9, 8, 2, 1))
    with pytest.raises(ValueError, match="does not lie inside"):
        ref.conv2d_forward(ref.Array(32), ref.Array(18), ref.Array(16), *geom,
                           x_view=(1, 32, 8, 2, 1))


def test_conv_forward_bias_refuses_bad_bias():
    x, w, out = cpu.Array(32), cpu.Array(18 * 3), cpu.Array(16 * 3)
    geom = (1, 4, 4, 2, 3, 3, 3, 1, 1)
    with pytest.raises(ValueError, match="conv2d_forward_bias: bias too small, expected at "
                                         "least 3 elements, got 2"):
        cpu.conv2d_forward_bias(x, w, cpu.Array(2), out, *geom)
    with pytest.raises(TypeError, match="conv2d_forward_bias: dtypes differ, expected "
                                        "float32, got float64"):
        cpu.conv2d_forward_bias(x, w, cpu.Array(3, "float64"), out, *geom)
    with pytest.raises(ValueError, match="conv2d_forward_bias: out must not share memory"):
        cpu.conv2d_forward_bias(x, w, out, out, *geom)


def test_conv_kernels_refuse_bad_input():
    a = cpu.Array(4 * 4 * 2)
    with pytest.raises(ValueError, match="conv2d_forward: expected sizes >= 1"):
        cpu.conv2d_forward(a, cpu.Array(9), cpu.Array(16), 1, 4, 4, 2, 5, 5, 1, 1, 0)
    with pytest.raises(ValueError, match="conv2d_forward: w too small"):
        cpu.conv2d_forward(a, cpu.Array(3), cpu.Array(16), 1, 4, 4, 2, 3, 3, 1, 1, 1)
    with pytest.raises(ValueError, match="float16"):
        cpu.conv2d_weight_grad(cpu.Array(32, "float16"), cpu.Array(16, "float16"),
                               cpu.Array(18, "float16"), 1, 4, 4, 2, 3, 3, 1, 1, 1)
    with pytest.raises(TypeError, match="dtypes differ"):
        cpu.conv2d_input_grad(cpu.Array(16, "float64"), cpu.Array(18), a, 1, 4, 4, 2, 3, 3, 1,
                              1, 1)
    with pytest.raises(ValueError, match="share memory"):
        cpu.conv2d_forward(a, cpu.Array(18), a, 1, 4, 4, 2, 3, 3, 1, 1, 1)


# ---- LSTM cell -----------------------------------------------------------------------------

def _lstm_both(batch, hidden, dtype, with_bias, seed):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(batch * 4 * hidden) * 3  # saturating gates too
    bias = rng.standard_normal(4 * hidden)
    c = rng.standard_normal(batch * hidden)
    dh, dc = rng.standard_normal(batch * hidden), rng.standard_normal(batch * hidden)
    results = {}
    for backend, dt in ((cpu, dtype), (ref, "float64")):
        outs = [backend.Array(size, dt) for size in
                (batch * hidden, batch * hidden, batch * 4 * hidden, batch * hidden)]
        backend.lstm_cell_forward(put(backend, z, dt), put(backend, bias, dt) if with_bias
                                  else None, put(backend, c, dt), *outs, batch, hidden)
        grads = [backend.Array(batch * 4 * hidden, dt), backend.Array(batch * hidden, dt)]
        backend.lstm_cell_backward(outs[2], outs[3], put(backend, c, dt), put(backend, dh, dt),
                                   put(backend, dc, dt), *grads, batch, hidden)
        results[backend] = [flat(backend, a) for a in outs + grads]
    for got, want in zip(results[cpu], results[ref], strict=True):
        assert_close(got, want, dtype)
    # the reference itself against the textbook formulas
    pre = (z.reshape(batch, 4, hidden) + (bias.reshape(1, 4, hidden) if with_bias else 0))
    sig = 1 / (1 + np.exp(-pre))
    c2 = sig[:, 1] * c.reshape(batch, hidden) + sig[:, 0] * np.tanh(pre[:, 2])
    np.testing.assert_allclose(results[ref][1], c2.reshape(-1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(results[ref][0], (sig[:, 3] * np.tanh(c2)).reshape(-1),
                               rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 20), hidden=st.integers(1, 70),
       dtype=st.sampled_from(["float32", "float64"]), with_bias=st.booleans(),
       isa=st.sampled_from(ISAS))
def test_lstm_cell_kernels_match_reference(batch, hidden, dtype, with_bias, isa):
    cpu._set_isa(isa)
    _lstm_both(batch, hidden, dtype, with_bias, seed=batch * 100 + hidden)


def _lstm_with_rows_added(backend, dt, z, bias, c, dh, dc, rows, d_rows, offsets, batch,
                          hidden):
    """The gate kernels with ``z_add``/``dh_add`` (a step's rows of ``rows``/``d_rows``),
    and the same kernels on the sums formed first in ``dt``; every output, flat."""
    runs = []
    for in_place in (True, False):
        if in_place:
            extra_f = (put(backend, rows, dt), offsets[0])
            extra_b = (put(backend, d_rows, dt), offsets[1])
            z_in, dh_in = z, dh
        else:
            extra_f = extra_b = ()
            n_z, n_h = batch * 4 * hidden, batch * hidden
            z_in = rows.astype(dt)[offsets[0]:offsets[0] + n_z] + z.astype(dt)
            dh_in = d_rows.astype(dt)[offsets[1]:offsets[1] + n_h] + dh.astype(dt)
        outs = [backend.Array(size, dt) for size in
                (batch * hidden, batch * hidden, batch * 4 * hidden, batch * hidden)]
        backend.lstm_cell_forward(put(backend, z_in, dt), put(backend, bias, dt),
                                  put(backend, c, dt), *outs, batch, hidden, *extra_f)
        grads = [backend.Array(batch * 4 * hidden, dt), backend.Array(batch * hidden, dt)]
        backend.lstm_cell_backward(outs[2], outs[3], put(backend, c, dt),
                                   put(backend, dh_in, dt), put(backend, dc, dt), *grads,
                                   batch, hidden, *extra_b)
        runs.append([flat(backend, a) for a in outs + grads])
    return runs


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 12), hidden=st.integers(1, 40), steps=st.integers(1, 4),
       dtype=st.sampled_from(["float32", "float64"]), isa=st.sampled_from(ISAS))
def test_lstm_cell_kernels_add_one_step_of_rows_in_place(batch, hidden, steps, dtype, isa):
    # lstm_layer hands the gate kernels step t's rows of the whole sequence's input
    # projection (and of the output gradient) instead of copying them out and adding: the
    # kernels must give bitwise what the separate addition gave, on both backends
    cpu._set_isa(isa)
    rng = np.random.default_rng(batch * 1000 + hidden * 10 + steps)
    z = rng.standard_normal(batch * 4 * hidden) * 2
    bias = rng.standard_normal(4 * hidden)
    c, dh, dc = (rng.standard_normal(batch * hidden) for _ in range(3))
    rows = rng.standard_normal(steps * batch * 4 * hidden) * 2
    d_rows = rng.standard_normal(steps * batch * hidden)
    t = steps - 1  # the last step: its rows end at the end of the buffer
    offsets = (t * batch * 4 * hidden, t * batch * hidden)
    results = {}
    for backend, dt in ((cpu, dtype), (ref, "float64")):
        in_place, separate = _lstm_with_rows_added(backend, dt, z, bias, c, dh, dc, rows,
                                                   d_rows, offsets, batch, hidden)
        for got, want in zip(in_place, separate, strict=True):
            np.testing.assert_array_equal(got, want)
        results[backend] = in_place
    for got, want in zip(results[cpu], results[ref], strict=True):
        assert_close(got, want, dtype)


def test_lstm_cell_kernels_refuse_bad_rows_to_add():
    batch, hidden = 2, 3  # z and gates hold 24 elements, the state 6
    for backend in (cpu, ref):
        z, c, dh, dc = (backend.Array(n) for n in (24, 6, 6, 6))
        outs = [backend.Array(n) for n in (6, 6, 24, 6)]
        with pytest.raises(ValueError, match="lstm_cell_forward: z_add too small, expected 24 "
                                             "elements from offset 7, got a buffer of 30"):
            backend.lstm_cell_forward(z, None, c, *outs, batch, hidden, backend.Array(30), 7)
        with pytest.raises(ValueError, match="lstm_cell_backward: dh_add too small"):
            backend.lstm_cell_backward(outs[2], outs[3], c, dh, dc, backend.Array(24),
                                       backend.Array(6), batch, hidden, backend.Array(6), -1)
    z, c = cpu.Array(24), cpu.Array(6)
    outs = [cpu.Array(n) for n in (6, 6, 24, 6)]
    with pytest.raises(TypeError, match="lstm_cell_forward: dtypes differ"):
        cpu.lstm_cell_forward(z, None, c, *outs, batch, hidden, cpu.Array(24, "float64"), 0)
    with pytest.raises(ValueError, match="z_add must not share memory with an output"):
        cpu.lstm_cell_forward(z, None, c, *outs, batch, hidden, outs[2], 0)


def test_lstm_cell_kernels_refuse_bad_input():
    z = cpu.Array(8)
    with pytest.raises(ValueError, match="lstm_cell_forward: c too small"):
        cpu.lstm_cell_forward(z, None, cpu.Array(1), cpu.Array(2), cpu.Array(2), cpu.Array(8),
                              cpu.Array(2), 1, 2)
    with pytest.raises(ValueError, match="lstm_cell_backward: expected float32 or float64"):
        half = [cpu.Array(8, "float16")] * 7
        cpu.lstm_cell_backward(*half, 1, 2)


# ---- batch normalisation ---------------------------------------------------------------------

def _batch_norm_both(n, c, s, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n * c * s) * 4 + 3  # a mean far from zero: the centring matters
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    dy = rng.standard_normal(n * c * s)
    results = {}
    for backend, dt in ((cpu, dtype), (ref, "float64")):
        stats = [backend.Array(c, dt) for _ in range(3)]
        y = backend.Array(n * c * s, dt)
        xa, wa = put(backend, x, dt), put(backend, w, dt)
        backend.batch_norm_forward(xa, wa, put(backend, b, dt), y, *stats, n, c, s, 1e-5)
        grads = [backend.Array(n * c * s, dt), backend.Array(c, dt), backend.Array(c, dt)]
        backend.batch_norm_backward(put(backend, dy, dt), xa, wa, stats[0], stats[2], *grads,
                                    n, c, s)
        results[backend] = [flat(backend, a) for a in [y] + stats + grads]
    xs = x.reshape(n, c, s)
    mean, var = xs.mean(axis=(0, 2)), xs.var(axis=(0, 2))
    for i, (got, want) in enumerate(zip(results[cpu], results[ref], strict=True)):
        if i != 4:
            assert_close(got, want, dtype, scale=float(n * s))
    # dx = w rstd (dy - mean(dy) - xhat mean(dy xhat)) cancels: with few values per channel
    # the bracket is a small difference of terms of size |dy|, and one rounding of x (eps |x|)
    # moves xhat by eps |x| rstd, so dx's error grows like eps w |x| |dy| / (var + eps_bn).
    # Two values 0.1 apart (var 0.0028) lose ~3e-4 in float32: beyond the plain bound.
    cond = (np.abs(w) * np.abs(xs).max(axis=(0, 2))
            * np.abs(dy.reshape(n, c, s)).max(axis=(0, 2)) / (var + 1e-5))
    got, want = np.asarray(results[cpu][4], np.float64), np.asarray(results[ref][4])
    plain = TOL[dtype] * max(float(n * s), float(np.abs(want).max(initial=0.0)), 1.0)
    bound = plain + 8 * float(np.finfo(dtype).eps) * cond[None, :, None]
    err = np.abs(got - want).reshape(n, c, s)
    assert np.all(err <= bound), f"dx: max error {np.max(err / bound):.3g} x its bound"
    xhat = (xs - mean[None, :, None]) / np.sqrt(var[None, :, None] + 1e-5)
    y_ref = w[None, :, None] * xhat + b[None, :, None]
    np.testing.assert_allclose(results[ref][0], y_ref.reshape(-1), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(results[ref][1], mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(results[ref][2], var, rtol=1e-10, atol=1e-12)
    g = dy.reshape(n, c, s)
    np.testing.assert_allclose(results[ref][6], g.sum(axis=(0, 2)), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(results[ref][5], (g * xhat).sum(axis=(0, 2)), rtol=1e-9,
                               atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), c=st.integers(1, 40), s=st.sampled_from([1, 2, 7, 16, 33]),
       dtype=st.sampled_from(["float32", "float64"]), isa=st.sampled_from(ISAS),
       threads=st.sampled_from([1, 2]))
def test_batch_norm_kernels_match_reference(n, c, s, dtype, isa, threads):
    cpu._set_isa(isa)
    cpu.set_num_threads(threads)
    _batch_norm_both(n, c, s, dtype, seed=n * 1000 + c * 10 + s)


@pytest.mark.parametrize("n,c,s", [(128, 16, 1024), (100000, 3, 1)],
                         ids=["resnet9-layer", "long-rows"])
def test_batch_norm_kernels_on_threads_equal_one_thread(n, c, s):
    """Large enough for the parallel path: each channel is summed by one thread in a fixed
    order, so 1 and 2 threads give the same bits."""
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal(n * c * s), rng.standard_normal(n * c * s)
    outs = []
    for threads in (1, 2):
        cpu.set_num_threads(threads)
        stats = [cpu.Array(c) for _ in range(3)]
        y, xa, wa = cpu.Array(n * c * s), put(cpu, x, "float32"), put(cpu, np.ones(c), "float32")
        cpu.batch_norm_forward(xa, wa, put(cpu, np.zeros(c), "float32"), y, *stats, n, c, s,
                               1e-5)
        grads = [cpu.Array(n * c * s), cpu.Array(c), cpu.Array(c)]
        cpu.batch_norm_backward(put(cpu, dy, "float32"), xa, wa, stats[0], stats[2], *grads,
                                n, c, s)
        outs.append([flat(cpu, a) for a in [y] + stats + grads])
    for one, two in zip(*outs, strict=True):
        np.testing.assert_array_equal(one, two)


def test_batch_norm_kernels_refuse_bad_input():
    # the refusals every backend shares (cuda_checks.py), in the C++ bindings' classes
    check_batch_norm_refusals(cpu, {"size": ValueError, "dtype": ValueError,
                                    "mixed": TypeError})
    a = [cpu.Array(8) for _ in range(7)]
    with pytest.raises(ValueError, match="fits in 64 bits"):
        cpu.batch_norm_forward(*a, 2**40, 2**40, 2**40, 1e-5)


# ---- softmax cross-entropy -------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), k=st.sampled_from([1, 2, 7, 16, 33, 200]),
       dtype=st.sampled_from(["float32", "float64"]), isa=st.sampled_from(ISAS),
       threads=st.sampled_from([1, 2]), spread=st.sampled_from([1.0, 30.0]))
def test_softmax_xent_kernels_match_reference(n, k, dtype, isa, threads, spread):
    cpu._set_isa(isa)
    cpu.set_num_threads(threads)
    rng = np.random.default_rng(n * 1000 + k)
    z = rng.standard_normal(n * k) * spread  # spread 30: exp under- and overflows unshifted
    y = rng.integers(0, k, n).astype(np.float64)
    g = rng.standard_normal(n)
    results = {}
    for backend, dt in ((cpu, dtype), (ref, "float64")):
        za, ya = put(backend, z, dt), put(backend, y, dt)
        loss, lse, dz = backend.Array(n, dt), backend.Array(n, dt), backend.Array(n * k, dt)
        backend.softmax_xent_forward(za, ya, loss, lse, n, k)
        backend.softmax_xent_backward(za, ya, lse, put(backend, g, dt), dz, n, k)
        results[backend] = [flat(backend, a) for a in (loss, lse, dz)]
    for got, want in zip(results[cpu], results[ref], strict=True):
        assert_close(got, want, dtype, scale=spread)
    # the reference against the textbook formulas
    zs = z.reshape(n, k)
    lse = np.log(np.exp(zs - zs.max(axis=1, keepdims=True)).sum(axis=1)) + zs.max(axis=1)
    np.testing.assert_allclose(results[ref][1], lse, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(results[ref][0], lse - zs[np.arange(n), y.astype(int)],
                               rtol=1e-12, atol=1e-10)
    soft = np.exp(zs - lse[:, None])
    soft[np.arange(n), y.astype(int)] -= 1
    np.testing.assert_allclose(results[ref][2], (soft * g[:, None]).reshape(-1), rtol=1e-10,
                               atol=1e-12)


def test_softmax_xent_kernels_refuse_bad_labels_and_sizes():
    z, loss, lse = put(cpu, np.zeros(6), "float32"), cpu.Array(2), cpu.Array(2)
    for bad, name in ((3.0, "3.0"), (-1.0, "-1.0"), (1.5, "1.5"), (float("nan"), "nan")):
        labels = put(cpu, np.array([0.0, bad]), "float32")
        with pytest.raises(IndexError, match=f"label out of range at row 1, expected an "
                                             f"integer in \\[0, 3\\), got {name}"):
            cpu.softmax_xent_forward(z, labels, loss, lse, 2, 3)
        with pytest.raises(IndexError, match="at row 1"):
            ref.softmax_xent_forward(put(ref, np.zeros(6), "float32"),
                                     put(ref, np.array([0.0, bad]), "float32"),
                                     ref.Array(2), ref.Array(2), 2, 3)
    ok = put(cpu, np.array([0.0, 2.0]), "float32")
    with pytest.raises(ValueError, match="z too small"):
        cpu.softmax_xent_forward(z, ok, loss, lse, 2, 4)
    with pytest.raises(ValueError, match="fits in 64 bits"):
        cpu.softmax_xent_backward(z, ok, lse, loss, cpu.Array(6), 2**40, 2**40)
    with pytest.raises(ValueError, match="share memory"):
        cpu.softmax_xent_backward(z, ok, lse, loss, z, 2, 3)
    with pytest.raises(TypeError, match="dtypes differ"):
        cpu.softmax_xent_forward(z, put(cpu, np.zeros(2), "float64"), loss, lse, 2, 3)


# ---- elementwise outputs large enough for streaming stores (>= 16 MiB) ----------------------

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_large_elementwise_outputs_match_reference(dtype, threads):
    cpu.set_num_threads(threads)
    n = (16 << 20) // np.dtype(dtype).itemsize * 2 + 37  # 32 MiB + a ragged tail
    rng = np.random.default_rng(8)
    a, b = rng.uniform(-3, 3, n), rng.uniform(-3, 3, n)
    for isa in ISAS:
        cpu._set_isa(isa)
        ca, cb, out = put(cpu, a, dtype), put(cpu, b, dtype), cpu.Array(n, dtype)
        a32, b32 = a.astype(dtype), b.astype(dtype)
        cpu.ewise_add(ca, cb, out)
        np.testing.assert_array_equal(flat(cpu, out), a32 + b32)
        cpu.scalar_rsub(ca, 0.5, out)
        np.testing.assert_array_equal(flat(cpu, out), np.asarray(0.5, dtype) - a32)
        cpu.ewise_tanh(ca, out)
        assert_close(flat(cpu, out), np.tanh(a32.astype(np.float64)), dtype)


# ---- elementwise programs in place ---------------------------------------------------------
# n: one element, either side of a 256-element block, several blocks, and enough for threads
@pytest.mark.parametrize("n", (1, 255, 257, 4099, 300_001))
@pytest.mark.parametrize("dtype", ("float32", "float64"))
@pytest.mark.parametrize("isa", ISAS)
def test_ewise_program_runs_in_place_where_every_read_comes_first(isa, dtype, n):
    cpu._set_isa(isa)
    cpu.set_num_threads(2)
    check_ewise_program_in_place(cpu, dtype, n)
    check_ewise_program_in_place(ref, dtype, n)  # the reference takes the same programs


# ---- many launches of one program in one call ------------------------------------------------
def test_ewise_program_many_equals_one_call_per_launch_in_order():
    """``ewise_program_many`` runs its launches in order, each bitwise one ``ewise_program``
    call (here the reference backend's): sizes either side of a block, two launches updating
    one buffer in turn, an empty launch list."""
    from needle.optim import _sgd_program

    prog = _sgd_program(True, True, True)  # ins θ, g, u; outs u, θ (in place)
    scalars = [0.1, 0.01, 0.9, 0.1]
    rng = np.random.default_rng(3)
    sizes = (1, 257, 4099, 257)
    values = [[rng.standard_normal(n).astype("float32") for _ in range(3)] for n in sizes]
    arrays = [[put(cpu, v, "float32") for v in vs] for vs in values]
    # the fourth launch updates the second's θ and u again, with another gradient: the
    # momentum makes the order of the two visible
    arrays[3] = [arrays[1][0], arrays[3][1], arrays[1][2]]
    launches = [([t, g, u], [u, t], n) for (t, g, u), n in zip(arrays, sizes, strict=True)]
    cpu.ewise_program_many(launches, prog.code, scalars)
    cpu.ewise_program_many([], prog.code, scalars)  # nothing to do
    want = []
    for vs in values:
        want.append([ref.Array(v.size, "float32") for v in vs])
        for a, v in zip(want[-1], vs, strict=True):
            ref.from_numpy(v, a)
    want[3] = [want[1][0], want[3][1], want[1][2]]
    for (t, g, u), n in zip(want, sizes, strict=True):
        ref.ewise_program([t, g, u], [u, t], prog.code, scalars, n)
    for k in range(3):
        for got, expect in zip(arrays[k], want[k], strict=True):
            np.testing.assert_array_equal(flat(cpu, got), expect.array)


def test_ewise_program_many_checks_every_launch_before_running_any():
    """A bad launch anywhere is refused naming its index, before the first launch writes;
    malformed launches are TypeErrors naming the function."""
    from needle.optim import _sgd_program

    prog = _sgd_program(False, False, False)  # ins θ, g; out θ - lr·g
    theta, g = put(cpu, np.ones(8), "float32"), put(cpu, np.ones(8), "float32")
    small = put(cpu, np.ones(4), "float32")
    wide = put(cpu, np.ones(8), "float64")
    for bad, what in (([small, g], "at least 8 elements"),
                      ([theta, wide], "must be float32")):
        with pytest.raises(ValueError, match=rf"{what}.*\(launch 1\)"):
            cpu.ewise_program_many([([theta, g], [theta], 8), (bad, [theta], 8)], prog.code,
                                   [0.5])
        np.testing.assert_array_equal(flat(cpu, theta), np.ones(8))
    # a late read of the overwritten input: refused for the launch that aliases it
    late_read = [0, 0, 0, 0, 0, 3, 2, 1, 0, 0, 1, 0, 0, 1, 0, 3, 0, 2, 0, 1, 1, 0, 1, 2, 0]
    other = put(cpu, np.zeros(8), "float32")
    with pytest.raises(ValueError, match=r"reads that input after storing.*\(launch 1\)"):
        cpu.ewise_program_many([([theta], [other, g], 8), ([theta], [theta, other], 8)],
                               late_read, [2.0, 1.0])
    np.testing.assert_array_equal(flat(cpu, other), np.zeros(8))
    with pytest.raises(TypeError, match="ewise_program_many: expected launch 0 as a tuple"):
        cpu.ewise_program_many([[[theta, g], [theta], 8]], prog.code, [0.5])
    with pytest.raises(TypeError, match="ewise_program_many: expected launch 0 as a tuple"):
        cpu.ewise_program_many([([theta, g], [theta])], prog.code, [0.5])
    with pytest.raises(TypeError, match="ewise_program_many: expected Arrays"):
        cpu.ewise_program_many([([theta, 1.0], [theta], 8)], prog.code, [0.5])
    with pytest.raises(TypeError, match="ewise_program_many: expected arguments"):
        cpu.ewise_program_many([], prog.code)
