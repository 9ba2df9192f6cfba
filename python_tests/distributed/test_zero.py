"""ZeroDataParallel on thread ranks: equal to DDP, sharding, stage-3 gather/free/prefetch,
traffic, mixed precision, checkpoints and resharding, errors."""
from __future__ import annotations

import numpy as np
import pytest

import needle.distributed as dist
from needle import nn, optim
from needle._core.errors import GraphError, ReleasedDataError, SerializationError
from needle.autograd import Tensor
from needle.distributed.zero import FlatLayout, piece_bounds

from . import _zero_checks as zc


# ----- layout (pure) -----------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_round_trip_and_segments(world):
    sizes = [7, 1, 13, 4]
    lay = FlatLayout(sizes, world)
    arrays = [np.arange(s, dtype=np.float64) + 100 * j for j, s in enumerate(sizes)]
    flat = lay.pack_all(arrays)
    assert flat.size == sum(sizes) == lay.bounds[-1]
    for r in range(world):
        mine = lay.unpack_mine(flat, r)
        for j, a in enumerate(arrays):
            lo, hi = piece_bounds(a.size, world)[r:r + 2]
            np.testing.assert_array_equal(mine[j], a[lo:hi])
        lo, hi = lay.segment(r)
        assert hi - lo == sum(len(m) for m in mine)
    for a, b in zip(lay.unpack_all(flat), arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    assert lay.sent_elements(0, "reduce_scatter") == sum(sizes) - (lay.bounds[1] - lay.bounds[0]) \
        or world == 1


def test_piece_sizes_differ_by_at_most_one():
    for size in (0, 1, 5, 13, 1000):
        for world in (1, 2, 3, 4, 7):
            b = piece_bounds(size, world)
            sizes = [b[r + 1] - b[r] for r in range(world)]
            assert sum(sizes) == size and max(sizes) - min(sizes) <= 1


# ----- the collectives with explicit bounds --------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_scatter_v_and_all_gather_v_against_numpy(world):
    bounds = [0] + sorted(np.random.default_rng(world).integers(0, 11, world - 1).tolist()) + [11]
    data = [np.random.default_rng(r).standard_normal(11) for r in range(world)]

    def job(rank):
        x = data[rank].copy()
        dist.reduce_scatter_v(x, bounds)
        mine = x[bounds[rank]:bounds[rank + 1]].copy()
        y = np.zeros(11)
        y[bounds[rank]:bounds[rank + 1]] = mine
        before = dist.get_backend()  # noqa: F841 - the group is open
        dist.all_gather_v(y, bounds)
        return mine, y

    total = sum(data)
    for rank, (mine, y) in enumerate(dist.spawn_threads(job, world)):
        np.testing.assert_allclose(mine, total[bounds[rank]:bounds[rank + 1]], rtol=1e-12)
        np.testing.assert_allclose(y, total, rtol=1e-12)


def test_bad_bounds_are_refused():
    def job(rank):
        dist.reduce_scatter_v(np.zeros(5), [0, 6, 5])

    with pytest.raises(Exception, match="bad segment bounds"):
        dist.spawn_threads(job, 2)


# ----- equal to DDP --------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_final_weights_equal_ddp_with_adam(world, stage):
    """float64, so that Adam (which normalises tiny gradients to steps of size lr) cannot turn
    reduction-order rounding into visible differences: the math must be the same."""
    want = dist.spawn_threads(zc.train, world, world, "ddp", 0, "adam", "float64")
    got = dist.spawn_threads(zc.train, world, world, "zero", stage, "adam", "float64")
    for rank in range(world):
        for g, w in zip(got[rank], want[0], strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    assert all(np.array_equal(a, b) for r in range(world) for a, b in zip(got[r], got[0],
                                                                          strict=True))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_final_weights_equal_ddp_with_sgd_in_float32(world, stage):
    want = dist.spawn_threads(zc.train, world, world, "ddp", 0, "sgd")
    got = dist.spawn_threads(zc.train, world, world, "zero", stage, "sgd")
    for g, w in zip(got[0], want[0], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_unequal_example_counts_weigh_each_rank():
    """set_num_examples: ranks with 1 and 3 examples give sum n_r g_r / sum n_r."""
    x = np.random.default_rng(0).standard_normal((4, 3))

    def job(rank):
        with zc._BUILD:
            np.random.seed(1)
            model = nn.Linear(3, 2)
        zero = dist.ZeroDataParallel(model, optimizer=lambda ps: optim.SGD(ps, lr=1.0),
                                     stage=2)
        part = x[:1] if rank == 0 else x[1:]
        zero.set_num_examples(len(part))
        out = zero(Tensor(part, requires_grad=False))
        ((out * out).sum() / len(part)).backward()
        before = [p.numpy().copy() for p in model.parameters()]
        zero.step()
        return before, zero.full_parameters(), zero.denominators

    (before, after, denominators), _ = dist.spawn_threads(job, 2)
    w, b = before
    grad_w = 2 * x.T @ (x @ w + b) / 4  # d/dW of the mean over all 4 examples
    np.testing.assert_allclose(after[0], w - grad_w, rtol=1e-5, atol=1e-6)
    assert denominators == {"local": 1.0, "global": 4.0}


# ----- what each rank holds ------------------------------------------------------------------
def test_each_rank_holds_only_its_pieces():
    def job(rank):
        zero = dist.ZeroDataParallel(zc.build_model(), optimizer=zc.make_optimizer("adam"),
                                     stage=2)
        x, y = zc.data(0, rank, 2)
        nn.SoftmaxLoss()(zero(Tensor(x, requires_grad=False)), Tensor(y)).backward()
        zero.step()
        return ([tuple(p.shape) for p in zero.inner.params],
                [None if e.grad is None else e.grad.shape for e in zero.entries],
                [e.param.grad for e in zero.entries],
                {k: [v.shape for v in slot.values()] for k, slot in
                 (("m", zero.inner.m), ("v", zero.inner.v))})

    for rank, (shards, grads, whole, moments) in enumerate(dist.spawn_threads(job, 2)):
        sizes = [7 * 13, 13, 13, 13, 13 * 5, 5]
        want = [(piece_bounds(n, 2)[rank + 1] - piece_bounds(n, 2)[rank],) for n in sizes]
        assert shards == want and grads == want  # stage 2: reduced pieces only
        assert all(g is None for g in whole)     # ... and no whole gradient is kept
        assert moments["m"] == want and moments["v"] == want


def test_stage3_weights_exist_only_while_their_module_runs():
    def job(rank):
        model = zc.build_model()
        zero = dist.ZeroDataParallel(model, optimizer=zc.make_optimizer("sgd"), stage=3)
        first, unit = model.modules[0], zero.units.units[0]
        seen = {}
        original = unit.original_forward

        def spy(*args):
            seen["during"] = first.weight.numpy().shape
            return original(*args)

        unit.original_forward = spy
        x, y = zc.data(0, rank, 2)
        nn.SoftmaxLoss()(zero(Tensor(x, requires_grad=False)), Tensor(y)).backward()
        zero.step()
        try:
            first.weight.numpy()
        except ReleasedDataError as exc:
            seen["after"] = str(exc)
        return seen

    for seen in dist.spawn_threads(job, 2):
        assert seen["during"] == (zc.IN, 13)
        assert "sharded (stage 3)" in seen["after"] and "modules.0.weight" in seen["after"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_stage3_prefetches_the_next_modules_gather(prefetch):
    """When a module's forward (or backward) starts, the next one's (previous one's) gather
    has already been issued with prefetch, and not without."""
    def job(rank):
        zero = dist.ZeroDataParallel(zc.build_model(), optimizer=zc.make_optimizer("sgd"),
                                     stage=3, prefetch=prefetch)
        units = zero.units
        states = []
        for k, unit in enumerate(units.units):
            inner = unit.original_forward

            def spy(*args, _k=k, _inner=inner):
                states.append(("forward", _k, [u.state for u in units.units]))
                return _inner(*args)

            unit.original_forward = spy
        for step in range(2):
            x, y = zc.data(step, rank, 2)
            zero.optimizer.reset_grad()
            out = zero(Tensor(x, requires_grad=False))
            out.register_hook(lambda g: states.append(
                ("backward", None, [u.state for u in units.units])))
            nn.SoftmaxLoss()(out, Tensor(y)).backward()
            zero.step()
        return states, [u.state for u in units.units]

    states, final = dist.spawn_threads(job, 2)[0]
    assert final == ["sharded"] * 3  # nothing stays gathered after a step
    second = states[len(states) // 2:]  # the second step: the forward order is known
    fwd = [s for s in second if s[0] == "forward"]
    for k, _, st in [(s[1], None, s[2]) for s in fwd[:-1]]:
        assert st[k] == "materialized"
        assert st[k + 1] == ("pending" if prefetch else "sharded")
    # the last module's output gradient: it is gathered again, the one before is prefetched
    back = next(s for s in second if s[0] == "backward")[2]
    assert back[2] == "materialized" and back[1] == ("pending" if prefetch else "sharded")


# ----- traffic -------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_measured_traffic_equals_the_prediction(world, stage):
    def job(rank):
        zero = dist.ZeroDataParallel(zc.build_model(), optimizer=zc.make_optimizer("sgd"),
                                     stage=stage, bucket_cap_mb=1e-3)
        per_step = []
        for step in range(2):
            start = zero.bytes_sent
            x, y = zc.data(step, rank, world)
            zero.optimizer.reset_grad()
            nn.SoftmaxLoss()(zero(Tensor(x, requires_grad=False)), Tensor(y)).backward()
            zero.step()
            per_step.append(zero.bytes_sent - start)
        return per_step, zero.predicted_traffic()

    n_params = 7 * 13 + 13 * 3 + 13 * 5 + 5
    for per_step, predicted in dist.spawn_threads(job, world):
        assert per_step == [predicted["total"]] * 2
        ring = 2 * (world - 1) / world * n_params * 4  # DDP's textbook ring all-reduce
        assert abs(predicted["ddp_all_reduce"] - ring) <= 2 * 4 * world * 8
        ratio = predicted["total"] / predicted["ddp_all_reduce"]
        assert ratio == pytest.approx(1.5 if stage == 3 else 1.0, abs=0.12)


# ----- mixed precision -----------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("stage", [2, 3])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(stage):
    results = dist.spawn_threads(zc.mixed_zero_step, 2, 2, stage, 1)
    for steps in results:
        (ran0, scale0, _, _, _), (ran1, scale1, before, after, state) = steps
        assert ran0 and not ran1 and scale1 == scale0 / 2
        assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
        assert state["extra"]["t"] == 1  # Adam's counter did not move either
        assert all(str(m.dtype) == "float32" for m in state["state"]["master"].values())


# ----- checkpoints ---------------------------------------------------------------------------
def _trained_states(world, stage, steps=2):
    def job(rank):
        zero = dist.ZeroDataParallel(zc.build_model(), optimizer=zc.make_optimizer("adam"),
                                     stage=stage)
        for step in range(steps):
            x, y = zc.data(step, rank, world)
            zero.optimizer.reset_grad()
            nn.SoftmaxLoss()(zero(Tensor(x, requires_grad=False)), Tensor(y)).backward()
            zero.step()
        return zero.state_dict(), zero.full_parameters()

    out = dist.spawn_threads(job, world)
    return [s for s, _ in out], out[0][1]


def _whole_moments(states, name):
    order = sorted(states[0]["pieces"], key=int)
    return [np.concatenate([s["pieces"][i]["state"][name] for s in
                            sorted(states, key=lambda s: s["pieces"][i]["lo"])
                            if name in s["pieces"][i]["state"]]) for i in order]


@pytest.mark.parametrize("old,new,stage", [(4, 2, 2), (2, 1, 2), (2, 2, 3), (2, 4, 1)])
def test_reshard_to_another_world_size(old, new, stage):
    states, params = _trained_states(old, stage)

    def job(rank):
        zero = dist.ZeroDataParallel(zc.build_model(seed=5), optimizer=zc.make_optimizer("adam"),
                                     stage=stage)
        zero.load_state_dict(states)
        return zero.state_dict(), zero.full_parameters(), zero.inner.t

    out = dist.spawn_threads(job, new)
    for _, new_params, t in out:
        assert t == 2
        for a, b in zip(new_params, params, strict=True):
            np.testing.assert_array_equal(a, b)
    new_states = [s for s, _, _ in out]
    for name in ("m", "v"):
        for a, b in zip(_whole_moments(new_states, name), _whole_moments(states, name),
                        strict=True):
            np.testing.assert_array_equal(a, b)


def test_load_refuses_a_partial_or_foreign_state():
    states, _ = _trained_states(2, 2, steps=1)

    def job(rank, given):
        zero = dist.ZeroDataParallel(zc.build_model(), optimizer=zc.make_optimizer("adam"),
                                     stage=2)
        zero.load_state_dict(given)

    with pytest.raises(SerializationError, match=r"shards of ranks \[0\], expected one per rank"):
        dist.spawn_threads(job, 1, states[:1])
    with pytest.raises(SerializationError, match="not a ZeRO shard"):
        dist.spawn_threads(job, 1, [{"format": "other"}])


# ----- errors --------------------------------------------------------------------------------
def test_errors_name_the_problem():
    def bad_stage(rank):
        dist.ZeroDataParallel(nn.Linear(2, 2), optimizer=zc.make_optimizer("sgd"), stage=4)

    with pytest.raises(Exception, match="stage must be 1, 2 or 3, got 4"):
        dist.spawn_threads(bad_stage, 2)

    def different(rank):
        with zc._BUILD:
            model = nn.Linear(2, 2 + rank)
        dist.ZeroDataParallel(model, optimizer=zc.make_optimizer("sgd"))

    with pytest.raises(Exception, match="ranks hold different models"):
        dist.spawn_threads(different, 2)

    def unused(rank):
        with zc._BUILD:
            model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        zero = dist.ZeroDataParallel(model, optimizer=zc.make_optimizer("sgd"))
        model.modules[0](Tensor(np.ones((1, 2)), requires_grad=False)).sum().backward()
        zero.step()

    with pytest.raises(GraphError, match=r"got no gradient .*'modules.1.weight'"):
        dist.spawn_threads(unused, 2)
