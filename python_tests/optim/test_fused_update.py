"""The optimizers' fused updates (one ``ewise_program`` per parameter, in place, no
temporaries) against their composed arithmetic: bitwise equal, for every rule, on every
device that has the kernel.

The composed path is what a device without ``ewise_program`` runs (cuda()); it is forced here
by making ``ewise_program.available`` say no.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim
from needle.autograd import Tensor
from needle.backend_ndarray import NDArray
from needle.backend_ndarray import ewise_program as program

RULES = {
    "sgd": lambda ps: optim.SGD(ps, lr=0.1),
    "sgd_wd": lambda ps: optim.SGD(ps, lr=0.1, weight_decay=0.05),
    "momentum": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
    "momentum_wd": lambda ps: optim.SGD(ps, lr=0.07, momentum=0.5, weight_decay=0.1),
    "adam": lambda ps: optim.Adam(ps, lr=0.05, beta1=0.8, beta2=0.95),
    "adam_wd": lambda ps: optim.Adam(ps, lr=0.01, weight_decay=0.01),
    "adamw": lambda ps: optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    # parameter groups: each group's own scalars, its own plan
    "adamw_groups": lambda ps: optim.AdamW([{"params": ps[:1], "lr": 0.03, "betas": (0.8, 0.9)},
                                            {"params": ps[1:], "weight_decay": 0.0}]),
    "momentum_groups": lambda ps: optim.SGD([{"params": ps[:1], "lr": 0.2}, {"params": ps[1:]}],
                                            lr=0.05, momentum=0.9),
}


def _train(rule, device, dtype, fused, monkeypatch, steps=3):
    rng = np.random.default_rng(7)
    ps = [nn.Parameter(Tensor(rng.standard_normal(shape), device=device, dtype=dtype))
          for shape in ((5, 3), (300,))]  # 300: more than one block of the fused kernel
    opt = RULES[rule](ps)
    calls = []  # launches of a program over one parameter's arrays, at the backend
    mod = device.mod
    one, many = mod.ewise_program, getattr(mod, "ewise_program_many", None)
    monkeypatch.setattr(mod, "ewise_program", lambda *a: calls.append(1) or one(*a))
    if many is not None:
        monkeypatch.setattr(mod, "ewise_program_many",
                            lambda launches, *a: calls.extend([1] * len(launches))
                            or many(launches, *a))
    if not fused:
        monkeypatch.setattr(program, "available", lambda arrays: False)
    for _ in range(steps):
        for p in ps:
            p.grad = Tensor(rng.standard_normal(p.shape), device=device, dtype=dtype,
                            requires_grad=False)
        opt.step()
    monkeypatch.undo()
    state = {name: [getattr(opt, name)[p].numpy() for p in ps if p in getattr(opt, name)]
             for name in opt._slots}
    return [p.numpy() for p in ps], state, len(calls)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_fused_update_is_bitwise_the_composed_one(device, rule, dtype, monkeypatch):
    if getattr(device.mod, "ewise_program", None) is None:
        pytest.skip(f"{device.name}() has no ewise_program: it runs the composed update")
    fused, fused_state, calls = _train(rule, device, dtype, True, monkeypatch)
    composed, composed_state, none = _train(rule, device, dtype, False, monkeypatch)
    # each step runs one program per parameter (in place, batched: Adam's m, v and θ in
    # one pass too), and the composed path none
    assert calls == 3 * 2 and none == 0
    for a, b in zip(fused, composed, strict=True):
        assert a.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, b)
    assert fused_state.keys() == composed_state.keys()
    for name in fused_state:
        assert len(fused_state[name]) == (0 if rule.startswith("sgd") else 2)
        for a, b in zip(fused_state[name], composed_state[name], strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_fused_update_on_emulated_cuda_is_bitwise_the_composed_one(emulated_cuda, rule,
                                                                   monkeypatch):
    """cuda()'s ewise_program (elementwise.cu) run through the emulator: the same bits."""
    test_fused_update_is_bitwise_the_composed_one(emulated_cuda, rule, "float32", monkeypatch)


def test_the_fused_update_allocates_no_temporaries():
    """The first step allocates the moments, later ones nothing: θ, m and v are rewritten in
    place, and ``optimizer_temp`` memory stays at zero."""
    from needle import memory as mem

    device = ndl.cpu()
    rng = np.random.default_rng(1)
    p = nn.Parameter(Tensor(rng.standard_normal((64, 64)), device=device))
    opt = optim.Adam([p], lr=0.01, weight_decay=0.01)
    for step in range(3):
        p.grad = Tensor(rng.standard_normal(p.shape), device=device, requires_grad=False)
        theta = p.realize_cached_data()
        moments = (opt.m.get(p), opt.v.get(p))
        mem.reset_peak(device)
        before = mem.stats(device)["by_category"]
        opt.step()
        stats = mem.stats(device)["by_category"]
        assert stats["optimizer_temp"]["peak"] == 0
        assert stats["optimizer"]["current"] >= 2 * 64 * 64 * 4  # m and v
        assert p.realize_cached_data() is theta  # the same array, written in place
        for cat in ("weight", "optimizer"):  # nothing new beside the old ones
            assert stats[cat]["peak"] == before[cat]["current"] + (
                2 * 64 * 64 * 4 if step == 0 and cat == "optimizer" else 0), (step, cat)
        if step:
            assert (opt.m[p], opt.v[p]) == moments


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_fused_update_writes_in_place_where_every_alias_sees_it(device, rule):
    """θ's buffer is rewritten, as PyTorch's optimizers do: a detached tensor sharing it sees
    the new values, and a graph that saved that tensor refuses to backpropagate afterwards."""
    from needle._core.errors import GraphError

    if getattr(device.mod, "ewise_program", None) is None:
        pytest.skip(f"{device.name}() has no ewise_program: it installs new arrays")
    layer = nn.Linear(3, 2, device=device)
    opt = RULES[rule](layer.parameters())
    alias = layer.weight.detach()
    x = Tensor(np.ones((4, 3), "float32"), device=device)
    stale = (x @ alias).sum()  # the product saves alias for x's gradient
    layer(x).sum().backward()
    before = alias.numpy()
    opt.step()
    np.testing.assert_array_equal(alias.numpy(), layer.weight.numpy())
    assert not np.array_equal(alias.numpy(), before)
    with pytest.raises(GraphError, match="saved"):
        stale.backward()


def test_programs_fall_back_for_arrays_they_cannot_take():
    """A view that is not compact, mixed dtypes or the NumPy mode's arrays: no program."""
    a = NDArray(np.ones((4, 4), "float32"), device=ndl.cpu())
    assert program.available((a, a))
    assert not program.available((a, a.permute((1, 0))))
    assert not program.available((a, NDArray(np.ones((4, 4)), device=ndl.cpu(),
                                             dtype="float64")))
    assert not program.available((a, NDArray(np.ones(16, "float32"), device=ndl.cpu())))
    assert not program.available((np.ones(3), np.ones(3)))


def test_a_program_frees_registers_instead_of_running_out():
    prog = program.Program(1)
    reg = 0
    for _ in range(40):  # 40 chained ops on 16 registers: each result frees the last one
        nxt = prog.scalar("add", reg, 0)
        if reg:
            prog.free(reg)
        reg = nxt
    prog.store(reg)
    x = NDArray(np.zeros(5, "float32"), device=ndl.cpu_numpy())
    (out,) = program.run(prog, (x,), [0.5])
    np.testing.assert_array_equal(out.numpy(), np.full(5, 20.0, "float32"))
    with pytest.raises(ValueError, match="registers live"):
        wide = program.Program(1)
        for _ in range(16):
            wide.unary("neg", 0)


# ----- the plan: the last plain step's launches, run again while they hold -------------------
def _scripted_steps(rule, device, planned: bool, monkeypatch):
    """Sixteen steps with a change before every other one from the fourth, each of which a
    stale plan would get wrong; returns the parameters and moments after every step, and
    how many steps ran from a plan."""
    from needle.optim import _PlainPlan

    ran = []
    real_run = _PlainPlan.run
    monkeypatch.setattr(_PlainPlan, "run",
                        lambda self, *a: ran.append(real_run(self, *a)) or ran[-1])
    if not planned:
        monkeypatch.setattr(_PlainPlan, "of", classmethod(lambda cls, *a: None))
    rng = np.random.default_rng(11)
    ps = [nn.Parameter(Tensor(rng.standard_normal(shape), device=device, dtype="float32"))
          for shape in ((4, 3), (3,), (5,))]
    opt = RULES[rule](ps[:2])
    history = []
    for step in range(16):
        for p in ps:
            p.grad = Tensor(rng.standard_normal(p.shape), device=device, dtype="float32",
                            requires_grad=False)
        if step == 3:
            ps[0].data = Tensor(rng.standard_normal((4, 3)), device=device, dtype="float32")
        if step == 5:
            opt.load_state_dict(opt.state_dict())  # new moment arrays, same values
        if step == 7:
            ps[1].grad = None  # not updated this step
        if step == 9:
            for name in ("momentum", "weight_decay"):
                if hasattr(opt, name):
                    setattr(opt, name, 0.3)
            opt.weight_decay = 0.02
        if step == 11:
            opt.params.append(ps[2])
        if step == 13:
            # a strided view (every other element of a buffer): not compact
            big = Tensor(rng.standard_normal(6), device=device,
                         dtype="float32").realize_cached_data()
            ps[1].grad = Tensor.make_const(NDArray.make((3,), strides=(2,), device=big.device,
                                                        handle=big._handle, offset=1))
        opt.step()
        history.append([p.numpy() for p in ps] + [getattr(opt, name)[p].numpy()
                                                   for name in opt._slots for p in ps
                                                   if p in getattr(opt, name)])
    monkeypatch.undo()
    return history, sum(1 for r in ran if r)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_planned_step_equals_the_rebuilt_one_through_every_change(device, rule, monkeypatch):
    """Steps run from the last step's plan give the bits of steps rebuilt parameter by
    parameter, across a replaced θ, reloaded moments, a parameter without a gradient,
    changed hyper-parameters, an added parameter and a gradient of another layout; and the
    plan does run (else this would compare the rebuilt path with itself)."""
    if getattr(device.mod, "ewise_program", None) is None:
        pytest.skip(f"{device.name}() has no ewise_program: no in-place updates to plan")
    planned, used = _scripted_steps(rule, device, True, monkeypatch)
    rebuilt, unused = _scripted_steps(rule, device, False, monkeypatch)
    assert used >= 5 and unused == 0
    for step, (a, b) in enumerate(zip(planned, rebuilt, strict=True)):
        assert len(a) == len(b), step
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y, err_msg=f"step {step}")
