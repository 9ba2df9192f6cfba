"""NDArray on every device against NumPy: views, compact, setitem, ops, reductions, dtypes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import needle.backend_ndarray as nd
from needle._core.errors import (
    AxisError,
    DeviceError,
    DTypeError,
    IndexOutOfRange,
    NeedleError,
    ShapeError,
)

DTYPES = ["float32", "float64", "float16"]
TOL = {"float32": 1e-5, "float64": 1e-12, "float16": 2e-3}


def _close(got: nd.NDArray, want: np.ndarray, dtype="float32", scale=1.0):
    assert got.dtype == dtype
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy().astype(np.float64), want.astype(np.float64),
                               rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10 * scale)


def _rand(rng, shape, dtype="float32"):
    return rng.standard_normal(shape).astype(dtype)


# ---- construction, devices ----------------------------------------------------------------
def test_device_names_and_equality():
    assert str(nd.cpu()) == "cpu()" and repr(nd.cpu_numpy()) == "cpu_numpy()"
    assert str(nd.cuda()) == "cuda()"
    assert nd.cpu_numpy() == nd.cpu_numpy() and nd.cpu() != nd.cpu_numpy()
    assert nd.default_device() in nd.all_devices()


def test_cuda_device_never_raises_until_used():
    from needle._core.errors import BackendUnavailable
    dev = nd.cuda()  # must not raise, GPU or not
    if dev.enabled():
        assert nd.array([1.0], device=dev).numpy().tolist() == [1.0]
    else:
        assert dev not in nd.all_devices()
        with pytest.raises(BackendUnavailable, match=r"cuda\(\)"):
            nd.array([1.0], device=dev)


def test_unknown_device_and_dtype_raise():
    with pytest.raises(DeviceError, match="unknown device"):
        nd.device_by_name("tpu")
    with pytest.raises(DTypeError, match="unknown dtype"):
        nd.array([1.0], dtype="floot32", device=nd.cpu_numpy())


def test_course_dtype_coercion(device):
    assert nd.array(np.arange(3), device=device).dtype == "float32"
    assert nd.array(np.ones(3, dtype=bool), device=device).dtype == "float32"
    assert nd.array(np.ones(3, dtype=np.float64), device=device).dtype == "float32"
    assert nd.array([1, 2], dtype=None, device=device).dtype == "float32"
    for dtype in DTYPES:
        a = nd.array([1.5, 2.5], dtype=dtype, device=device)
        assert a.dtype == dtype and a.numpy().dtype == np.dtype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_and_fill(device, dtype):
    rng = np.random.default_rng(0)
    x = _rand(rng, (3, 4, 5), dtype)
    a = nd.array(x, dtype=dtype, device=device)
    np.testing.assert_array_equal(a.numpy(), x)
    a.fill(2.5)
    np.testing.assert_array_equal(a.numpy(), np.full((3, 4, 5), 2.5, dtype))
    assert a._handle.ptr() % 256 == 0


def test_copy_constructor_copies(device):
    a = nd.array([1.0, 2.0], device=device)
    b = nd.NDArray(a)
    assert b._handle.ptr() != a._handle.ptr()
    b[0] = 9.0
    assert a.numpy()[0] == 1.0


# ---- views ---------------------------------------------------------------------------------
def test_view_ops_share_buffer(device):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    a = nd.array(x, device=device)
    views = {
        "reshape": (a.reshape((4, 6)), x.reshape(4, 6)),
        "reshape-1": (a.reshape((-1, 2)), x.reshape(-1, 2)),
        "permute": (a.permute((2, 0, 1)), x.transpose(2, 0, 1)),
        "broadcast": (a.reshape((2, 3, 4, 1)).broadcast_to((2, 3, 4, 5)),
                      np.broadcast_to(x.reshape(2, 3, 4, 1), (2, 3, 4, 5))),
        "getitem": (a[1, 0:3:2, 1:], x[1:2, 0:3:2, 1:]),
        "flat": (a.flat, x.reshape(-1)),
    }
    for name, (view, want) in views.items():
        assert view._handle.ptr() == a._handle.ptr(), name
        assert view.shape == want.shape, name
        np.testing.assert_array_equal(view.numpy(), want, err_msg=name)
    assert a.permute((2, 0, 1)).strides == tuple(s // 4 for s in x.transpose(2, 0, 1).strides)
    assert a[1, 0:3:2, 1:].strides == (12, 8, 1)


def test_getitem_int_keeps_dim_and_negative_steps(device):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = nd.array(x, device=device)
    assert a[1, 0].shape == (1, 1)
    np.testing.assert_array_equal(a[::-1, ::-2].numpy(), x[::-1, ::-2])
    np.testing.assert_array_equal(a[-1].numpy(), x[-1:])
    assert a.process_slice(slice(None, -1, None), 1) == slice(0, 3, 1)


def test_flat_perturbation_in_place(device):
    a = nd.array(np.zeros((2, 2)), device=device)
    flat = a.flat
    flat[3] = 5.0
    assert a.numpy()[1, 1] == 5.0


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_compact_of_random_views_matches_numpy(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    slices = tuple(
        slice(data.draw(st.integers(0, n - 1)), None, data.draw(st.sampled_from([1, 2, -1])))
        for n in shape)
    for device in nd.all_devices():
        view = nd.array(x, device=device).permute(perm)[slices]
        want = x.transpose(perm)[slices]
        got = view.compact()
        assert got.is_compact()
        np.testing.assert_array_equal(got.numpy(), want)


def test_add_in_place_of_a_broadcast_row(device):
    """A fused op's ``y += b`` (ops.linear's bias): into y's own buffer, b of any layout;
    a view, another dtype or another shape is refused naming the op."""
    rng = np.random.default_rng(0)
    y_np, b_np = _rand(rng, (4, 3)), _rand(rng, (1, 3))
    y = nd.array(y_np, device=device)
    ptr = y._handle.ptr()
    y._add_in_place(nd.array(b_np, device=device).broadcast_to((4, 3)))
    np.testing.assert_array_equal(y.numpy(), y_np + b_np)  # the same float32 additions
    assert y._handle.ptr() == ptr
    with pytest.raises(ShapeError, match="add: expected a compact array"):
        y.permute((1, 0))._add_in_place(nd.array(np.ones((3, 4)), device=device))
    with pytest.raises(ShapeError, match="add"):
        y._add_in_place(nd.array(np.ones((4, 4)), device=device))
    with pytest.raises(DTypeError, match="add"):
        y._add_in_place(nd.array(np.ones((4, 3)), dtype="float64", device=device))


def test_add_in_place_reads_a_broadcast_row_without_copying_it(device, monkeypatch):
    # ops.linear's bias: the backend's ewise_add_rows adds the row itself; the broadcast
    # (batch x features elements) is never compacted. A row at an offset, or any other
    # layout, is still copied first, with the same sums.
    rng = np.random.default_rng(3)
    y_np, rows = _rand(rng, (2, 4, 3)), _rand(rng, (2, 3))
    y = nd.array(y_np, device=device)
    first = nd.array(rows[0], device=device).broadcast_to((2, 4, 3))
    second = nd.array(rows, device=device)[1:2, :].as_strided((2, 4, 3), (0, 0, 1))  # offset 3
    copies = []
    real_copy = nd.NDArray._copy
    monkeypatch.setattr(nd.NDArray, "_copy", lambda self, op="compact": copies.append(op)
                        or real_copy(self, op))
    y._add_in_place(first)
    np.testing.assert_array_equal(y.numpy(), y_np + rows[0])
    assert copies == []
    y._add_in_place(second)
    np.testing.assert_array_equal(y.numpy(), (y_np + rows[0]) + rows[1])
    assert copies == ["add"]


@pytest.mark.parametrize("row_shape", [(3,), (1, 3), (1, 1, 3)])
def test_add_row_in_place_adds_a_bias_row_to_every_row(device, row_shape, monkeypatch):
    """ops.linear's bias from its row: (n,) or (1, ..., n), into y's own buffer, bitwise
    y + b; the same sums through the broadcast where the backend has no ewise_add_rows or
    the row is a view; a row of another length or more axes, or another dtype, is refused."""
    rng = np.random.default_rng(4)
    y_np, b_np = _rand(rng, (2, 4, 3)), _rand(rng, row_shape)
    want = y_np + b_np
    y = nd.array(y_np, device=device)
    ptr = y._handle.ptr()
    y._add_row_in_place(nd.array(b_np, device=device))
    np.testing.assert_array_equal(y.numpy(), want)
    assert y._handle.ptr() == ptr
    wide = nd.array(np.concatenate([b_np.reshape(3), b_np.reshape(3)]), device=device)
    y = nd.array(y_np, device=device)
    y._add_row_in_place(wide[0:3].reshape(row_shape) if row_shape != (3,) else wide[3:6])
    np.testing.assert_array_equal(y.numpy(), want)  # a row at an offset: the broadcast path
    monkeypatch.setattr(device.mod, "ewise_add_rows", None, raising=False)
    y = nd.array(y_np, device=device)
    y._add_row_in_place(nd.array(b_np, device=device))
    np.testing.assert_array_equal(y.numpy(), want)
    with pytest.raises(ShapeError, match="add: expected a row of 3 values"):
        y._add_row_in_place(nd.array(np.ones(4), device=device))
    with pytest.raises(ShapeError, match="add: expected a row of 3 values"):
        y._add_row_in_place(nd.array(np.ones((1, 1, 1, 3)), device=device))
    with pytest.raises(ShapeError, match="add: expected a row of 3 values"):
        y._add_row_in_place(nd.array(np.ones((3, 1)), device=device))
    with pytest.raises(DTypeError, match="add"):
        y._add_row_in_place(nd.array(np.ones(3), dtype="float64", device=device))


def test_sums_over_leading_axes_run_one_column_sum_kernel(device, monkeypatch):
    """A compact array summed over its leading axes (a bias gradient), and a dense NHWC
    buffer seen as NCHW summed over N, H, W, are (M, K) column sums: one
    reduce_sum_leading call each, no matmul and no transposing copy."""
    if getattr(device.mod, "reduce_sum_leading", None) is None:
        pytest.skip("backend without reduce_sum_leading (the ones-vector product runs)")
    rng = np.random.default_rng(5)
    x_np = _rand(rng, (6, 4, 3))
    calls = []
    real = device.mod.reduce_sum_leading
    monkeypatch.setattr(device.mod, "reduce_sum_leading",
                        lambda a, out, m, n: calls.append((m, n)) or real(a, out, m, n))
    x = nd.array(x_np, device=device)
    np.testing.assert_allclose(x.sum(axis=(0, 1)).numpy(), x_np.sum(axis=(0, 1)), rtol=1e-5)
    np.testing.assert_allclose(x.sum(axis=0, keepdims=True).numpy(),
                               x_np.sum(axis=0, keepdims=True), rtol=1e-5)
    nchw = x.permute((0, 2, 1))  # channels (3) on axis 1, laid out last
    np.testing.assert_allclose(nchw.sum(axis=(0, 2)).numpy(), x_np.sum(axis=(0, 1)), rtol=1e-5)
    assert calls == [(24, 3), (6, 12), (24, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_setitem_in_place(device, dtype):
    x = np.arange(30, dtype=dtype).reshape(5, 6)
    a = nd.array(x, dtype=dtype, device=device)
    ptr, strides = a._handle.ptr(), a.strides
    a[1:4, ::2] = nd.array(np.ones((3, 3)) * 7, dtype=dtype, device=device)
    a[0, :] = -1.0
    x[1:4, ::2] = 7
    x[0, :] = -1
    np.testing.assert_array_equal(a.numpy(), x)
    assert a._handle.ptr() == ptr and a.strides == strides
    # setitem into a non-compact (permuted) view
    b = a.permute((1, 0))
    b[2:4, 1:3] = 0.5
    x.T[2:4, 1:3] = 0.5
    np.testing.assert_array_equal(a.numpy(), x)


# ---- elementwise -----------------------------------------------------------------------
BINARY = [("add", lambda a, b: a + b), ("sub", lambda a, b: a - b),
          ("mul", lambda a, b: a * b), ("div", lambda a, b: a / b),
          ("pow", lambda a, b: a ** b), ("maximum", lambda a, b: a.maximum(b)),
          ("minimum", lambda a, b: a.minimum(b)), ("eq", lambda a, b: a == b),
          ("ge", lambda a, b: a >= b), ("gt", lambda a, b: a > b),
          ("le", lambda a, b: a <= b), ("lt", lambda a, b: a < b),
          ("ne", lambda a, b: a != b)]
NP_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
             "pow": np.power, "maximum": np.maximum, "minimum": np.minimum,
             "eq": np.equal, "ge": np.greater_equal, "gt": np.greater, "le": np.less_equal,
             "lt": np.less, "ne": np.not_equal}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,fn", BINARY, ids=[b[0] for b in BINARY])
def test_binary_ops_on_views(device, dtype, name, fn):
    rng = np.random.default_rng(1)
    x = np.abs(_rand(rng, (4, 5), dtype)) + 0.5
    y = np.abs(_rand(rng, (5, 4), dtype)) + 0.5
    y[0, :2] = x.T[0, :2]  # some equal elements for the comparisons
    a = nd.array(x, dtype=dtype, device=device)
    b = nd.array(y, dtype=dtype, device=device).permute((1, 0))  # non-compact operand
    want = NP_BINARY[name](x, y.T).astype(dtype)
    _close(fn(a, b), want, dtype, scale=np.abs(want).max() + 1)
    s = 1.25
    _close(fn(a, s), NP_BINARY[name](x, np.asarray(s, dtype)).astype(dtype), dtype,
           scale=10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reflected_scalar_ops(device, dtype):
    x = np.array([[0.5, 1.0], [2.0, 4.0]], dtype=dtype)
    a = nd.array(x, dtype=dtype, device=device)
    _close(3 - a, (3 - x).astype(dtype), dtype)
    _close(3 / a, (3 / x).astype(dtype), dtype, scale=10)
    _close(2 ** a, (2.0 ** x).astype(dtype), dtype, scale=20)
    _close(2 * a + 1, (2 * x + 1).astype(dtype), dtype)
    _close(-a, -x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["log", "exp", "tanh", "sqrt", "abs", "sign", "sigmoid"])
def test_unary_ops(device, dtype, name):
    rng = np.random.default_rng(2)
    x = _rand(rng, (3, 7), dtype)
    if name in ("log", "sqrt"):
        x = np.abs(x) + 0.1
    if name == "sigmoid":
        def ref(v):
            return 1 / (1 + np.exp(-v.astype(np.float64)))
    else:
        ref = getattr(np, name)
    a = nd.array(x, dtype=dtype, device=device).permute((1, 0))
    _close(getattr(a, name)(), ref(x.T).astype(dtype), dtype, scale=10)


def test_mixed_dtype_raises_dtype_error(device):
    a = nd.array([1.0, 2.0], dtype="float32", device=device)
    b = nd.array([1.0, 2.0], dtype="float64", device=device)
    with pytest.raises(DTypeError, match="add: mixed dtypes.*float32.*float64"):
        a + b
    assert (a + b.astype("float32")).dtype == "float32"


def test_ewise_shape_mismatch_raises(device):
    a = nd.array(np.ones((2, 3)), device=device)
    with pytest.raises(ShapeError, match=r"add: shapes differ.*\(2, 3\).*\(3, 2\)"):
        a + nd.array(np.ones((3, 2)), device=device)


def test_devices_mismatch_raises():
    a = nd.array([1.0], device=nd.cpu_numpy())
    other = [d for d in nd.all_devices() if d != nd.cpu_numpy()]
    if not other:
        pytest.skip("only one device here")
    with pytest.raises(DeviceError, match="different devices"):
        a + nd.array([1.0], device=other[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_astype(device, dtype):
    x = np.array([[1.5, -2.25], [3.0, 4.0]], dtype=np.float32)
    a = nd.array(x, device=device).permute((1, 0)).astype(dtype)
    assert a.dtype == dtype
    np.testing.assert_array_equal(a.numpy(), x.T.astype(dtype))


# ---- reductions -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1, (0, 2), (1, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(device, dtype, axis, keepdims):
    rng = np.random.default_rng(3)
    x = _rand(rng, (3, 4, 5), dtype)
    a = nd.array(x, dtype=dtype, device=device)
    for name in ("sum", "max", "min"):
        got = getattr(a, name)(axis=axis, keepdims=keepdims)
        want = getattr(x.astype(np.float64), name)(axis=axis, keepdims=keepdims)
        _close(got, np.asarray(want), dtype, scale=10)


def test_reduction_errors(device):
    a = nd.array(np.ones((2, 3)), device=device)
    with pytest.raises(AxisError, match="sum: axis out of range"):
        a.sum(axis=2)
    with pytest.raises(AxisError, match="repeated axis"):
        a.sum(axis=(1, -1))
    with pytest.raises(ShapeError, match="max: zero-size"):
        nd.array(np.ones((2, 0)), device=device).max(axis=1)
    np.testing.assert_array_equal(nd.array(np.ones((2, 0)), device=device).sum(axis=1).numpy(),
                                  np.zeros(2))


# ---- matmul ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,p", [(1, 1, 1), (7, 5, 3), (16, 16, 16), (65, 33, 17), (64, 128, 32)])
def test_matmul(device, dtype, m, n, p):
    rng = np.random.default_rng(4)
    x, y = _rand(rng, (m, n), dtype), _rand(rng, (p, n), dtype)
    a = nd.array(x, dtype=dtype, device=device)
    b = nd.array(y, dtype=dtype, device=device).permute((1, 0))
    want = x.astype(np.float64) @ y.T.astype(np.float64)
    _close(a @ b, want, dtype, scale=np.sqrt(n) * 10)


@pytest.mark.parametrize("m,n,p", [(8, 8, 8), (16, 32, 24)])
def test_tiled_matmul_path(device, monkeypatch, m, n, p):
    if not hasattr(device.mod, "matmul_tiled"):
        pytest.skip(f"{device} has no matmul_tiled")
    tile = device.__tile_size__
    m, n, p = (max(tile, d // tile * tile) for d in (m, n, p))
    monkeypatch.setattr(nd.ndarray, "USE_TILED_MATMUL", True)
    rng = np.random.default_rng(5)
    x, y = _rand(rng, (m, n)), _rand(rng, (n, p))
    _close(nd.array(x, device=device) @ nd.array(y, device=device), x @ y, scale=10)


def test_batched_and_broadcast_matmul(device):
    rng = np.random.default_rng(6)
    cases = [((6, 6, 5, 4), (4, 3)), ((5, 4), (6, 6, 4, 3)), ((2, 1, 3, 4), (5, 4, 2))]
    for sa, sb in cases:
        x, y = _rand(rng, sa), _rand(rng, sb)
        got = nd.matmul(nd.array(x, device=device), nd.array(y, device=device))
        _close(got, x @ y, scale=10)


def test_matmul_errors(device):
    a = nd.array(np.ones((3, 4)), device=device)
    with pytest.raises(ShapeError, match=r"matmul: inner dimensions differ.*\(3, 4\) @ \(5, 2\)"):
        a @ nd.array(np.ones((5, 2)), device=device)
    with pytest.raises(ShapeError):
        nd.matmul(nd.array(np.ones((2, 3, 4)), device=device),
                  nd.array(np.ones((3, 5, 2)), device=device))


# ---- rearrangements ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_flip_pad_stack_split(device, dtype):
    rng = np.random.default_rng(7)
    x = _rand(rng, (2, 3, 4), dtype)
    a = nd.array(x, dtype=dtype, device=device)
    np.testing.assert_array_equal(a.flip((0, 2)).numpy(), np.flip(x, (0, 2)))
    np.testing.assert_array_equal(a.permute((2, 1, 0)).flip(1).numpy(),
                                  np.flip(x.transpose(2, 1, 0), 1))
    np.testing.assert_array_equal(a.pad(((0, 0), (1, 2), (2, 0))).numpy(),
                                  np.pad(x, ((0, 0), (1, 2), (2, 0))))
    np.testing.assert_array_equal(nd.stack([a, a * 2], axis=1).numpy(),
                                  np.stack([x, x * 2], axis=1))
    parts = nd.split(a, axis=2)
    assert len(parts) == 4
    for i, part in enumerate(parts):
        np.testing.assert_array_equal(part.numpy(), x[:, :, i])
    np.testing.assert_array_equal(nd.concatenate([a, a], axis=1).numpy(),
                                  np.concatenate([x, x], axis=1))


# ---- bad input ---------------------------------------------------------------------------
def test_view_errors(device):
    a = nd.array(np.ones((2, 3)), device=device)
    with pytest.raises(ShapeError, match=r"reshape: size differs.*6.*\(4, 2\)"):
        a.reshape((4, 2))
    with pytest.raises(ShapeError, match="broadcast_to: incompatible"):
        a.broadcast_to((2, 4))
    with pytest.raises(AxisError, match="permute"):
        a.permute((0, 0))
    with pytest.raises(IndexOutOfRange, match=r"getitem: index out of range on axis 1.*got 3"):
        a[0, 3]
    with pytest.raises(IndexOutOfRange, match="too many indices"):
        a[0, 0, 0]
    with pytest.raises(ShapeError, match="setitem: size mismatch"):
        a[0, :] = nd.array(np.ones(4), device=device)
    with pytest.raises(ShapeError, match="pad"):
        a.pad(((1, 1),))
    assert issubclass(ShapeError, NeedleError)


def test_disabled_device_raises_backend_unavailable():
    from needle._core.errors import BackendUnavailable
    dead = nd.BackendDevice("nowhere", None)
    with pytest.raises(BackendUnavailable):
        nd.array([1.0], device=dead)
    assert not dead.enabled()


def test_zero_dim_arrays_keep_their_shape(device):
    a = nd.array(np.array(2.5), device=device)
    assert a.shape == () and a.size == 1
    np.testing.assert_array_equal((a * 2).numpy(), np.array(5.0))
    assert nd.array(np.ones((2, 3)), device=device).sum().shape == ()


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_of_transposed_sliced_and_broadcast_views(device, dtype):
    """Backends with matmul_strided read the views directly; the result must not change."""
    rng = np.random.default_rng(8)
    x, y = _rand(rng, (40, 30), dtype), _rand(rng, (50, 40), dtype)
    a = nd.array(x, dtype=dtype, device=device)
    b = nd.array(y, dtype=dtype, device=device)
    cases = [
        (a.permute((1, 0)), b.permute((1, 0)), x.T, y.T),                 # both transposed
        (a[3:20, 5:25], b[2:22, 1:40:3], x[3:20, 5:25], y[2:22, 1:40:3]),  # offsets, steps
        (a[0:1, :].broadcast_to((7, 30)), b[0:30, :], np.broadcast_to(x[0:1], (7, 30)),
         y[0:30]),                                                          # stride 0 rows
    ]
    for av, bv, xv, yv in cases:
        want = xv.astype(np.float64) @ yv.astype(np.float64)
        _close(av @ bv, want, dtype, scale=np.sqrt(xv.shape[1]) * 10)
    assert a[0:0, :].shape == (0, 30) and (a[0:0, :] @ b[0:30, :]).shape == (0, 40)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_power_one_half_is_numpys_square_root(device, dtype):
    """``a ** 0.5`` is computed as NumPy's ``**`` computes it, a square root: bitwise equal,
    including -0.0 (stays -0.0) and -inf (NaN, where pow would give +inf), on a view too."""
    x = np.array([[4.0, 2.0, 1e-30, 3.7], [-0.0, -np.inf, np.inf, 0.1]], dtype=dtype)
    a = nd.NDArray(x, device=device, dtype=dtype)
    with np.errstate(invalid="ignore"):  # sqrt(-inf) is NaN, as intended
        want, want_t = x ** 0.5, x.T ** 0.5
        got, got_t = (a ** 0.5).numpy(), (a.permute((1, 0)) ** 0.5).numpy()
    for g, w in ((got, want), (got_t, want_t)):
        np.testing.assert_array_equal(g, w)
        # a NaN's sign is the hardware's default NaN (set on x86, clear on NVIDIA GPUs)
        signed = ~np.isnan(w)
        np.testing.assert_array_equal(np.signbit(g[signed]), np.signbit(w[signed]))


def test_reshape_to_its_own_shape_is_the_array_itself(device):
    """The gradients of ops reshape to the shape they already have many times a step: a
    tuple equal to the shape gives the array back without checks; any other spelling of a
    shape (a list, a NumPy array, -1) still goes through them."""
    a = nd.array(np.arange(6.0).reshape(2, 3), device=device)
    assert a.reshape((2, 3)) is a
    assert a.reshape([2, 3]).shape == (2, 3) and a.reshape(np.array([3, 2])).shape == (3, 2)
    assert a.reshape((-1, 3)).shape == (2, 3)
    with pytest.raises(ShapeError, match="reshape: size differs"):
        a.reshape((4, 2))
