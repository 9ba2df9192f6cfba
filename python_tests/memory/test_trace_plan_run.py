"""trace -> plan -> run on real needle graphs: lifetimes, non-overlap, planned == measured.

Every test runs on cpu_numpy() (Python caching allocator, swapped for an arena) and on cpu()
(the C++ allocator serving the plan itself).
"""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle import nn
from needle._core.errors import MemoryPlanError
from needle.memory.caching_allocator import round_size

DEV = ndl.cpu_numpy()


@pytest.fixture(autouse=True, params=["cpu_numpy", "cpu"])
def device(request):
    """Point the module's DEV (read by the helpers below) at the device under test."""
    global DEV
    DEV = getattr(ndl, request.param)()
    yield DEV
    DEV = ndl.cpu_numpy()
B, W = 8, 32
BUF = B * W * 4  # one (B, W) float32 activation: 1024 B, a multiple of every alignment used


def chain(depth, bias=False, seed=0):
    np.random.seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(W, W, bias=bias, device=DEV), nn.ReLU()]
    return nn.Sequential(*layers)


def data(seed=1):
    rng = np.random.default_rng(seed)
    return ndl.Tensor(rng.standard_normal((B, W)), device=DEV, requires_grad=False)


def measure_run(p, *inputs):
    """(result, peak requested bytes above what was live before the run)."""
    before = mem.stats(DEV)["requested_bytes"]
    mem.reset_peak(DEV)
    out = p.run(*inputs)
    return out, mem.stats(DEV)["peak_requested_bytes"] - before


def test_trace_records_kinds_producers_consumers_and_lifetimes():
    x = data()
    w = ndl.Tensor(np.ones((W, W)), device=DEV)

    def infer(a):
        with ndl.no_grad():  # with a graph, the result would keep every intermediate alive
            return ndl.ops.relu(a @ w).sum()

    g = mem.trace(infer, x)
    by_kind = {}
    for t in g.tensors:
        by_kind.setdefault(t.kind, []).append(t)
    assert sorted(t.nbytes for t in by_kind["input"]) == [BUF]
    assert [t.nbytes for t in by_kind["parameter"]] == [W * W * 4]
    inter = sorted(by_kind["intermediate"], key=lambda t: t.def_index)
    assert [(t.producer, t.nbytes) for t in inter] == [("MatMul", BUF), ("ReLU", BUF)]
    assert inter[0].consumers == ("ReLU",) and inter[1].consumers == ("Summation",)
    assert inter[0].def_index < inter[1].def_index <= inter[0].last_use < inter[1].last_use
    (out,) = by_kind["output"]
    assert (out.producer, out.nbytes, out.last_use) == ("Summation", 4, g.end_index)
    assert [op.name for op in g.ops] == ["MatMul", "ReLU", "Summation"]
    assert g.ops[0].outputs == (inter[0].id,)


def test_trace_of_backward_has_gradient_steps():
    model = chain(2)
    g = mem.trace(lambda a: model(a).sum().backward(), data())
    names = [op.name for op in g.ops]
    assert names.index("Summation") < names.index("Summation.gradient")
    assert {"MatMul.gradient", "ReLU.gradient"} <= set(names)
    grads = [t for t in g.tensors if t.kind == "output"]
    assert sorted(t.nbytes for t in grads) == [W * W * 4] * 2  # the two weight gradients
    assert all(t.phase == "backward" for t in grads)
    for p in model.parameters():
        p.grad = None


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


def step_fn(model, train: bool):
    """One training step (backward, returns nothing) or one inference (no_grad, returns out)."""

    def step(a):
        if train:
            model(a).sum().backward()
            return None
        with ndl.no_grad():
            return model(a)

    return step


@pytest.mark.parametrize("train", [False, True])
def test_planned_tensors_never_share_bytes_while_both_live(train):
    model = chain(3, bias=True)
    g = mem.trace(step_fn(model, train), data())
    p = mem.plan(g)
    specs = {t.id: t for t in g.planned()}
    assert set(p.assignments) == set(specs)
    items = list(specs)
    for i, a in enumerate(items):
        for b in items[i + 1:]:
            live = (specs[a].def_index <= specs[b].last_use
                    and specs[b].def_index <= specs[a].last_use)
            mem_a = (p.assignments[a], p.assignments[a] + p.sizes[a])
            mem_b = (p.assignments[b], p.assignments[b] + p.sizes[b])
            assert not (live and overlaps(mem_a, mem_b)), (a, b)
    for q in model.parameters():
        q.grad = None


def test_run_matches_eager_and_measured_peak_is_the_plan():
    model = chain(4, bias=True)
    x = data()

    def infer(a):
        with ndl.no_grad():
            return model(a)

    g = mem.trace(infer, x)
    p = mem.plan(g)
    out, peak = measure_run(p, data(seed=7))
    np.testing.assert_allclose(out.numpy(), infer(data(seed=7)).numpy(), rtol=1e-6)
    assert peak == p.peak_bytes + g.output_bytes
    assert g.output_bytes == BUF


def test_run_of_a_training_step_gives_the_eager_gradients():
    model = chain(3, bias=True)
    params = model.parameters()
    x = data()

    def step(a):
        model(a).sum().backward()

    eager = None
    step(x)
    eager = [p.grad.numpy() for p in params]
    for p in params:
        p.grad = None
    g = mem.trace(step, x)
    p = mem.plan(g)
    for q in params:
        q.grad = None
    _, peak = measure_run(p, x)
    for q, want in zip(params, eager, strict=True):
        np.testing.assert_allclose(q.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    assert peak == p.peak_bytes + g.output_bytes
    assert g.output_bytes == sum(int(np.prod(q.shape)) * 4 for q in params)
    for q in params:
        q.grad = None


def test_run_of_a_step_with_an_in_place_optimizer_update_gives_the_eager_parameters():
    """SGD with momentum rewrites θ and u in their own buffers (needle.optim): a planned run
    of the whole step (forward, backward, update) lands on the eager step's parameters
    bitwise, and measures the planned peak."""
    from needle import optim

    model = chain(3, bias=True)
    params = model.parameters()
    opt = optim.SGD(params, lr=0.1, momentum=0.5)
    x = data()

    def step(a):
        opt.reset_grad()
        model(a).sum().backward()
        opt.step()

    step(x)  # the momentum exists: the traced step is the steady one
    g = mem.trace(step, x)
    p = mem.plan(g)
    weights, state = model.state_dict(), opt.state_dict()
    thetas = [q.realize_cached_data() for q in params]
    _, peak = measure_run(p, x)
    planned = [q.numpy() for q in params]
    # updated in place
    assert all(q.realize_cached_data() is t for q, t in zip(params, thetas, strict=True))
    # the step's reset_grad frees the last gradients before the run makes as many anew
    assert peak == p.peak_bytes and g.output_bytes == sum(q.nbytes for q in thetas)
    model.load_state_dict(weights)
    opt.load_state_dict(state)
    step(x)
    assert not np.array_equal(planned[0], weights["modules.0.weight"])
    for got, want in zip(planned, [q.numpy() for q in params], strict=True):
        np.testing.assert_array_equal(got, want)


def plans_for(depths, train):
    out = []
    for depth in depths:
        model = chain(depth)
        g = mem.trace(step_fn(model, train), data())
        p = mem.plan(g)
        for q in model.parameters():
            q.grad = None
        _, peak = measure_run(p, data())
        out.append((p, peak - g.output_bytes))
        for q in model.parameters():
            q.grad = None
    return out


def test_inference_chain_needs_two_buffers_whatever_the_depth():
    results = plans_for((4, 16, 64), train=False)
    for p, measured in results:
        assert p.peak_bytes == p.lower_bound_bytes == 2 * BUF
        assert measured == 2 * BUF


def test_training_chain_activations_grow_linearly_with_depth():
    (p4, m4), (p16, m16), (p64, m64) = plans_for((4, 16, 64), train=True)
    # each layer keeps its relu output (saved by ReLU and the next matmul); the matmul
    # output is released as soon as nothing but the graph holds it
    per_layer = BUF
    assert p16.peak_bytes - p4.peak_bytes == 12 * per_layer
    assert p64.peak_bytes - p16.peak_bytes == 48 * per_layer
    for p, measured in ((p4, m4), (p16, m16), (p64, m64)):
        assert p.peak_bytes == p.lower_bound_bytes == measured


def test_run_refuses_a_call_that_does_not_repeat():
    model = chain(1)
    x = data()
    step = lambda a: model(a).sum().backward()  # noqa: E731 - the second call accumulates
    p = mem.plan(mem.trace(step, x))
    with pytest.raises(MemoryPlanError, match="differs from the trace|more allocations"):
        p.run(x)
    for q in model.parameters():
        q.grad = None
    if DEV.name == "cpu_numpy":  # the backend allocator is restored
        assert DEV.mod._ALLOCATOR is mem.get_allocator(DEV)
    else:  # the C++ allocator left its planned mode: a fresh run serves from the pools
        before = mem.stats(DEV)["requested_bytes"]
        y = data() * 2
        assert mem.stats(DEV)["requested_bytes"] == before + BUF
        del y


def test_run_needs_a_traced_graph():
    p = mem.plan([(100, 0, 1), (100, 1, 2)])
    with pytest.raises(MemoryPlanError, match="trace"):
        p.run()


def test_trace_sizes_are_requested_bytes_and_plan_rounds_to_alignment():
    x = ndl.Tensor(np.ones(10), device=DEV, requires_grad=False)
    g = mem.trace(lambda a: (a + 1) * 2, x)
    inter = g.planned()
    assert [t.nbytes for t in inter] == [40]
    assert mem.plan(g, alignment=512).peak_bytes == round_size(40)


def test_a_returned_graph_keeps_only_what_backward_reads():
    w = ndl.Tensor(np.ones((W, W)), device=DEV)
    g = mem.trace(lambda a: ndl.ops.relu(a @ w).sum(), data())
    # the relu output (ReLU saves it) and the sum outlive the call; the matmul output, which
    # no op saves, is released inside it and so is planned as an intermediate
    assert [(t.producer, t.nbytes) for t in g.planned()] == [("MatMul", BUF)]
    assert sorted(t.nbytes for t in g.tensors if t.kind == "output") == [4, BUF]


def test_trace_inside_record_feeds_both_observers():
    x = data()
    with mem.record(DEV) as events:
        g = mem.trace(lambda a: (a * 2) + 1, x)
    assert [op.name for op in g.ops] == ["MulScalar", "AddScalar"]
    assert [e.op for e in events if e.kind == "alloc"] == ["MulScalar", "AddScalar"]
    assert mem.observers.active_observer() is None


def test_a_buffer_held_longer_than_traced_leaves_the_plan_instead_of_sharing_bytes():
    """Non-strict runs (what ndl.compile uses): an intermediate the call keeps alive longer
    than when traced must not have its bytes handed to a later buffer; the run leaves the
    plan there (later requests come from the allocator), says why, and gives eager results."""
    from needle.memory.replay import previous_occupants, run_plan

    x, held, hold = data(), [], [False]

    def f(t):
        with ndl.no_grad():
            a = t * 2.0
            s = a.sum()
            if hold[0]:
                held.append(a)
            del a
            return ((t + 1.0) * s).sum()

    p = mem.plan(mem.trace(f, x))
    first = p.graph.allocations[0][0]  # a's buffer
    assert any(first in before for before in previous_occupants(p)[1:])  # its bytes reused
    want = f(x).numpy()
    result, reason = run_plan(p, x, strict=False)
    assert reason is None
    np.testing.assert_allclose(result.numpy(), want)
    hold[0] = True
    result, reason = run_plan(p, x, strict=False)
    assert "would share bytes with a planned buffer still alive" in reason
    np.testing.assert_allclose(result.numpy(), want)
    np.testing.assert_allclose(held[0].numpy(), x.numpy() * 2.0)  # never overwritten


def test_previous_occupants_are_the_last_holders_of_each_byte():
    """previous_occupants against a byte-by-byte reading of random plans."""
    from types import SimpleNamespace

    from needle.memory.replay import previous_occupants

    rng = np.random.default_rng(0)
    for _ in range(200):
        allocations, assignments, sizes = [], {}, {}
        for tid in range(12):
            allocations.append((tid, 8))
            if rng.random() < 0.8:  # else an output: not in the arena
                assignments[tid] = int(rng.integers(0, 48))
                sizes[tid] = int(rng.integers(1, 17))
        plan = SimpleNamespace(graph=SimpleNamespace(allocations=allocations),
                               assignments=assignments, sizes=sizes)
        got = previous_occupants(plan)
        holder = {}  # byte -> the last planned buffer on it
        for j, (tid, _) in enumerate(allocations):
            if tid not in assignments:
                assert got[j] == ()
                continue
            span = range(assignments[tid], assignments[tid] + sizes[tid])
            assert set(got[j]) == {holder[b] for b in span if b in holder}, (j, plan)
            assert len(got[j]) == len(set(got[j]))
            for b in span:
                holder[b] = tid
