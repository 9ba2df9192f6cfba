"""``amp.GradScaler`` talks to an optimizer through ``grads_finite()`` and
``set_grad_scale(scale)`` only (with ``params`` and ``step()``): a wrapper that provides them
works, whatever else it has or lacks."""
from __future__ import annotations

import numpy as np

import needle as ndl
from needle import amp, optim


class Wrapper:
    """Stands in for an optimizer, as DDP's and ZeRO's wrappers do. It carries the attributes
    the scaler used to probe (``all_grads_finite``, ``ddp``, ``optimizer``) with answers that
    contradict ``grads_finite``: the scaler must follow ``grads_finite``."""

    def __init__(self, inner, finite: bool):
        self._inner, self.finite, self.calls = inner, finite, []
        self.optimizer = inner
        self.ddp = self  # a probe for ``finish_gradient_sync`` would fail: there is none
        self.all_grads_finite = lambda: not finite

    @property
    def params(self):
        return self._inner.params

    def grads_finite(self) -> bool:
        self.calls.append("grads_finite")
        return self.finite

    def set_grad_scale(self, scale) -> None:
        self.calls.append(("set_grad_scale", scale))
        self._inner.set_grad_scale(scale)

    def step(self) -> None:
        self.calls.append(("step", self._inner.grad_scale))
        self._inner.step()


def _setup(finite: bool):
    p = ndl.Tensor(np.ones(2), dtype="float16")
    inner = optim.SGD([p], lr=1.0)
    p.grad = ndl.Tensor(np.full(2, 4.0), dtype="float16")
    return p, Wrapper(inner, finite)


def test_a_good_step_asks_grads_finite_then_runs_under_the_scale():
    p, opt = _setup(finite=True)
    scaler = amp.GradScaler(init_scale=4.0)
    assert scaler.step(opt) is True
    assert opt.calls == ["grads_finite", ("set_grad_scale", 4.0), ("step", 4.0),
                         ("set_grad_scale", None)]
    assert p.numpy().tolist() == [0.0, 0.0]  # 1 - 4 / 4
    assert opt._inner.grad_scale is None


def test_a_bad_answer_skips_the_step():
    p, opt = _setup(finite=False)
    scaler = amp.GradScaler(init_scale=4.0)
    assert scaler.step(opt) is False
    assert opt.calls == ["grads_finite"]
    assert p.numpy().tolist() == [1.0, 1.0]
    scaler.update()
    assert scaler.get_scale() == 2.0


def test_unscale_asks_once_and_the_step_then_runs_unscaled():
    p, opt = _setup(finite=True)
    scaler = amp.GradScaler(init_scale=4.0)
    scaler.unscale_(opt)
    assert scaler.step(opt) is True
    assert opt.calls == ["grads_finite", ("step", None)]
    assert p.numpy().tolist() == [0.0, 0.0]


def test_the_scale_is_taken_back_when_the_step_raises():
    p, opt = _setup(finite=True)

    def failing():
        raise RuntimeError("step failed")

    opt._inner.step = failing
    scaler = amp.GradScaler(init_scale=4.0)
    try:
        scaler.step(opt)
    except RuntimeError:
        pass
    assert opt.calls[-1] == ("set_grad_scale", None) and opt._inner.grad_scale is None
