"""PyTorch's optimizer habits: AdamW, ``betas=``, ``param_groups`` and learning-rate
schedulers, each checked against the published rule written out in NumPy (float64)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim
from needle._core.errors import OptimizerError, SerializationError
from needle.autograd import Tensor
from needle.optim import lr_scheduler as sch
from needle.train_state import TrainState


def _params(device, dtype="float32", shapes=((4, 3), (5,))):
    rng = np.random.default_rng(3)
    return [nn.Parameter(Tensor(rng.standard_normal(s), device=device, dtype=dtype))
            for s in shapes]


def _grads(step, shapes):
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(s) for s in shapes]


def _adamw_reference(theta, grads_per_step, lr, b1, b2, eps, wd):
    """Loshchilov & Hutter's AdamW as PyTorch documents it: decay θ by lr·wd, then Adam's
    bias-corrected step with the raw gradient."""
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    for t, g in enumerate(grads_per_step, start=1):
        theta = theta * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        theta = theta - lr * m_hat / (np.sqrt(v_hat) + eps)
    return theta


# "plain": in place, batched; "scaled": a gradient scale of 1 takes the fused path that
# installs new arrays; "half": float16 parameters take the composed path on float32 masters
@pytest.mark.parametrize("path", ["plain", "scaled", "half"])
def test_adamw_matches_the_published_update(device, path):
    shapes = ((4, 3), (5,))
    dtype = "float16" if path == "half" else "float32"
    ps = _params(device, dtype, shapes)
    start = [p.numpy().astype(np.float64) for p in ps]
    lr, b1, b2, eps, wd = 0.05, 0.8, 0.95, 1e-8, 0.3
    opt = optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    if path == "scaled":
        opt.set_grad_scale(1.0)
    steps = [_grads(k, shapes) for k in range(5)]
    for grads in steps:
        for p, g in zip(ps, grads, strict=True):
            p.grad = Tensor(g, device=device, dtype=dtype, requires_grad=False)
        opt.step()
    tol = 2e-3 if path == "half" else 1e-5
    for i, p in enumerate(ps):
        expected = _adamw_reference(start[i], [g[i] for g in steps], lr, b1, b2, eps, wd)
        np.testing.assert_allclose(p.numpy(), expected, rtol=tol, atol=tol)


def test_adamw_is_not_adam_with_l2():
    """With a zero gradient Adam's L2 decay gives a full lr-sized step, AdamW shrinks θ by
    exactly lr·wd: the decay is decoupled from the adaptive scaling."""
    p = Tensor(np.full(3, 2.0, np.float32))
    p.grad = Tensor(np.zeros(3, np.float32))
    optim.AdamW([p], lr=0.1, weight_decay=0.5).step()
    np.testing.assert_allclose(p.numpy(), 2.0 * (1 - 0.1 * 0.5), rtol=1e-6)
    assert optim.AdamW([p]).param_groups[0]["lr"] == 1e-3  # PyTorch's defaults
    assert optim.AdamW([p]).weight_decay == 1e-2


def test_betas_is_beta1_beta2():
    a, b = Tensor(np.ones(3, np.float32)), Tensor(np.ones(3, np.float32))
    for p in (a, b):
        p.grad = Tensor(np.array([0.5, -1.0, 2.0], np.float32))
    one = optim.Adam([a], lr=0.1, betas=(0.7, 0.9))
    other = optim.Adam([b], lr=0.1, beta1=0.7, beta2=0.9)
    for _ in range(3):
        one.step()
        other.step()
    assert (one.beta1, one.beta2) == (0.7, 0.9)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(OptimizerError, match=r"Adam: betas given twice"):
        optim.Adam([a], beta1=0.5, betas=(0.7, 0.9))
    with pytest.raises(OptimizerError, match=r"Adam: betas must be a pair"):
        optim.Adam([a], betas=0.9)


def test_param_groups_step_each_group_with_its_own_lr(device):
    shapes = ((4, 3), (5,))
    ps = _params(device, shapes=shapes)
    start = [p.numpy().astype(np.float64) for p in ps]
    opt = optim.SGD([{"params": [ps[0]], "lr": 0.5}, {"params": [ps[1]]}], lr=0.1,
                    momentum=0.0)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    assert opt.params == ps
    expected = [s.copy() for s in start]
    for step in range(4):
        if step == 2:  # set per group, read by the next step
            opt.param_groups[1]["lr"] = 0.02
        grads = _grads(step, shapes)
        for p, g in zip(ps, grads, strict=True):
            p.grad = Tensor(g, device=device, dtype="float32", requires_grad=False)
        opt.step()
        lrs = [0.5, 0.1 if step < 2 else 0.02]
        expected = [e - lr * g for e, lr, g in zip(expected, lrs, grads, strict=True)]
    for p, e in zip(ps, expected, strict=True):
        np.testing.assert_allclose(p.numpy(), e, rtol=1e-5, atol=1e-5)


def test_param_groups_of_one_group_are_the_optimizer_attributes():
    p = Tensor(np.ones(2, np.float32))
    opt = optim.Adam([p], lr=0.01)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] is opt.params
    opt.param_groups[0]["lr"] = 0.2
    assert opt.lr == 0.2
    opt.lr = 0.3  # the course's attribute sets every group
    assert opt.param_groups[0]["lr"] == 0.3


def test_param_groups_survive_state_dict():
    ps = _params(ndl.cpu())
    opt = optim.Adam([{"params": ps[:1], "lr": 0.5}, {"params": ps[1:], "betas": (0.5, 0.6)}])
    for p in ps:
        p.grad = Tensor(np.ones(p.shape, np.float32))
    opt.step()
    state = opt.state_dict()
    other = optim.Adam([{"params": ps[:1]}, {"params": ps[1:]}])
    other.load_state_dict(state)
    assert [(g["lr"], g["beta1"], g["beta2"]) for g in other.param_groups] == \
        [(0.5, 0.9, 0.999), (0.01, 0.5, 0.6)]
    with pytest.raises(SerializationError, match=r"parameter groups differ"):
        optim.Adam([{"params": ps}]).load_state_dict(state)


def test_bad_param_groups_are_refused():
    p, q = Tensor(np.ones(2)), Tensor(np.ones(2))
    with pytest.raises(OptimizerError, match=r"a parameter is in two groups"):
        optim.SGD([{"params": [p]}, {"params": [p, q]}])
    with pytest.raises(OptimizerError, match=r"a parameter group has no 'params'"):
        optim.SGD([{"lr": 0.1}])
    with pytest.raises(OptimizerError, match=r"hyper-parameter 'lr' of group 0 is not a number"):
        optim.SGD([{"params": [p], "lr": "fast"}])
    with pytest.raises(OptimizerError, match=r"mixes tensors and parameter groups"):
        optim.SGD([p, {"params": [q]}])


# ----- schedulers: the closed forms PyTorch documents, resumed exactly -----------------------
def _rates(make, epochs=12, lr=0.8):
    opt = optim.SGD([Tensor(np.ones(1))], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(epochs):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_step_lr():
    assert _rates(lambda o: sch.StepLR(o, step_size=3, gamma=0.5)) == pytest.approx(
        [0.8 * 0.5 ** (e // 3) for e in range(12)])


def test_cosine_annealing():
    expected = [0.1 + (0.8 - 0.1) * (1 + math.cos(math.pi * e / 10)) / 2 for e in range(12)]
    assert _rates(lambda o: sch.CosineAnnealingLR(o, T_max=10, eta_min=0.1)) == \
        pytest.approx(expected)


def test_linear_warmup_then_cosine():
    def make(o):
        warm = sch.LinearLR(o, start_factor=0.1, total_iters=4)
        return sch.SequentialLR(o, [warm, sch.CosineAnnealingLR(o, T_max=8)], milestones=[4])
    expected = [0.8 * (0.1 + 0.9 * e / 4) for e in range(4)]
    expected += [0.8 * (1 + math.cos(math.pi * (e - 4) / 8)) / 2 for e in range(4, 12)]
    assert _rates(make) == pytest.approx(expected)


def test_scheduler_reads_and_sets_every_group():
    p, q = Tensor(np.ones(1)), Tensor(np.ones(1))
    opt = optim.SGD([{"params": [p], "lr": 1.0}, {"params": [q], "lr": 0.1}])
    sched = optim.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.05] == sched.get_last_lr()


@pytest.mark.parametrize("make", [
    lambda o: sch.StepLR(o, step_size=2, gamma=0.3),
    lambda o: sch.CosineAnnealingLR(o, T_max=7, eta_min=0.01),
    lambda o: sch.SequentialLR(o, [sch.LinearLR(o, 0.2, total_iters=3),
                                   sch.CosineAnnealingLR(o, T_max=5)], milestones=[3]),
], ids=["step", "cosine", "warmup_cosine"])
def test_scheduler_resumes_exactly_through_train_state(tmp_path, make):
    """Five epochs, save with TrainState, restore into fresh objects, five more: the rates
    are those of ten uninterrupted epochs."""
    whole = _rates(make, epochs=10)
    p = Tensor(np.ones(1))
    opt = optim.SGD([p], lr=0.8)
    sched = make(opt)
    first = []
    for _ in range(5):
        first.append(opt.param_groups[0]["lr"])
        sched.step()
    TrainState(optimizer=opt, scheduler=sched).save(str(tmp_path), step=5)
    opt2 = optim.SGD([p], lr=0.8)
    sched2 = make(opt2)
    TrainState(optimizer=opt2, scheduler=sched2).load(str(tmp_path))
    rest = []
    for _ in range(5):
        rest.append(opt2.param_groups[0]["lr"])
        sched2.step()
    assert first + rest == pytest.approx(whole, rel=0, abs=0)


def test_scheduler_refuses_bad_arguments_and_states():
    opt = optim.SGD([Tensor(np.ones(1))], lr=0.1)
    with pytest.raises(OptimizerError, match=r"StepLR: step_size must be an int >= 1"):
        sch.StepLR(opt, step_size=0)
    with pytest.raises(OptimizerError, match=r"expected an optimizer with param_groups"):
        sch.StepLR(object(), step_size=1)
    state = sch.StepLR(opt, step_size=1).state_dict()
    with pytest.raises(SerializationError, match=r"scheduler type differs"):
        sch.CosineAnnealingLR(opt, T_max=3).load_state_dict(state)
