"""Every backend module conforms to ``needle.backend_ndarray.protocol.Backend``.

Each backend (the NumPy reference, the compiled CPU module, the CUDA module on the host
emulator, and the real CUDA module where a GPU is present) exports every name of the protocol,
and each entry point, called with the protocol's arguments, gives what NumPy computes for the
same formula here. Tensors are tiny: the emulator runs each kernel slowly.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backend_ndarray.protocol import OPTIONAL, Backend, missing

BACKENDS = [
    "numpy",
    "cpu",
    "emulated_cuda",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not nd.cuda().enabled(), reason="cuda() not available")]),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "emulated_cuda":
        return request.getfixturevalue("emulated_cuda").mod
    return {"numpy": nd.cpu_numpy, "cpu": nd.cpu, "cuda": nd.cuda}[request.param]().mod


def _strides(shape):
    return tuple(int(s) for s in np.cumprod((1,) + tuple(shape[::-1]))[-2::-1]) if shape else ()


def put(mod, values, dtype="float32"):
    values = np.ascontiguousarray(values, dtype=dtype)
    arr = mod.Array(values.size, dtype)
    mod.from_numpy(values.reshape(-1), arr)
    return arr


def get(mod, arr, shape):
    return mod.to_numpy(arr, tuple(shape), _strides(shape), 0)


def close(actual, expected, dtype="float32"):
    rtol = {"float32": 2e-6, "float64": 1e-12, "float16": 1e-3}[dtype]
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol)


RNG = np.random.default_rng(0)
X = RNG.uniform(0.5, 2.0, size=(2, 3))
Y = RNG.uniform(0.5, 2.0, size=(2, 3))


def test_strides_helper():
    assert _strides((2, 3, 4)) == (12, 4, 1)
    assert _strides((5,)) == (1,)


def test_exports_every_name_of_the_protocol(backend):
    assert missing(backend) == []
    assert isinstance(backend, Backend)
    assert backend.__device_name__ in ("numpy", "cpu", "cuda")
    assert isinstance(backend.__tile_size__, int) and backend.__tile_size__ >= 1


def test_missing_names_a_module_that_lacks_an_entry_point():
    class Partial:
        __device_name__, __tile_size__ = "partial", 1
        fill = None  # not callable
    names = missing(Partial)
    assert "fill" in names and "matmul" in names and "__device_name__" not in names
    assert not set(OPTIONAL) & set(names)


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("float64", 8), ("float16", 2)])
def test_array_buffer(backend, dtype, itemsize):
    a, b = backend.Array(5, dtype), backend.Array(5, dtype)
    assert (a.size, a.dtype, a.itemsize) == (5, dtype, itemsize)
    assert isinstance(a.ptr(), int) and a.ptr() != b.ptr()


def test_transfers_fill_and_strided_views(backend):
    a = put(backend, np.arange(12.0).reshape(3, 4))
    close(backend.to_numpy(a, (4, 3), (1, 4), 0), np.arange(12.0).reshape(3, 4).T)  # transpose
    close(backend.to_numpy(a, (2, 2), (4, 1), 5), [[5, 6], [9, 10]])                # slice
    out = backend.Array(12)
    backend.compact(a, out, (4, 3), (1, 4), 0)
    close(get(backend, out, (4, 3)), np.arange(12.0).reshape(3, 4).T)
    backend.compact(a, out, (3, 4), (4, -1), 3)                                     # flip
    close(get(backend, out, (3, 4)), np.arange(12.0).reshape(3, 4)[:, ::-1])
    backend.fill(out, 7.0)
    close(get(backend, out, (12,)), np.full(12, 7.0))
    backend.ewise_setitem(put(backend, [1.0, 2.0, 3.0]), out, (3,), (4,), 1)       # a column
    expected = np.full(12, 7.0)
    expected[[1, 5, 9]] = [1, 2, 3]
    close(get(backend, out, (12,)), expected)
    backend.scalar_setitem(2, -1.0, out, (2,), (2,), 0)
    expected[[0, 2]] = -1
    close(get(backend, out, (12,)), expected)


BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "maximum": np.maximum, "minimum": np.minimum, "power": np.power,
          "eq": lambda a, b: (a == b).astype(float), "ge": lambda a, b: (a >= b).astype(float)}
SCALAR = {"add": lambda a, v: a + v, "sub": lambda a, v: a - v, "rsub": lambda a, v: v - a,
          "mul": lambda a, v: a * v, "div": lambda a, v: a / v, "rdiv": lambda a, v: v / a,
          "power": lambda a, v: a ** v, "rpower": lambda a, v: v ** a,
          "maximum": np.maximum, "minimum": np.minimum,
          "eq": lambda a, v: (a == v).astype(float), "ge": lambda a, v: (a >= v).astype(float),
          "le": lambda a, v: (a <= v).astype(float)}
UNARY = {"neg": np.negative, "log": np.log, "exp": np.exp, "tanh": np.tanh, "sqrt": np.sqrt,
         "abs": np.abs, "sign": np.sign, "sigmoid": lambda a: 1 / (1 + np.exp(-a))}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_elementwise_entry_points(backend, dtype):
    x, y = X.astype(dtype), Y.astype(dtype)
    y[0, 0] = x[0, 0]  # one equal pair for eq / ge
    a, b, out = put(backend, x, dtype), put(backend, y, dtype), backend.Array(6, dtype)
    for name, fn in BINARY.items():
        getattr(backend, f"ewise_{name}")(a, b, out)
        close(get(backend, out, (2, 3)), fn(x.astype(float), y.astype(float)), dtype)
    v = float(x[1, 2])
    for name, fn in SCALAR.items():
        getattr(backend, f"scalar_{name}")(a, v, out)
        close(get(backend, out, (2, 3)), fn(x.astype(float), v), dtype)
    signed = put(backend, x - 1.25, dtype)
    for name, fn in UNARY.items():
        source = a if name in ("log", "sqrt") else signed
        expected = fn(x.astype(float) if name in ("log", "sqrt") else x.astype(float) - 1.25)
        getattr(backend, f"ewise_{name}")(source, out)
        close(get(backend, out, (2, 3)), expected, dtype)


@pytest.mark.parametrize("m, n", [(1000, 16), (777, 3), (4099, 50), (40, 1500), (3, 1)])
def test_add_rows_of_every_length(backend, m, n):
    """Short rows go to the kernel many at a time (against the row repeated), with a tail
    of single rows, on two threads where the backend has them: every shape bitwise the
    broadcast ewise_add, into a new buffer and in place."""
    if hasattr(backend, "set_num_threads"):
        backend.set_num_threads(2)
    rng = np.random.default_rng(m + n)
    x = rng.uniform(-2, 2, (m, n)).astype("float32")
    r = rng.uniform(-2, 2, n).astype("float32")
    a, row, out = put(backend, x, "float32"), put(backend, r, "float32"), backend.Array(m * n)
    backend.ewise_add_rows(a, row, out, m, n)
    broadcast = backend.Array(m * n)
    backend.ewise_add(a, put(backend, np.broadcast_to(r, (m, n)), "float32"), broadcast)
    want = get(backend, broadcast, (m, n))
    np.testing.assert_array_equal(get(backend, out, (m, n)), want)
    np.testing.assert_array_equal(want, x + r)
    backend.ewise_add_rows(a, row, a, m, n)
    np.testing.assert_array_equal(get(backend, a, (m, n)), want)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_add_rows(backend, dtype):
    """ewise_add_rows: the row added to every row, bitwise ewise_add of the broadcast row,
    into a new buffer or in place; bad sizes, aliasing and dtypes are refused naming it."""
    rng = np.random.default_rng(1)
    x, r = rng.uniform(-2, 2, (5, 7)).astype(dtype), rng.uniform(-2, 2, 7).astype(dtype)
    a, row, out = put(backend, x, dtype), put(backend, r, dtype), backend.Array(35, dtype)
    backend.ewise_add_rows(a, row, out, 5, 7)
    broadcast = backend.Array(35, dtype)
    backend.ewise_add(a, put(backend, np.broadcast_to(r, (5, 7)), dtype), broadcast)
    np.testing.assert_array_equal(get(backend, out, (5, 7)), get(backend, broadcast, (5, 7)))
    np.testing.assert_array_equal(get(backend, out, (5, 7)), x + r)
    backend.ewise_add_rows(a, row, a, 5, 7)  # in place
    np.testing.assert_array_equal(get(backend, a, (5, 7)), x + r)
    backend.ewise_add_rows(a, row, out, 0, 7)  # no rows: nothing read or written
    np.testing.assert_array_equal(get(backend, out, (5, 7)), x + r)
    with pytest.raises(ValueError, match="ewise_add_rows: row too small"):
        backend.ewise_add_rows(a, put(backend, r[:6], dtype), out, 5, 7)
    with pytest.raises(ValueError, match="ewise_add_rows: out too small"):
        backend.ewise_add_rows(a, row, backend.Array(34, dtype), 5, 7)
    with pytest.raises(ValueError, match="ewise_add_rows: dimensions must be >= 0"):
        backend.ewise_add_rows(a, row, out, -1, 7)
    with pytest.raises(ValueError, match="ewise_add_rows: out must not share memory with row"):
        backend.ewise_add_rows(a, row, row, 1, 7)
    other = "float64" if dtype != "float64" else "float32"
    with pytest.raises(TypeError, match="ewise_add_rows"):
        backend.ewise_add_rows(a, put(backend, r, other), out, 5, 7)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("m,n", [(5, 7), (9, 70), (1, 33), (0, 4)])
def test_sum_leading(backend, dtype, m, n):
    """reduce_sum_leading: the m rows added up in order in the element type (float32 for
    float16), bitwise; a column of big, 1, -big pins that type down (float32 loses the 1
    next to 1e8, float64 keeps it, float16's float32 sums keep it next to 1e4); bad sizes,
    aliasing and dtypes are refused naming it."""
    rng = np.random.default_rng(m * 100 + n)
    x = rng.uniform(-2, 2, (m, n))
    if m >= 3:
        big = 1e8 if dtype != "float16" else 1e4
        x[:, 0] = 0.0
        x[:3, 0] = [big, 1.0, -big]
    x = x.astype(dtype)
    a = put(backend, x, dtype) if m else backend.Array(0, dtype)  # m = 0: an empty buffer
    out = backend.Array(n, dtype)
    backend.reduce_sum_leading(a, out, m, n)
    total = np.zeros(n, "float32" if dtype == "float16" else dtype)
    for row in x:
        total += row
    np.testing.assert_array_equal(get(backend, out, (n,)), total.astype(dtype))
    if m >= 3:
        assert get(backend, out, (n,))[0] == (0.0 if dtype == "float32" else 1.0)
    with pytest.raises(ValueError, match="reduce_sum_leading: a too small"):
        backend.reduce_sum_leading(a, out, m + 1, n)
    with pytest.raises(ValueError, match="reduce_sum_leading: out too small"):
        backend.reduce_sum_leading(a, backend.Array(n - 1, dtype), m, n)
    with pytest.raises(ValueError, match="reduce_sum_leading: dimensions must be >= 0"):
        backend.reduce_sum_leading(a, out, -1, n)
    with pytest.raises(ValueError, match="reduce_sum_leading: out must not share memory"):
        wide = put(backend, np.zeros((1, n)), dtype)
        backend.reduce_sum_leading(wide, wide, 1, n)
    other = "float64" if dtype != "float64" else "float32"
    with pytest.raises(TypeError, match="reduce_sum_leading"):
        backend.reduce_sum_leading(backend.Array(m * n, other), out, m, n)


@pytest.mark.parametrize("src,dst", [("float32", "float64"), ("float64", "float16"),
                                     ("float16", "float32")])
def test_cast(backend, src, dst):
    values = np.array([0.1, -2.5, 3.0, 65504.0])
    a, out = put(backend, values, src), backend.Array(4, dst)
    backend.ewise_cast(a, out)
    result = get(backend, out, (4,))
    assert result.dtype == np.dtype(dst)
    np.testing.assert_array_equal(result, values.astype(src).astype(dst))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matmul_and_reductions(backend, dtype):
    m, n, p = 3, 4, 5
    x, y = RNG.standard_normal((m, n)), RNG.standard_normal((n, p))
    out = backend.Array(m * p, dtype)
    backend.matmul(put(backend, x, dtype), put(backend, y, dtype), out, m, n, p)
    close(get(backend, out, (m, p)), x.astype(dtype).astype(float) @ y.astype(dtype), dtype)
    z = RNG.standard_normal((4, 6)).astype(dtype)
    a, red = put(backend, z, dtype), backend.Array(4, dtype)
    for name, fn in (("sum", np.sum), ("max", np.max), ("min", np.min)):
        getattr(backend, f"reduce_{name}")(a, red, 6)
        close(get(backend, red, (4,)), fn(z.astype(float), axis=1), dtype)


def test_thread_count(backend):
    before = backend.get_num_threads()
    assert isinstance(before, int) and before >= 1
    backend.set_num_threads(1)
    try:
        assert backend.get_num_threads() >= 1
    finally:
        backend.set_num_threads(before)
