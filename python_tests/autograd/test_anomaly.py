"""needle.autograd.detect_anomaly: the first op that makes a NaN/Inf, in forward or backward,
with the user's source line; nothing is checked outside the block."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle.autograd import NonFiniteError, detect_anomaly
from needle.memory.observers import active_observer


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_forward_log_of_zero_names_the_op_and_this_line():
    x = ndl.Tensor(np.array([1.0, 0.0], np.float32), requires_grad=True)
    with pytest.raises(NonFiniteError) as info:
        with detect_anomaly():
            ndl.log(x)  # the planted log(0)
    err = info.value
    assert (err.op, err.phase, err.values, err.inputs_finite) == ("Log", "forward", "-inf", True)
    assert f"test_anomaly.py:{_line_of('the planted log(0)')}" in err.site
    assert "ndl.log(x)" in str(err)
    assert active_observer() is None  # the block leaves nothing behind


def test_backward_names_the_op_differentiated_and_its_forward_line():
    x = ndl.Tensor(np.array([0.0, 4.0], np.float32), requires_grad=True)
    with detect_anomaly():
        y = (x ** 0.5).sum()  # finite forward, infinite gradient at 0
        with pytest.raises(NonFiniteError) as info:
            y.backward()
    err = info.value
    assert err.phase == "backward" and err.backward_of == "PowerScalar"
    assert "inf" in err.values and err.inputs_finite
    assert f"test_anomaly.py:{_line_of('finite forward, infinite gradient')}" in err.site


def test_an_op_fed_a_nan_says_its_inputs_were_not_finite():
    x = ndl.Tensor(np.array([np.nan, 1.0], np.float32))
    with pytest.raises(NonFiniteError) as info:
        with detect_anomaly():
            x * 2
    assert info.value.values == "nan" and not info.value.inputs_finite
    assert "already held NaN/Inf" in str(info.value)


def test_finite_work_runs_unchanged_and_nothing_is_checked_outside():
    x = ndl.Tensor(np.array([4.0, 1.0], np.float32), requires_grad=True)
    with detect_anomaly():
        ndl.log(x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [0.25, 1.0])
    ndl.log(ndl.Tensor(np.zeros(2, np.float32)))  # outside the block: no error
