"""The C++ backend's Array type and its fast-call entry points (src/array_py.h,
src/fast_calls_py.h): the same contract as the pybind11 functions they replaced.

Values are checked against NumPy by the kernel suites (test_cpu_kernels.py, test_ndarray.py);
this file checks what the C API bindings do themselves: argument checking with errors that
name the function, the conversions of scalars and ints, and the Array object's attributes.
"""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

try:
    from needle.backend_ndarray import ndarray_backend_cpu as cpu
except ImportError:  # pragma: no cover - depends on the build
    pytest.skip("compiled module ndarray_backend_cpu is missing: build it with `pip install -e .`",
                allow_module_level=True)

from needle._core.errors import MemoryArgumentError, ShapeError

BINARY = ["ewise_add", "ewise_sub", "ewise_mul", "ewise_div", "ewise_maximum", "ewise_minimum",
          "ewise_power", "ewise_eq", "ewise_ge", "ewise_tanh_grad", "ewise_relu_grad"]
SCALAR = ["scalar_add", "scalar_sub", "scalar_rsub", "scalar_mul", "scalar_div", "scalar_rdiv",
          "scalar_power", "scalar_rpower", "scalar_maximum", "scalar_minimum", "scalar_eq",
          "scalar_ge", "scalar_le"]
UNARY = ["ewise_neg", "ewise_log", "ewise_exp", "ewise_tanh", "ewise_sqrt", "ewise_abs",
         "ewise_sign", "ewise_sigmoid"]
REDUCE = ["reduce_sum", "reduce_max", "reduce_min"]


def _array(values) -> object:
    values = np.ascontiguousarray(values)
    arr = cpu.Array(values.size, str(values.dtype))
    cpu.from_numpy(values, arr)
    return arr


def _flat(arr) -> np.ndarray:
    return cpu.to_numpy(arr, (arr.size,), (1,), 0)


@pytest.mark.parametrize("name", BINARY + SCALAR + UNARY + REDUCE +
                         ["matmul", "matmul_strided", "new_array", "fill", "compact",
                          "ewise_setitem", "scalar_setitem", "ewise_program",
                          "ewise_program_many", "batch_norm_forward", "batch_norm_backward"])
def test_wrong_arguments_name_the_function_and_what_it_expected(name):
    fn = getattr(cpu, name)
    with pytest.raises(TypeError, match=rf"^{name}: expected arguments \(.*\), got \(\)$"):
        fn()
    with pytest.raises(TypeError, match=rf"^{name}: expected .*got \(str, int\)$"):
        fn("a", 1)


@pytest.mark.parametrize("name", BINARY)
def test_binary_rejects_a_non_array_operand(name):
    a = _array(np.ones(4, np.float32))
    with pytest.raises(TypeError, match=rf"{name}: expected arguments \(a: Array, b: Array, "
                                        r"out: Array\), got \(Array, float, Array\)"):
        getattr(cpu, name)(a, 1.0, a)


def test_scalar_takes_ints_and_numpy_scalars_and_names_itself_for_anything_else():
    a, out = _array(np.array([1.0, 2.0, 3.0], np.float32)), cpu.Array(3, "float32")
    cpu.scalar_rsub(a, 10, out)  # 10 - a
    np.testing.assert_array_equal(_flat(out), [9.0, 8.0, 7.0])
    cpu.scalar_mul(a, np.float64(0.5), out)
    np.testing.assert_array_equal(_flat(out), [0.5, 1.0, 1.5])
    cpu.scalar_le(a, 2, out)  # a <= 2
    np.testing.assert_array_equal(_flat(out), [1.0, 1.0, 0.0])
    with pytest.raises(TypeError, match=r"scalar_add: expected arguments \(a: Array, val: float, "
                                        r"out: Array\), got \(Array, str, Array\)"):
        cpu.scalar_add(a, "2", out)
    with pytest.raises(OverflowError):
        cpu.scalar_add(a, 10**400, out)


def test_kernel_errors_keep_their_needle_classes():
    a, small = _array(np.ones(6, np.float32)), cpu.Array(2, "float32")
    with pytest.raises(ShapeError, match="ewise_add: b too small, expected at least 6"):
        cpu.ewise_add(a, small, cpu.Array(6, "float32"))
    with pytest.raises(TypeError, match="ewise_exp: dtypes differ, expected float64, got float32"):
        cpu.ewise_exp(a, cpu.Array(6, "float64"))
    with pytest.raises(ShapeError, match="reduce_sum: reduce_size must be >= 0, got -1"):
        cpu.reduce_sum(a, small, -1)
    with pytest.raises(TypeError, match=r"reduce_sum: expected .*got \(Array, Array, float\)"):
        cpu.reduce_sum(a, small, 3.0)


def test_matmul_entry_points_take_ints_with_index_and_check_their_views():
    a = _array(np.arange(6, dtype=np.float64).reshape(2, 3))
    b = _array(np.arange(12, dtype=np.float64).reshape(3, 4))
    out = cpu.Array(8, "float64")
    want = np.arange(6.0).reshape(2, 3) @ np.arange(12.0).reshape(3, 4)
    cpu.matmul(a, b, out, np.int64(2), 3, 4)
    np.testing.assert_array_equal(_flat(out).reshape(2, 4), want)
    # b read transposed from a (4, 3) buffer: strides (1, 3)
    bt = _array(np.ascontiguousarray(np.arange(12.0).reshape(3, 4).T))
    cpu.matmul_strided(a, bt, out, 2, 3, 4, 0, 3, 1, 0, 1, 3)
    np.testing.assert_array_equal(_flat(out).reshape(2, 4), want)
    with pytest.raises(ShapeError, match="matmul_strided: b too small, expected at least 13"):
        cpu.matmul_strided(a, bt, out, 2, 3, 4, 0, 3, 1, 1, 1, 3)  # offset 1 runs off the end
    with pytest.raises(TypeError, match=r"matmul: expected .*got \(Array, Array, Array, int, "
                                        r"float, int\)"):
        cpu.matmul(a, b, out, 2, 3.0, 4)


def test_array_object_attributes_weakrefs_and_category():
    arr = cpu.Array(size=5, dtype=np.dtype("float64"), category="gradient")
    assert (arr.size, arr.dtype, arr.itemsize, arr.category) == (5, "float64", 8, "gradient")
    assert repr(arr) == "Array(size=5, dtype='float64')"
    assert type(arr) is cpu.Array and type(cpu.new_array(3, "float16")) is cpu.Array
    assert arr.ptr() % 64 == 0 and isinstance(arr.block_id, int)
    arr.category = "optimizer"
    assert arr.category == "optimizer"
    with pytest.raises(MemoryArgumentError, match="unknown memory category"):
        arr.category = "nonsense"
    with pytest.raises(AttributeError, match="cannot delete"):
        del arr.category
    ref = weakref.ref(arr)
    assert ref() is arr
    del arr
    gc.collect()
    assert ref() is None


def test_arrays_made_and_dropped_return_their_bytes():
    before = cpu.allocator_stats()["allocated_bytes"]
    arrays = [cpu.new_array(1000, "float32") for _ in range(10)]
    assert cpu.allocator_stats()["allocated_bytes"] >= before + 10 * 4000
    del arrays
    assert cpu.allocator_stats()["allocated_bytes"] == before


def test_view_copies_take_tuples_or_lists_and_name_a_bad_shape():
    a = _array(np.arange(6, dtype=np.float32))
    out = cpu.Array(6, "float32")
    cpu.compact(a, out, [2, 3], (1, 2), 0)  # the transpose of a (3, 2) array
    np.testing.assert_array_equal(_flat(out), np.arange(6.0).reshape(3, 2).T.reshape(-1))
    cpu.fill(out, 0)
    cpu.ewise_setitem(_array(np.ones(2, np.float32)), out, (2,), (3,), 1)
    np.testing.assert_array_equal(_flat(out), [0, 1, 0, 0, 1, 0])
    cpu.scalar_setitem(3, 7.5, out, (3,), (2,), 0)
    np.testing.assert_array_equal(_flat(out), [7.5, 1, 7.5, 0, 7.5, 0])
    with pytest.raises(TypeError, match=r"compact: expected arguments \(a: Array, out: Array, "
                                        r"shape: tuple, strides: tuple, offset: int\), got "
                                        r"\(Array, Array, str, tuple, int\)"):
        cpu.compact(a, out, "23", (1, 2), 0)
    with pytest.raises(TypeError, match=r"ewise_setitem: expected .*got \(Array, Array, tuple, "
                                        r"tuple, float\)"):
        cpu.ewise_setitem(a, out, (2,), (3,), 1.0)
    with pytest.raises(TypeError, match=r"scalar_setitem: expected .*got \(int, NoneType"):
        cpu.scalar_setitem(3, None, out, (3,), (2,), 0)
    with pytest.raises(ShapeError, match="scalar_setitem: size differs from the view"):
        cpu.scalar_setitem(2, 1.0, out, (3,), (2,), 0)
    with pytest.raises(IndexError, match="compact"):
        cpu.compact(a, out, (2, 3), (1, 2), 1)  # reaches element 6 of 6


def test_ewise_program_names_a_bad_list_and_still_checks_the_program():
    from needle.backend_ndarray.ewise_codes import LOAD, STORE, UNARY, UNARY_OPS

    a, out = _array(np.array([1.0, -2.0], np.float32)), cpu.Array(2, "float32")
    load, store = [LOAD, 0, 0, 0, 0], [STORE, 0, 0, 1, 0]  # r0 = input 0; output 0 = r1
    neg = [UNARY, UNARY_OPS["neg"], 1, 0, 0]  # r1 = -r0
    cpu.ewise_program((a,), [out], load + neg + store, (), 2)
    np.testing.assert_array_equal(_flat(out), [-1.0, 2.0])
    with pytest.raises(TypeError, match="ewise_program: expected Arrays in argument 0, got int"):
        cpu.ewise_program([a, 1], [out], load + neg + store, [], 2)
    with pytest.raises(TypeError, match="ewise_program: expected numbers in argument 3, got str"):
        cpu.ewise_program([a], [out], load + neg + store, ["x"], 2)
    with pytest.raises(TypeError, match="ewise_program: expected numbers in argument 2, got float"):
        cpu.ewise_program([a], [out], [float(c) for c in load] + neg + store, [], 2)
    with pytest.raises(ValueError, match="ewise_program: expected instructions of 5 ints"):
        cpu.ewise_program([a], [out], load + neg + store + [1], [], 2)
    with pytest.raises(ValueError, match="ewise_program: register 1 read before set"):
        cpu.ewise_program([a], [out], load + store, [], 2)


def _other_thread_ran_during(call) -> int:
    """How many loop turns a second Python thread made while ``call()`` ran on this one:
    0 when ``call`` held the GIL throughout.

    The switch interval is made huge for the measurement, so the interpreter never takes the
    GIL from a thread by force: the other thread runs only when this one gives the GIL up (a
    kernel that releases it, or ``time.sleep(0)``), and the count is exact, not a timing."""
    import sys
    import threading
    import time

    state = {"count": 0, "done": False}

    def spin():
        while not state["done"]:
            state["count"] += 1
            if state["count"] % 1000 == 0:
                time.sleep(0)  # hand the GIL back when the main thread wants it

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        while state["count"] == 0:  # let the spinner start
            time.sleep(0)
        before = state["count"]
        call()
        return state["count"] - before
    finally:
        state["done"] = True
        spinner.join()
        sys.setswitchinterval(interval)


LARGE = 1 << 24  # 16M elements: tens of ms per kernel, far above the 32,768 threshold


@pytest.mark.parametrize("kernel", ["compact", "ewise_setitem", "scalar_setitem", "ewise_add",
                                    "fill", "reduce_sum", "scalar_mul", "ewise_tanh", "matmul",
                                    "mt19937_uniform"])
def test_large_kernels_release_the_gil(kernel):
    a, out, small = cpu.Array(LARGE, "float32"), cpu.Array(LARGE, "float32"), cpu.Array(1)
    cpu.fill(a, 1.0)
    side = 1 << 9  # a 512^3 matmul: 134M multiply-adds
    calls = {
        "compact": lambda: cpu.compact(a, out, (LARGE,), (1,), 0),
        "ewise_setitem": lambda: cpu.ewise_setitem(a, out, (LARGE,), (1,), 0),
        "scalar_setitem": lambda: cpu.scalar_setitem(LARGE, 2.0, out, (LARGE,), (1,), 0),
        "ewise_add": lambda: cpu.ewise_add(a, a, out),
        "fill": lambda: cpu.fill(out, 3.0),
        "reduce_sum": lambda: cpu.reduce_sum(a, out, 1),
        "scalar_mul": lambda: cpu.scalar_mul(a, 2.0, out),
        "ewise_tanh": lambda: cpu.ewise_tanh(a, out),
        "matmul": lambda: cpu.matmul(a, a, out, side, side, side),
        "mt19937_uniform": lambda: cpu.mt19937_uniform(np.random.mtrand._rand._bit_generator,
                                                       out, LARGE),
    }
    before = cpu.get_num_threads()
    cpu.set_num_threads(1)  # leave the second core to the other thread
    try:
        # a released GIL lets the other thread run only once the OS schedules it: on a loaded
        # 2-vCPU VM that took longer than a 1-2 ms kernel in one CI run, so up to five calls
        # (a kernel that keeps the GIL lets it run in none of them)
        ran = 0
        for _ in range(5):
            ran = _other_thread_ran_during(calls[kernel])
            if ran:
                break
        held = _other_thread_ran_during(lambda: cpu.ewise_add(a, a, small))  # kept: 1 element
    finally:
        cpu.set_num_threads(before)
    assert ran > 0, f"{kernel}: no other Python thread ran during a {LARGE}-element call"
    assert held == 0
