"""One callback idiom: every registration returns a RemovableHandle whose remove() works."""
from __future__ import annotations

import numpy as np

import needle as ndl
from needle import random as nr
from needle._core.handles import Callbacks, RemovableHandle
from needle.backend_ndarray import devices
from needle.memory import categories, observers, timeline


def _fires(register, trigger) -> tuple:
    """(calls before remove, calls after remove) for one registration."""
    calls = []
    handle = register(lambda *args: calls.append(args))
    assert isinstance(handle, RemovableHandle)
    trigger()
    before = len(calls)
    handle.remove()
    handle.remove()  # twice is harmless
    trigger()
    return before, len(calls) - before


def test_every_registration_returns_a_working_handle():
    x = ndl.Tensor([1.0, 2.0])

    def backward():
        (x * 2).sum().backward()

    class Counting(observers.Observer):
        def __init__(self, fn):
            self.fn = fn

        def op_begin(self, op, inputs):
            self.fn(op)

    def new_device():
        saved = devices._DEVICES.pop("cpu_numpy")  # the next call makes the device afresh
        devices.cpu_numpy()
        devices._DEVICES["cpu_numpy"] = saved  # the rest of the suite keeps its device

    def enter_category():
        with categories.category("workspace"):
            pass

    cases = {
        "register_hook": (x.register_hook, backward),
        "post_accumulate_grad_hook": (x.register_post_accumulate_grad_hook, backward),
        "random draw observer": (nr.add_draw_observer, lambda: nr.rand(2)),
        "memory observer": (lambda fn: observers.add_observer(Counting(fn)),
                            lambda: x * 3),
        "category listener": (categories.add_listener, enter_category),
        "op-name listener": (timeline.add_op_listener,
                             lambda: timeline.set_current_op(timeline.current_op())),
        "device hook": (devices.add_device_hook, new_device),
    }
    for name, (register, trigger) in cases.items():
        before, after = _fires(register, trigger)
        assert before >= 1 and after == 0, name
    assert observers.active_observer() is None


def test_callbacks_iterate_a_snapshot_and_report_changes():
    changes = []
    registry = Callbacks(on_change=lambda: changes.append(len(registry)))
    handles = []

    def remove_all():
        for h in handles:
            h.remove()

    handles.append(registry.add(remove_all))
    handles.append(registry.add(lambda: None))
    for fn in registry:  # a callback removing others while the walk goes on
        fn()
    assert len(registry) == 0 and not registry
    assert changes == [1, 2, 1, 0]
    with registry.add(print) as handle:
        assert len(registry) == 1 and isinstance(handle.id, int)
    assert len(registry) == 0


def test_the_gradient_hook_still_replaces_the_gradient():
    x = ndl.Tensor([1.0, 2.0])
    with x.register_hook(lambda g: g * 10):
        (x * 1).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [10.0, 10.0])
