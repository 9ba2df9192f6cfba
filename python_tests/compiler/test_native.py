"""The C++ kernel list (src/kernel_list_py.h) that runs kernel programs on cpu().

Each step kind against NumPy on a hand-built list; bad lists and runs refused with an error,
never a crash (a read of a freed slot, a slot out of range, a wrong external).
"""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl

pytestmark = pytest.mark.skipif(not ndl.cpu().enabled(), reason="the C++ backend is not built")


@pytest.fixture
def mod():
    return ndl.cpu().mod


def _array(mod, values):
    values = np.asarray(values, np.float32).reshape(-1)
    a = mod.Array(values.size, "float32")
    mod.from_numpy(values, a)
    return a


def _values(mod, a, shape):
    return mod.to_numpy(a, shape, tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))),
                        0)


def test_every_step_kind_computes_what_its_kernel_does(mod):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    w = rng.standard_normal((4, 2)).astype(np.float32)
    calls = []

    def bookkeeping():
        calls.append(1)
        return (0.5, 2.0)

    kl = mod._KernelList(12, 2)
    kl.python(bookkeeping, [], [], [], [], 0)       # registers 0, 1 <- 0.5, 2.0
    kl.alloc(2, 12, "float32", "activation")
    kl.scalar(2, False, 0, 0.0, 1, 2)               # s2 = x * reg1 (mul)
    kl.alloc(3, 12, "float32", "activation")
    kl.binary(0, 2, 0, 3)                           # s3 = s2 + x
    kl.alloc(4, 12, "float32", "activation")
    kl.unary(0, 3, 4)                               # s4 = -s3
    kl.alloc(5, 12, "float32", "activation")
    kl.compact(4, 5, [4, 3], [1, 4], 0)             # s5 = s4.T compact (4, 3)
    kl.free(4)
    kl.alloc(6, 8, "float32", "activation")
    kl.matmul_strided(0, 1, 6, [3, 4, 2, 0, 4, 1, 0, 2, 1])  # s6 = x @ w
    kl.alloc(7, 3, "float32", "activation")
    kl.reduce(0, 6, 7, 2)                           # s7 = s6.sum(1)
    kl.alloc(8, 3, "float32", "activation")
    kl.program([7], [8], [0, 0, 0, 0, 0, 3, 2, 1, 0, 0, 1, 0, 0, 1, 0], [3.0], 3)  # s8 = s7*3
    kl.alloc(9, 2, "float32", "other")
    kl.fill(9, 7.5)
    handles = [_array(mod, x), _array(mod, w)]
    s3, s5, s8, s9 = kl.run(handles, [0, 1], [3, 5, 8, 9])
    assert handles == [] and len(calls) == 1
    np.testing.assert_array_equal(_values(mod, s3, (3, 4)), x * np.float32(2.0) + x)
    np.testing.assert_array_equal(_values(mod, s5, (4, 3)), (-(x * np.float32(2.0) + x)).T)
    np.testing.assert_allclose(_values(mod, s8, (3,)), (x @ w).sum(1) * 3, rtol=1e-5)
    np.testing.assert_array_equal(_values(mod, s9, (2,)), [7.5, 7.5])


def test_the_column_sum_step_computes_what_its_kernel_does(mod):
    """sum_leading (a linear layer's bias gradient in a compiled step) is a C++ step of its
    own, with the checks of reduce_sum_leading."""
    x = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    kl = mod._KernelList(2, 0)
    kl.alloc(1, 3, "float32", "activation")
    kl.sum_leading(0, 1, 5, 3)
    (out,) = kl.run([_array(mod, x)], [0], [1])
    np.testing.assert_array_equal(_values(mod, out, (3,)),
                                  (((x[0] + x[1]) + x[2]) + x[3]) + x[4])
    bad = mod._KernelList(2, 0)
    bad.alloc(1, 3, "float32", "activation")
    bad.sum_leading(0, 1, 6, 3)  # one row more than the input holds
    with pytest.raises(ValueError, match="reduce_sum_leading: a too small"):
        bad.run([_array(mod, x)], [0], [1])


def test_bad_lists_are_refused_when_built(mod):
    kl = mod._KernelList(3, 1)
    with pytest.raises(ValueError, match="slot 3"):
        kl.binary(0, 0, 1, 3)
    with pytest.raises(ValueError, match="unknown binary op"):
        kl.binary(99, 0, 1, 2)
    with pytest.raises(ValueError, match="scalar register 4"):
        kl.scalar(0, False, 0, 1.0, 4, 1)
    with pytest.raises(ValueError, match="read before set"):
        kl.program([0], [1], [2, 0, 0, 1, 2], [], 4)


def test_bad_runs_raise_instead_of_crashing(mod):
    kl = mod._KernelList(3, 1)
    kl.alloc(1, 4, "float32", "other")
    kl.alloc(2, 4, "float32", "other")
    kl.free(1)
    kl.binary(0, 0, 1, 2)  # reads slot 1 after its free
    with pytest.raises(RuntimeError, match="slot 1 read while it holds no buffer"):
        kl.run([mod.Array(4, "float32")], [0], [])
    with pytest.raises(ValueError, match="expected 1 buffers, got 0"):
        kl.run([], [0], [])
    with pytest.raises((TypeError, RuntimeError)):
        kl.run(["not an array"], [0], [])


def test_profiled_runs_time_every_step_under_its_label(mod):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    w = np.ones((4, 2), np.float32)

    def bookkeeping():
        return 1.5

    kl = mod._KernelList(5, 1)
    kl.python(bookkeeping, [], [], [], [], 0)
    kl.alloc(2, 8, "float32", "activation")
    kl.matmul_strided(0, 1, 2, [3, 4, 2, 0, 4, 1, 0, 2, 1])
    kl.alloc(3, 8, "float32", "activation")
    kl.scalar(2, False, 2, 0.0, 0, 3)  # times register 0
    kl.free(2)
    assert kl.timings() == []  # nothing profiled yet
    kl.set_profile(True)
    (out,) = kl.run([_array(mod, x), _array(mod, w)], [0, 1], [3])
    np.testing.assert_array_equal(_values(mod, out, (3, 2)), (x @ w) * np.float32(1.5))
    timings = kl.timings()
    assert [label for label, _ in timings] == [
        "python:bookkeeping", "alloc", "matmul_strided:3x4x2 a(4,1) b(2,1)", "alloc",
        "scalar:2", "free"]
    assert all(type(ns) is int and ns >= 0 for _, ns in timings)
    kl.set_profile(False)
    kl.run([_array(mod, x), _array(mod, w)], [0, 1], [3])
    assert [label for label, _ in kl.timings()][0] == "python:bookkeeping"  # the profiled run's
