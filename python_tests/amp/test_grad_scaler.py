"""GradScaler (skip + backoff, growth, state) and the optimizers' float32 master weights."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle import amp, nn, optim
from needle._core.errors import NeedleError
from needle.autograd import Tensor


def _model(device, seed=0):
    np.random.seed(seed)
    return amp.cast_parameters(nn.Sequential(nn.Linear(5, 8, device=device), nn.ReLU(),
                                             nn.Linear(8, 3, device=device)))


def _batch(device, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return (Tensor(rng.standard_normal((6, 5)) * scale, device=device, requires_grad=False),
            Tensor(rng.integers(0, 3, 6), device=device, requires_grad=False))


def _step(model, opt, scaler, x, y):
    with amp.autocast():
        loss = nn.SoftmaxLoss()(model(x), y)
    opt.reset_grad()
    scaler.scale(loss).backward()
    ran = scaler.step(opt)
    scaler.update()
    return ran


def _snapshot(model, opt):
    state = opt.state_dict()
    return ([p.numpy().copy() for p in model.parameters()],
            {k: {i: v.copy() for i, v in slot.items()} for k, slot in state["state"].items()},
            state["extra"])


def _same(a, b):
    pa, sa, ea = a
    pb, sb, eb = b
    assert all(np.array_equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert sa.keys() == sb.keys() and ea == eb
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        assert all(np.array_equal(sa[k][i], sb[k][i]) for i in sa[k])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the planted overflow
def test_a_planted_overflow_skips_exactly_that_step(device):
    model = _model(device)
    opt = optim.Adam(model.parameters(), lr=1e-2)
    scaler = amp.GradScaler(init_scale=2.0 ** 10, growth_interval=1000)
    assert _step(model, opt, scaler, *_batch(device, 0))
    before = _snapshot(model, opt)
    # step 2: an input of 1e4 makes float16 activations and gradients overflow
    x, y = _batch(device, 1, scale=1e4)
    assert not _step(model, opt, scaler, x, y)
    _same(before, _snapshot(model, opt))  # weights, moments, masters, t: all untouched
    assert opt.t == 1 and scaler.get_scale() == 2.0 ** 9 and scaler.skipped_steps == 1
    # step 3 is an ordinary step again
    assert _step(model, opt, scaler, *_batch(device, 2))
    assert opt.t == 2 and scaler.get_scale() == 2.0 ** 9
    assert not np.array_equal(before[0][0], model.parameters()[0].numpy())


def test_scale_grows_after_growth_interval_good_steps():
    p = Tensor(np.ones(3), dtype="float16")
    opt = optim.SGD([p], lr=0.0)
    scaler = amp.GradScaler(init_scale=8.0, growth_factor=2.0, growth_interval=3)
    scales = []
    for i in range(7):
        p.grad = Tensor(np.full(3, np.nan if i == 4 else 1.0), dtype="float16")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    # good, good, good (grow), good, bad (halve, tracker reset), good, good
    assert scales == [8.0, 8.0, 16.0, 16.0, 8.0, 8.0, 8.0]
    assert scaler.skipped_steps == 1 and scaler.steps == 7


def test_step_divides_gradients_by_the_scale_in_float32():
    """A float16 gradient of 3 * 2**14 is 0.75 at scale 2**16: the update must see 0.75."""
    p = Tensor(np.zeros(2), dtype="float16")
    opt = optim.SGD([p], lr=1.0)
    scaler = amp.GradScaler(init_scale=2.0 ** 16)
    p.grad = Tensor(np.full(2, 3 * 2.0 ** 14), dtype="float16")
    assert scaler.step(opt)
    assert p.numpy().tolist() == [-0.75, -0.75] and opt.grad_scale is None
    np.testing.assert_array_equal(opt.master[p].numpy(), [-0.75, -0.75])


def test_unscale_then_step_and_errors():
    p = Tensor(np.zeros(2), dtype="float32")
    opt = optim.SGD([p], lr=1.0)
    scaler = amp.GradScaler(init_scale=4.0)
    p.grad = Tensor(np.array([4.0, 8.0]), dtype="float32")
    scaler.unscale_(opt)
    np.testing.assert_array_equal(p.grad.numpy(), [1.0, 2.0])
    with pytest.raises(NeedleError, match="already called"):
        scaler.unscale_(opt)
    assert scaler.step(opt)
    np.testing.assert_array_equal(p.numpy(), [-1.0, -2.0])
    with pytest.raises(NeedleError, match="growth_factor > 1"):
        amp.GradScaler(growth_factor=0.5)


def test_state_dict_round_trip_and_disabled_scaler(tmp_path):
    a = amp.GradScaler(init_scale=32.0, growth_interval=5)
    p = Tensor(np.ones(1), dtype="float16")
    opt = optim.SGD([p], lr=0.1)
    for g in (1.0, np.inf, 1.0):
        p.grad = Tensor(np.array([g]), dtype="float16")
        a.step(opt)
        a.update()
    ndl.save(a.state_dict(), str(tmp_path / "scaler.ndl"))
    state = ndl.load(str(tmp_path / "scaler.ndl"))
    b = amp.GradScaler()
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    assert (b.get_scale(), b.skipped_steps, b._growth_tracker) == (16.0, 1, 1)
    with pytest.raises(NeedleError, match="missing"):
        b.load_state_dict({"scale": 1.0})
    off = amp.GradScaler(enabled=False)
    loss = Tensor(np.array(2.0))
    assert off.scale(loss) is loss and off.get_scale() == 1.0
    p.grad = Tensor(np.array([np.inf]), dtype="float16")
    assert off.step(opt)  # disabled: no check, the step runs


def test_master_weights_follow_the_float32_update(device):
    """Adam on a float16 parameter equals Adam on a float32 copy fed the same float16
    gradients: the master is that float32 parameter, the weight is its float16 rounding."""
    rng = np.random.default_rng(3)
    start = rng.standard_normal(7)
    p16 = nn.Parameter(Tensor(start, device=device, dtype="float16"))
    p32 = nn.Parameter(Tensor(p16.numpy(), device=device, dtype="float32"))
    o16, o32 = optim.Adam([p16], lr=1e-3), optim.Adam([p32], lr=1e-3)
    for _ in range(5):
        g = rng.standard_normal(7).astype(np.float16)
        p16.grad = Tensor(g, device=device, dtype="float16")
        p32.grad = Tensor(g, device=device, dtype="float32")
        o16.step()
        o32.step()
    master = o16.master[p16].numpy()
    assert master.dtype == np.float32 and o16.m[p16].dtype == "float32"
    np.testing.assert_array_equal(master, p32.numpy())
    np.testing.assert_array_equal(p16.numpy(), p32.numpy().astype(np.float16))
    # the saved state carries the master; a fresh optimizer continues identically
    fresh = optim.Adam([p16], lr=1e-3)
    fresh.load_state_dict(o16.state_dict())
    np.testing.assert_array_equal(fresh.master[p16].numpy(), master)
    # replacing the data (p.data = ...) makes the optimizer rebuild the master from it
    p16.data = Tensor(np.zeros(7), device=device, dtype="float16")
    p16.grad = Tensor(np.zeros(7), device=device, dtype="float16")
    fresh.step()
    assert np.abs(fresh.master[p16].numpy()).max() < 1e-2


def test_master_weights_are_their_own_memory_category():
    dev = ndl.cpu_numpy()
    mem.empty_cache(dev)
    base = {c: r["current_requested"] for c, r in mem.stats(dev)["by_category"].items()}
    p = nn.Parameter(Tensor(np.ones(1000), device=dev, dtype="float16"))
    opt = optim.Adam([p], lr=1e-3)
    p.grad = Tensor(np.ones(1000), device=dev, dtype="float16", requires_grad=False)
    opt.step()
    now = {c: r["current_requested"] - base[c] for c, r in mem.stats(dev)["by_category"].items()}
    assert now["master"] == 4000 and now["optimizer"] == 8000 and now["weight"] == 2000


@pytest.mark.slow
def test_a_mixed_precision_step_on_cuda_tensors_matches_the_host(emulated_cuda):
    """autocast + GradScaler + float32 masters on cuda() parameters (CUDA emulator)."""
    results = []
    for device in (ndl.cpu_numpy(), emulated_cuda):
        model = _model(device, seed=4)
        opt = optim.Adam(model.parameters(), lr=1e-2)
        scaler = amp.GradScaler(init_scale=2.0 ** 8)
        for step in range(2):
            assert _step(model, opt, scaler, *_batch(device, step))
        assert all(str(m.dtype) == "float32" and m.device == device
                   for m in opt.master.values())
        results.append([p.numpy() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=2e-3)
