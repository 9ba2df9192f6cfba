"""``mt19937_uniform`` (C++ and NumPy reference) and ``kernel_draws.uniform``: draws made by a
kernel are bitwise ``np.random.rand``'s and leave NumPy's generator where NumPy would."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import needle as ndl
from needle import init
from needle import random as ndl_random
from needle.backend_ndarray import cpu, cpu_numpy, kernel_draws
from needle.backend_ndarray import ndarray_backend_numpy as numpy_backend

DEVICES = [pytest.param(cpu_numpy, id="cpu_numpy"), pytest.param(cpu, id="cpu")]


def _global_generator():
    return np.random.mtrand._rand._bit_generator


def _backends():
    mods = [numpy_backend]
    if cpu().enabled():
        mods.append(cpu().mod)
    return mods


def _drawn(mod, dtype, n, p=None):
    out = mod.Array(max(n, 1), dtype)
    mod.mt19937_uniform(_global_generator(), out, n, p)
    return mod.to_numpy(out, (n,), (1,), 0)


def _numpy_reference(seed, skip, n, dtype, p):
    """NumPy's draws after ``skip`` others, cast (and compared) as the kernel must, the state
    they start from and the five draws NumPy makes next."""
    np.random.seed(seed)
    np.random.rand(skip)
    start = np.random.get_state()
    values = np.random.rand(n).astype(dtype)
    after = np.random.rand(5)
    if p is not None:
        values = (values <= np.dtype(dtype).type(p)).astype(dtype)
    return start, values, after


@pytest.mark.parametrize("mod", _backends(), ids=lambda m: m.__name__.rsplit("_", 1)[-1])
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), skip=st.integers(0, 1300), n=st.integers(0, 1900),
       dtype=st.sampled_from(["float32", "float64"]),
       p=st.none() | st.sampled_from([0.0, 1.0, 0.5, 0.9, 0.1, 1e-9]) | st.floats(0, 1))
def test_draws_are_numpys_and_leave_its_generator_where_numpy_would(mod, seed, skip, n, dtype,
                                                                       p):
    # skip and n cross the twist of the 624-word key at every parity (a double takes two words)
    start, expected, after = _numpy_reference(seed, skip, n, dtype, p)
    np.random.set_state(start)
    got = _drawn(mod, dtype, n, p)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.random.rand(5), after)


@pytest.mark.parametrize("mod", _backends(), ids=lambda m: m.__name__.rsplit("_", 1)[-1])
def test_a_large_draw_crosses_many_twists(mod):
    # 100,003 doubles: 321 twists, an odd count, and past the C++ size that releases the GIL
    start, expected, after = _numpy_reference(7, 3, 100_003, "float64", None)
    np.random.set_state(start)
    np.testing.assert_array_equal(_drawn(mod, "float64", 100_003), expected)
    np.testing.assert_array_equal(np.random.rand(5), after)


@pytest.mark.parametrize("mod", _backends(), ids=lambda m: m.__name__.rsplit("_", 1)[-1])
def test_the_mask_compares_in_the_arrays_precision(mod):
    # p = float32(u) for a draw u that float32 rounds down: float32(u) <= float32(p) holds,
    # u <= p in float64 does not. Dropout's masks (float32) must follow the float32 rule.
    np.random.seed(11)
    start = np.random.get_state()
    u = np.random.rand(4000)
    rounded_down = np.nonzero(u.astype(np.float32).astype(np.float64) < u)[0]
    k = int(rounded_down[0])
    p = float(np.float32(u[k]))
    np.random.set_state(start)
    mask = _drawn(mod, "float32", 4000, p)
    assert mask[k] == 1.0
    np.testing.assert_array_equal(mask, (u.astype(np.float32) <= np.float32(p)).astype("f4"))


@pytest.mark.parametrize("mod", _backends(), ids=lambda m: m.__name__.rsplit("_", 1)[-1])
def test_bad_arguments_are_refused_and_the_lock_released(mod):
    out = mod.Array(4, "float32")
    with pytest.raises(TypeError, match="mt19937_uniform: expected a numpy.random.MT19937, "
                                        "got PCG64"):
        mod.mt19937_uniform(np.random.PCG64(0), out, 4)
    with pytest.raises(TypeError, match="expected a float32 or float64 out, got float16"):
        mod.mt19937_uniform(_global_generator(), mod.Array(4, "float16"), 4)
    for n in (5, -1):
        with pytest.raises(ValueError, match=r"expected 0 <= n <= out.size \(4\), got " + str(n)):
            mod.mt19937_uniform(_global_generator(), out, n)
    lock = _global_generator().lock
    assert lock.acquire(blocking=False)  # nothing left it held
    lock.release()


def test_the_kernel_waits_for_the_generators_lock():
    # NumPy draws holding the bit generator's lock; a kernel draw must too: while another
    # thread holds the lock the draw cannot have happened (its result buffer stays unwritten)
    if not cpu().enabled():
        pytest.skip("cpu() backend not built")
    mod = cpu().mod
    out = mod.Array(8, "float64")
    mod.fill(out, -1.0)
    lock = _global_generator().lock
    finished = threading.Event()
    with lock:
        worker = threading.Thread(
            target=lambda: (mod.mt19937_uniform(_global_generator(), out, 8), finished.set()))
        worker.start()
        assert not finished.wait(0.5)
        assert (mod.to_numpy(out, (8,), (1,), 0) == -1.0).all()
    worker.join(timeout=60)
    assert finished.is_set()
    assert (mod.to_numpy(out, (8,), (1,), 0) >= 0.0).all()


# ---- kernel_draws.uniform: when the kernel may draw, and the same numbers when it does -----
@pytest.mark.parametrize("make_device", DEVICES)
def test_uniform_is_numpys_draw_on_devices_with_the_kernel(make_device):
    device = make_device()
    np.random.seed(5)
    got = kernel_draws.uniform(device, (3, 7), "float32")
    assert got is not None and got.shape == (3, 7) and got.dtype == "float32"
    np.random.seed(5)
    np.testing.assert_array_equal(got.numpy(), np.random.rand(3, 7).astype(np.float32))


class _NoKernelDevice:
    mod = object()


@pytest.mark.parametrize("case", ["observer", "compiling", "own stream", "float16",
                                  "no kernel", "other bit generator"])
def test_uniform_leaves_the_draw_to_numpy_when_it_must(case):
    device = cpu_numpy()
    dtype = "float16" if case == "float16" else "float32"
    np.random.seed(2)
    before = np.random.get_state()
    previous = None
    handle = None
    try:
        if case == "observer":
            handle = ndl_random.add_draw_observer(lambda *a: None)
        elif case == "compiling":
            previous = ndl_random.draw_through_numpy(True)
        elif case == "own stream":
            ndl_random.register_stream(device, ndl_random.NumpyGlobalStream())
        elif case == "no kernel":
            device = _NoKernelDevice()
        elif case == "other bit generator":
            previous = _global_generator()
            np.random.set_bit_generator(np.random.PCG64(0))
        assert kernel_draws.uniform(device, (4,), dtype) is None
    finally:
        if handle is not None:
            handle.remove()
        if case == "compiling":
            ndl_random.draw_through_numpy(previous)
        elif case == "own stream":
            ndl_random.unregister_stream(device)
        elif case == "other bit generator":
            np.random.set_bit_generator(previous)
    after = np.random.get_state()
    assert after[2] == before[2] and (after[1] == before[1]).all()  # nothing was drawn


@pytest.mark.parametrize("make_device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 123])
def test_init_rand_randb_and_dropout_draw_the_numbers_numpy_would(make_device, seed):
    """The kernel path and NumPy's path (forced with draw_through_numpy) give bitwise the same
    tensors, and leave NumPy's generator in the same state."""
    device = make_device()
    x = ndl.Tensor(np.random.rand(37, 11).astype(np.float32), device=device)
    drop = ndl.nn.Dropout(0.3)

    def draws():
        np.random.seed(seed)
        values = [init.rand(5, 9, low=-2, high=3, device=device).numpy(),
                  init.randb(13, 17, p=0.7, device=device, dtype="float32").numpy(),
                  init.rand(4, device=device, dtype="float64").numpy(),
                  drop(x).numpy(), device.rand(6, 2).numpy()]
        return values, np.random.rand(3)

    fast, fast_next = draws()
    previous = ndl_random.draw_through_numpy(True)
    try:
        slow, slow_next = draws()
    finally:
        ndl_random.draw_through_numpy(previous)
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fast_next, slow_next)
