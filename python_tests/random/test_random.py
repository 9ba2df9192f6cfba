"""needle.random: the host stream is NumPy's global generator; states, forks, streams, observers."""
from __future__ import annotations

import numpy as np
import pytest

from needle import random as nr
from needle._core.errors import DeviceError, NeedleError


def _host_key():
    return np.random.get_state()[1].copy(), np.random.get_state()[2]


@pytest.mark.parametrize("call, numpy_call", [
    (lambda: nr.rand(3, 4), lambda: np.random.rand(3, 4)),
    (lambda: nr.randn(5), lambda: np.random.randn(5)),
    (lambda: nr.rand(), lambda: np.random.rand()),
    (lambda: nr.randint(-3, 4, size=2), lambda: np.random.randint(low=-3, high=4, size=2)),
    (lambda: nr.permutation(10), lambda: np.random.permutation(10)),
])
def test_draws_are_the_numpy_global_draws(call, numpy_call):
    np.random.seed(11)
    got = call()
    after = _host_key()
    np.random.seed(11)
    want = numpy_call()
    np.testing.assert_array_equal(got, want)
    key, pos = _host_key()
    np.testing.assert_array_equal(after[0], key)
    assert after[1] == pos  # exactly the same amount of the stream consumed


def test_seed_is_numpy_seed():
    nr.seed(5)
    a = np.random.rand(4)
    np.random.seed(5)
    np.testing.assert_array_equal(a, np.random.rand(4))


def test_get_set_state_round_trip():
    nr.seed(1)
    state = nr.get_state()
    first = nr.randn(6)
    nr.set_state(state)
    np.testing.assert_array_equal(first, nr.randn(6))
    host_only = nr.get_state("cpu")  # an unregistered device draws from the host stream
    x = nr.rand(2, device="cpu")
    nr.set_state(host_only, "cpu")
    np.testing.assert_array_equal(x, np.random.rand(2))


def test_fork_rng_restores_and_can_be_disabled():
    np.random.seed(2)
    np.random.rand(100)
    after_100 = np.random.rand()
    np.random.seed(2)
    untouched = np.random.rand()

    nr.seed(2)
    with nr.fork_rng():
        nr.rand(100)
    assert nr.rand() == untouched  # the block's draws did not advance the outside
    nr.seed(2)
    with nr.fork_rng(enabled=False):
        nr.rand(100)
    assert nr.rand() == after_100
    nr.seed(2)
    with pytest.raises(ZeroDivisionError):
        with nr.fork_rng():
            nr.rand(3)
            raise ZeroDivisionError
    assert nr.rand() == untouched  # restored on error too


class _OwnStream(nr.NumpyGlobalStream):
    """A device stream with its own generator, to check streams stay apart."""

    name = "fake"

    def __init__(self):
        self.rs = np.random.RandomState(0)

    def seed(self, n):
        self.rs.seed(n)

    def get_state(self):
        return self.rs.get_state()

    def set_state(self, s):
        self.rs.set_state(s)

    def rand(self, *shape):
        return self.rs.rand(*shape)


@pytest.fixture
def fake_stream():
    stream = _OwnStream()
    nr.register_stream("fake", stream)
    yield stream
    nr.unregister_stream("fake")


def test_per_device_streams_are_separate(fake_stream):
    nr.seed(3)
    host_before = np.random.get_state()[2]
    a = nr.rand(4, device="fake")
    assert np.random.get_state()[2] == host_before  # host untouched
    np.testing.assert_array_equal(a, np.random.RandomState(3).rand(4))
    state = nr.get_state()
    assert set(state) == {"host", "fake"}
    b, h = nr.rand(2, device="fake"), nr.rand(2)
    nr.set_state(state)
    np.testing.assert_array_equal(b, nr.rand(2, device="fake"))
    np.testing.assert_array_equal(h, nr.rand(2))


def test_state_with_unknown_stream_raises(fake_stream):
    state = nr.get_state()
    nr.unregister_stream("fake")
    with pytest.raises(NeedleError, match="no stream 'fake'"):
        nr.set_state(state)


def test_register_rejects_incomplete_stream():
    with pytest.raises(DeviceError, match="lacks seed"):
        nr.register_stream("bad", object())
    with pytest.raises(DeviceError):
        nr.stream_for(42)


def test_observers_see_every_draw_and_can_be_removed():
    with nr.observe_draws() as draws:
        a = nr.rand(2)
        nr.randint(0, 5, size=3)
    assert [d[0] for d in draws] == ["rand", "randint"]
    assert draws[0][1] == "host"
    np.testing.assert_array_equal(draws[0][2], a)
    seen = []
    handle = nr.add_draw_observer(lambda *args: seen.append(args))
    nr.randn(1)
    handle.remove()
    nr.randn(1)
    assert len(seen) == 1


def test_library_draws_go_through_needle_random():
    """init, Dropout, DataLoader shuffle and transforms all draw through needle.random."""
    import needle as ndl
    from needle import data, init, nn

    loader = data.DataLoader(data.NDArrayDataset(np.arange(6.0).reshape(6, 1)), 2,
                             shuffle=True)
    flip, crop = data.RandomFlipHorizontal(0.5), data.RandomCrop(1)
    with nr.observe_draws() as draws:
        nn.Linear(3, 2)                      # weight then bias: two rand draws
        nn.Dropout(0.5)(ndl.Tensor(np.ones((2, 3), np.float32)))   # one rand draw
        iter(loader)                         # one permutation per pass
        crop(flip(np.zeros((4, 4, 1))))      # one rand, one randint
        init.randn(2, 2)
    kinds = [kind for kind, _, _ in draws]
    assert kinds == ["rand", "rand", "rand", "permutation", "rand", "randint", "randn"]
    # the Linear weight draw has the weight's full shape (one draw: the course goldens need it)
    assert draws[0][2].shape == (3, 2)


def _devices():
    from needle.backend_ndarray import cpu, cpu_numpy
    from needle.backend_numpy import CPUDevice

    devices = [cpu_numpy(), CPUDevice()]
    return devices + ([cpu()] if cpu().enabled() else [])


@pytest.mark.parametrize("kind", ["rand", "randn"])
def test_device_draws_go_through_needle_random_and_stay_golden(kind):
    """BackendDevice.rand/randn (nd mode) and the np-mode CPU device draw through needle.random:
    the observers see them, and each is one global NumPy draw of the full shape."""
    for device in _devices():
        np.random.seed(5)
        with nr.observe_draws() as draws:
            got = getattr(device, kind)(2, 3)
        np.random.seed(5)
        want = getattr(np.random, kind)(2, 3)
        assert [d[0] for d in draws] == [kind], device
        assert draws[0][2].shape == (2, 3)
        values = got.numpy() if hasattr(got, "numpy") else got
        np.testing.assert_allclose(values, want, rtol=1e-6)  # nd devices store float32
