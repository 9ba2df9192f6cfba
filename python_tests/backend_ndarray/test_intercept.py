"""``needle.backend_ndarray.intercept``: a handler stands in for a device's backend module, on
the calling thread only, nested blocks innermost first, and leaves the device as it was."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from needle._core.errors import DeviceError
from needle.backend_ndarray import NDArray, cpu, cpu_numpy, intercept
from needle.backend_ndarray.devices import BackendDevice

DEVICES = [pytest.param(cpu_numpy, id="cpu_numpy"),
           pytest.param(cpu, id="cpu", marks=pytest.mark.skipif(
               not cpu().enabled(), reason="cpu() backend not built"))]


class Tagged:
    """A stand-in module: logs ``(tag, kernel name)`` for every kernel called through it."""

    def __init__(self, mod, tag: str, log: list, hide=()):
        self.mod, self.tag, self.log, self.hide = mod, tag, log, set(hide)

    def __getattr__(self, name):
        if name in self.hide:
            raise AttributeError(name)
        value = getattr(self.mod, name)
        if not callable(value) or isinstance(value, type) or name.startswith("_"):
            return value

        def call(*args, **kwargs):
            self.log.append((self.tag, name))
            return value(*args, **kwargs)

        return call


def _add(dev) -> list:
    a = NDArray(np.ones(4, dtype="float32"), device=dev)
    return (a + a).numpy().tolist()


def _snapshot(dev) -> dict:
    return dict(dev.__dict__)


def _same(dev, attrs: dict) -> bool:
    """The device's own attributes are exactly ``attrs`` (same names, same objects)."""
    return dev.__dict__.keys() == attrs.keys() \
        and all(dev.__dict__[k] is v for k, v in attrs.items())


@pytest.mark.parametrize("make", DEVICES)
def test_the_handler_serves_the_block_and_the_device_is_untouched(make):
    dev = make()
    _add(dev)  # kernels cached on the device before the block
    real, before, log = dev.mod, _snapshot(dev), []
    with intercept(dev, Tagged(real, "h", log)) as handler:
        assert dev.mod is handler and dev.enabled()
        assert _add(dev) == [2.0] * 4
        assert ("h", "ewise_add") in log
        assert _same(dev, before)  # nothing cached or replaced on the device
        assert isinstance(dev, BackendDevice) and dev == make() and str(dev) == str(make())
    assert _same(dev, before) and type(dev) is BackendDevice and dev.mod is real
    log.clear()
    assert _add(dev) == [2.0] * 4 and log == []


@pytest.mark.parametrize("make", DEVICES)
def test_nested_blocks_innermost_wins_and_the_outer_comes_back(make):
    dev = make()
    real, log = dev.mod, []
    with intercept(dev, Tagged(real, "outer", log)) as outer:
        with intercept(dev, Tagged(real, "inner", log)) as inner:
            assert dev.mod is inner
            _add(dev)
            assert {tag for tag, _ in log} == {"inner"}
        log.clear()
        assert dev.mod is outer
        _add(dev)
        assert {tag for tag, _ in log} == {"outer"}
    assert dev.mod is real and type(dev) is BackendDevice


@pytest.mark.parametrize("make", DEVICES)
def test_an_exception_restores_the_enclosing_handler_then_the_device(make):
    dev = make()
    real, before = dev.mod, _snapshot(dev)
    with intercept(dev, Tagged(real, "outer", [])) as outer:
        with pytest.raises(RuntimeError, match="inner"):
            with intercept(dev, Tagged(real, "inner", [])):
                raise RuntimeError("inner")
        assert dev.mod is outer
    with pytest.raises(RuntimeError, match="outer"):
        with intercept(dev, Tagged(real, "outer", [])):
            with intercept(dev, Tagged(real, "inner", [])):
                raise RuntimeError("outer")
    assert dev.mod is real and _same(dev, before) and type(dev) is BackendDevice


def test_other_threads_keep_the_real_module():
    dev = cpu_numpy()
    real, log = dev.mod, []
    seen: dict = {}

    def other():
        seen["mod"] = dev.mod
        seen["sum"] = _add(dev)

    with intercept(dev, Tagged(real, "main", log)):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert dev.mod is not real  # this thread's view
    assert seen["mod"] is real and seen["sum"] == [2.0] * 4
    assert log == []  # the other thread's add did not reach the handler


def test_a_threads_block_is_invisible_to_the_others_until_the_last_one_ends():
    dev = cpu_numpy()
    real, log = dev.mod, []
    entered = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]
    errors: list = []

    def worker(i):
        try:
            with intercept(dev, Tagged(real, f"t{i}", log)) as handler:
                entered[i].set()
                leave[i].wait(10)
                assert dev.mod is handler
                _add(dev)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for e in entered:
        assert e.wait(10)
    assert dev.mod is real and _add(dev) == [2.0] * 4  # this thread: no handler
    leave[0].set()
    threads[0].join(10)
    # thread 0 ended its block; thread 1 still intercepts, and its add (made only now)
    # reaches its own handler
    leave[1].set()
    threads[1].join(10)
    assert not errors
    assert ("t0", "ewise_add") in log and ("t1", "ewise_add") in log
    assert {tag for tag, _ in log} == {"t0", "t1"}
    assert type(dev) is BackendDevice and dev.mod is real


def test_a_name_the_handler_lacks_is_absent_on_the_device():
    dev = cpu_numpy()
    assert getattr(dev, "ewise_add", None) is not None
    with intercept(dev, Tagged(dev.mod, "h", [], hide={"ewise_add"})):
        assert getattr(dev, "ewise_add", None) is None
        with pytest.raises(AttributeError):
            dev.ewise_add  # noqa: B018 - the lookup is the test
    assert getattr(dev, "ewise_add", None) is not None


def test_bad_arguments_are_refused():
    with pytest.raises(DeviceError, match="BackendDevice"):
        with intercept("cpu", object()):
            pass
    with pytest.raises(DeviceError, match="handler"):
        with intercept(cpu_numpy(), None):
            pass
    assert type(cpu_numpy()) is BackendDevice
