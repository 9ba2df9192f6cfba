"""The kernel recorder reaches the device and needle.random only through their declared hooks
(``needle.backend_ndarray.intercept``, ``needle.random.add_state_observer``): the device's
attributes and the random module's functions are the same objects before, during and after a
recording, and other threads are neither recorded nor redirected."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import needle as ndl
from needle import random as nr
from needle.backend_ndarray import intercept
from needle.backend_ndarray.devices import BackendDevice
from needle.compiler.recorder import Call, record_kernels

DEVICES = [pytest.param(ndl.cpu_numpy, id="cpu_numpy"),
           pytest.param(ndl.cpu, id="cpu", marks=pytest.mark.skipif(
               not ndl.cpu().enabled(), reason="cpu() backend not built"))]


def _attrs(dev) -> dict:
    return dict(dev.__dict__)


def _same(dev, attrs: dict) -> bool:
    return dev.__dict__.keys() == attrs.keys() \
        and all(dev.__dict__[k] is v for k, v in attrs.items())


@pytest.mark.parametrize("make", DEVICES)
def test_recording_leaves_the_device_attributes_alone(make):
    dev = make()
    x = ndl.Tensor(np.ones((2, 3), dtype="float32"), device=dev)
    (x * 3).sum()  # the kernels are cached on the device now
    before, real = _attrs(dev), dev.mod
    with record_kernels(dev) as rec:
        assert _same(dev, before)
        (x * 3).sum()
        assert _same(dev, before)  # recorded, yet nothing on the device was replaced
        assert dev.mod is not real  # this thread's lookups go to the recorder
    assert _same(dev, before) and dev.mod is real and type(dev) is BackendDevice
    assert [op.name for op in rec.ops if isinstance(op, Call)] == ["scalar_mul", "reduce_sum"]


def test_another_threads_kernels_are_neither_recorded_nor_redirected():
    dev = ndl.cpu_numpy()
    x = ndl.Tensor(np.ones(4, dtype="float32"), device=dev)
    real = dev.mod
    seen: dict = {}

    def other():
        seen["mod"] = dev.mod
        seen["value"] = (x + 1).numpy().tolist()

    with record_kernels(dev) as rec:
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == {"mod": real, "value": [2.0] * 4}
    assert rec.ops == [] and rec.problems == []


def test_a_set_state_of_the_recording_thread_makes_the_recording_unreplayable():
    dev = ndl.cpu_numpy()
    original = nr.set_state
    state = nr.get_state()
    with record_kernels(dev) as rec:
        assert nr.set_state is original  # observed, not rebound
        nr.set_state(state)
    assert any("sets a needle.random state" in p for p in rec.problems)
    assert nr.set_state is original


def test_a_set_state_of_another_thread_is_not_the_steps():
    dev = ndl.cpu_numpy()
    state = nr.get_state()
    with record_kernels(dev) as rec:
        t = threading.Thread(target=nr.set_state, args=(state,))
        t.start()
        t.join()
    assert rec.problems == []


def test_a_recording_inside_an_intercepting_block_gives_the_device_back_to_it():
    dev = ndl.cpu_numpy()

    class Passing:
        def __init__(self, mod):
            self.mod = mod

        def __getattr__(self, name):
            return getattr(self.mod, name)

    with intercept(dev, Passing(dev.mod)) as outer:
        with pytest.raises(ValueError, match="inside"):
            with record_kernels(dev):
                assert dev.mod is not outer
                raise ValueError("inside")
        assert dev.mod is outer
    assert type(dev) is BackendDevice
