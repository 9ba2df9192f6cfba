"""GradScaler when the user calls ``unscale_()`` first (to clip): an Inf/NaN gradient still
skips the step and backs the scale off; a finite one steps once with the unscaled values."""
from __future__ import annotations

import numpy as np
import pytest

from needle import amp, optim
from needle.autograd import Tensor


def _sgd(values, lr=1.0):
    p = Tensor(np.asarray(values, dtype=np.float32), dtype="float32")
    return p, optim.SGD([p], lr=lr)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_an_overflow_found_by_unscale_skips_the_step_and_backs_off(bad):
    p, opt = _sgd([1.0, 2.0])
    scaler = amp.GradScaler(init_scale=8.0, backoff_factor=0.25, growth_interval=1)
    p.grad = Tensor(np.array([bad, 16.0], dtype=np.float32), dtype="float32")
    scaler.unscale_(opt)
    assert scaler.step(opt) is False
    np.testing.assert_array_equal(p.numpy(), [1.0, 2.0])  # the weights are untouched
    scaler.update()
    assert scaler.get_scale() == 2.0 and scaler.skipped_steps == 1
    # the next iteration is an ordinary one (no overflow remembered)
    p.grad = Tensor(np.array([4.0, 8.0], dtype=np.float32), dtype="float32")
    scaler.unscale_(opt)
    assert scaler.step(opt) is True
    np.testing.assert_array_equal(p.numpy(), [-1.0, -2.0])  # 1 - 4/2, 2 - 8/2
    scaler.update()
    assert scaler.get_scale() == 4.0 and scaler.skipped_steps == 1  # growth_interval 1


def test_unscale_on_one_optimizer_overflow_on_the_other_skips_only_that_one():
    """Two optimizers, only the first unscaled, only the second overflowing: the first
    steps, the second does not, and update() backs off once."""
    a, opt_a = _sgd([0.0])
    b, opt_b = _sgd([5.0])
    scaler = amp.GradScaler(init_scale=4.0)
    a.grad = Tensor(np.array([8.0], dtype=np.float32), dtype="float32")
    b.grad = Tensor(np.array([np.nan], dtype=np.float32), dtype="float32")
    scaler.unscale_(opt_a)
    assert scaler.step(opt_a) is True and scaler.step(opt_b) is False
    np.testing.assert_array_equal(a.numpy(), [-2.0])
    np.testing.assert_array_equal(b.numpy(), [5.0])
    scaler.update()
    assert scaler.get_scale() == 2.0 and scaler.skipped_steps == 1
