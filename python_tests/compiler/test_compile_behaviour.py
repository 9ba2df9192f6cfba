"""ndl.compile: planned == measured peak, re-tracing, the bounded cache, refusal of
data-dependent Python, divergence handling and argument checks; on cpu_numpy() and cpu()."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle import nn

B, W = 8, 32
BUF = B * W * 4


@pytest.fixture(params=["cpu_numpy", "cpu"])
def dev(request):
    return getattr(ndl, request.param)()


def chain(dev, depth=4):
    np.random.seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(W, W, bias=False, device=dev), nn.ReLU()]
    return nn.Sequential(*layers)


def tensor(dev, rows=B, seed=1):
    rng = np.random.default_rng(seed)
    return ndl.Tensor(rng.standard_normal((rows, W)), device=dev, requires_grad=False)


def measured_peak(dev, fn, *args):
    before = mem.stats(dev)["requested_bytes"]
    mem.reset_peak(dev)
    out = fn(*args)
    return out, mem.stats(dev)["peak_requested_bytes"] - before


@pytest.mark.parametrize("arena", ["bounded", "all"])
def test_inference_chain_replays_in_two_buffers(dev, arena):
    model = chain(dev, depth=8)

    @ndl.compile(arena=arena)
    def infer(x):
        with ndl.no_grad():
            return model(x)

    x = tensor(dev)
    want = [infer(x).numpy() for _ in range(2)][0]  # warm-up, trace
    out, peak = measured_peak(dev, infer, x)
    np.testing.assert_array_equal(out.numpy(), want)
    m = infer.memory()
    # eagerly the last matmul output is freed as the result is made: 2 buffers
    assert m["eager_peak_bytes"] == 2 * BUF
    if arena == "all":
        # a chain needs two activation buffers whatever its depth, plus the returned one:
        # the arena is held for the whole call, so it pays one buffer more than eagerly
        assert m["arena_bytes"] == 2 * BUF
        assert peak == m["planned_peak_bytes"] == 3 * BUF
    else:
        # every other buffer of the chain in a one-buffer arena, the rest from the pools:
        # never two pool buffers at once, so the eager peak exactly
        assert m["arena_bytes"] == BUF and m["arena_buffers"] == (m["intermediates"] + 1) // 2
        assert peak == m["planned_peak_bytes"] == 2 * BUF


def test_training_step_measured_peak_is_the_planned_peak(dev):
    model = chain(dev, depth=3)
    opt = ndl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @ndl.compile
    def step(x):
        opt.reset_grad()
        model(x).sum().backward()
        opt.step()

    x = tensor(dev)
    step(x)
    step(x)
    for _ in range(2):
        _, peak = measured_peak(dev, step, x)
        m = step.memory()
        assert peak == m["planned_peak_bytes"] <= m["eager_peak_bytes"]
    assert step.stats()["replays"] == 2 and step.stats()["divergences"] == 0
    assert m["arena_bytes"] < m["naive_bytes"]


def test_a_new_shape_traces_again_and_the_cache_is_bounded(dev):
    model = chain(dev, depth=2)
    step = ndl.compile(lambda x: model(x).sum(), max_cache=2)
    for rows in (8, 8, 8, 4, 4, 4, 8):
        want = model(tensor(dev, rows)).sum().numpy()
        np.testing.assert_array_equal(step(tensor(dev, rows)).numpy(), want)
    stats = step.stats()
    assert (stats["traces"], stats["replays"], stats["cache_size"]) == (2, 3, 2)
    for rows in (2, 3):  # two more signatures evict the two oldest
        step(tensor(dev, rows))
    stats = step.stats()
    assert (stats["cache_size"], stats["evictions"]) == (2, 2)
    step(tensor(dev, 8))  # evicted: warms up again
    assert step.stats()["eager_calls"] == 5


def test_a_dtype_change_traces_again(dev):
    step = ndl.compile(lambda x: (x * 2).sum())
    x32 = ndl.Tensor(np.ones((4, 4)), device=dev, dtype="float32")
    x64 = ndl.Tensor(np.ones((4, 4)), device=dev, dtype="float64")
    for x in (x32, x32, x64, x64):
        step(x)
    assert step.stats()["traces"] == 2


def test_data_dependent_python_is_refused_with_its_line(dev):
    model = chain(dev, depth=1)

    def step(x):
        loss = model(x).sum()
        if loss.numpy() > 0:  # MARK: the refused line
            loss = loss * 2
        return loss

    compiled = ndl.compile(step)
    with pytest.raises(ndl.CompileError) as info:
        compiled(tensor(dev))
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1)
                if "# MARK: the refused line" in text and "next(" not in text)
    message = str(info.value)
    assert f"{__file__}:{line}" in message
    assert "Tensor.numpy()" in message and "step" in message
    # outside a compiled step the same read is fine, and the guard is gone after the error
    assert step(tensor(dev)).numpy() is not None


def test_a_divergent_replay_stays_correct_and_traces_again(dev):
    calls = []

    def step(x):
        calls.append(1)
        y = x * 2
        if len(calls) == 3:  # data-independent Python that changes the program once
            y = (y + 1) - 1
        return (y * 3).sum()

    compiled = ndl.compile(step)
    x = tensor(dev)
    want = (x * 6).sum().numpy()
    outs = [compiled(x).numpy() for _ in range(5)]
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-6)
    stats = compiled.stats()
    # call 1 warm-up, 2 trace, 3 diverges, 4 traces again, 5 replays
    assert (stats["traces"], stats["divergences"], stats["replays"]) == (2, 1, 1)


def test_a_step_that_never_repeats_falls_back_to_eager(dev):
    calls = []

    def step(x):
        calls.append(1)
        for _ in range(len(calls)):  # a longer program on every call
            x = x + 1
        return x.sum()

    compiled = ndl.compile(step, max_retraces=1)
    x = tensor(dev)
    for n in range(1, 8):
        np.testing.assert_allclose(compiled(x).numpy(), (x + n).sum().numpy(), rtol=1e-5)
    stats = compiled.stats()
    assert stats["divergences"] == 2 and stats["eager_signatures"] == 1


def test_hooks_fire_on_every_replay(dev):
    model = chain(dev, depth=1)
    seen = []
    w = model.parameters()[0]
    w.register_hook(lambda g: seen.append(1))

    @ndl.compile
    def step(x):
        w.grad = None
        model(x).sum().backward()

    for _ in range(4):
        step(tensor(dev))
    assert len(seen) == 4 and step.stats()["replays"] == 2


@pytest.mark.parametrize("kw", [{"max_cache": 0}, {"warmup": -1}, {"max_retraces": "2"}])
def test_bad_arguments_are_refused(kw):
    with pytest.raises(ndl.CompileError, match="bad"):
        ndl.compile(lambda x: x, **kw)
    with pytest.raises(ndl.CompileError, match="callable"):
        ndl.compile(3)


def test_other_threads_allocating_during_a_replay_do_not_break_the_plan(dev):
    import threading

    model = chain(dev, depth=2)
    made = []

    def loader():  # a data-loader thread making a batch while the step runs
        made.append(ndl.Tensor(np.ones((3, 5)), device=dev) * 2)

    @ndl.compile
    def step(x):
        with ndl.no_grad():
            h = model(x)
            if step.stats()["traces"]:  # from the first replay on: not during the trace
                t = threading.Thread(target=loader)
                t.start()
                t.join()
            return model(h)

    x = tensor(dev)
    want = model(model(x)).numpy()
    for _ in range(4):
        np.testing.assert_array_equal(step(x).numpy(), want)
    assert step.stats()["replays"] == 2 and step.stats()["divergences"] == 0
    assert len(made) == 2 and made[0].numpy().tolist() == [[2.0] * 5] * 3


def test_a_compiled_step_inside_another_runs_eagerly(dev):
    model = chain(dev, depth=2)
    inner = ndl.compile(lambda h: model(h) * 2)

    @ndl.compile
    def outer(x):
        with ndl.no_grad():
            return inner(model(x)).sum()

    x = tensor(dev)
    with ndl.no_grad():
        want = (model(model(x)) * 2).sum().numpy()
    for _ in range(4):
        np.testing.assert_array_equal(outer(x).numpy(), want)
    assert outer.stats()["replays"] == 2 and outer.stats()["divergences"] == 0
    assert inner.stats()["eager_calls"] == 4 and inner.stats()["traces"] == 0


def test_tracing_leaves_the_users_peak_statistics_alone(dev):
    model = chain(dev, depth=2)
    step = ndl.compile(lambda x: model(x).sum())
    mem.reset_peak(dev)
    big = ndl.Tensor(np.ones((256, 1024)), device=dev)  # 1 MiB: far above the step's bytes
    del big
    peak = mem.stats(dev)["peak_requested_bytes"]
    step(tensor(dev))
    step(tensor(dev))  # the trace
    assert step.stats()["traces"] == 1
    assert mem.stats(dev)["peak_requested_bytes"] == peak
    assert 0 < step.memory()["eager_peak_bytes"] < 256 * 1024 * 4
