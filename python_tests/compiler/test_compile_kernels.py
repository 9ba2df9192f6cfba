"""ndl.compile's kernel programs: replays that run the recorded kernels and no step Python.

A signature goes warm-up (eager), trace (eager, planned), two recorded replays (the step's
Python under the plan, kernels recorded and compared), then kernel replays. Each test checks
values against eager steps bitwise, that the replays really skipped the Python, or that a
step the program cannot reproduce keeps running its Python and says why.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle import nn
from needle._core.errors import GraphError

sys.path.append(os.path.dirname(__file__))
from test_compile_models import make, step_for  # noqa: E402 - the shared model zoo

FIRST_KERNEL_CALL = 4  # warm-up, trace, two recordings


@pytest.fixture(params=["cpu_numpy", "cpu", "cpu-python-runner"])
def dev(request):
    """cpu() runs its programs from C++ (needle.compiler.native); "cpu-python-runner" is cpu()
    with the generated Python function instead (both must give the eager numbers)."""
    return getattr(ndl, request.param.split("-")[0])()


@pytest.fixture(autouse=True)
def _runner(request, monkeypatch):
    """Compile with native=False on the "cpu-python-runner" variant of ``dev``."""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("dev") == "cpu-python-runner":
        real = ndl.compile
        monkeypatch.setattr(ndl, "compile", lambda *a, **k: real(*a, native=False, **k))


def sum_loss_step(model, opt):
    """One training step on ``model(x).sum()``, returning the loss."""

    def step(x):
        opt.reset_grad()
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss

    return step


def train(kind, dev, compiled, steps, optimizer="sgd"):
    np.random.seed(11)
    model, opt, data = make(kind, dev)
    if optimizer == "sgd":
        opt = ndl.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4)
    model.train()
    step = step_for(model, opt)
    if compiled:
        step = ndl.compile(step)
    np.random.seed(3)
    # the batches do not require grad here: a fresh x.grad each call is the common case
    batches = [(ndl.Tensor(x, requires_grad=False), ndl.Tensor(y, requires_grad=False))
               for x, y in data]
    results = [step(*batches[i % len(batches)]) for i in range(steps)]
    return [p.numpy() for p in model.parameters()], [r.numpy() for r in results], step


@pytest.mark.parametrize("kind, optimizer", [("mlp", "sgd"), ("mlp", "adam"),
                                             ("transformer", "sgd"), ("transformer", "adam"),
                                             ("resnet9", "sgd"), ("lstm", "sgd")])
def test_kernel_replays_equal_eager_steps_bitwise(kind, optimizer, dev):
    """Adam's step counter and bias corrections advance on every kernel replay (through
    needle.compiler.effects.replayed); the LSTM LM's embedding reads its ids on the device."""
    steps = 6 if kind != "resnet9" else 5
    want_params, want_losses, _ = train(kind, dev, False, steps, optimizer)
    params, losses, step = train(kind, dev, True, steps, optimizer)
    mode = step.replay_mode()
    assert mode["mode"] == "kernels" and mode["fused_runs"] > 0
    assert mode["runner"] == ("C++" if dev.name == "cpu" and ndl.compile.__name__ == "compile"
                              else "Python")
    assert step.stats()["kernel_replays"] == steps - FIRST_KERNEL_CALL
    for got, want in zip(losses, want_losses, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(params, want_params, strict=True):
        np.testing.assert_array_equal(got, want)
    # each call returned its own loss: a later replay did not overwrite an earlier result
    assert len({float(x) for x in losses}) == steps


def test_a_kernel_replay_runs_no_op_or_module_python(dev):
    _, _, step = train("mlp", dev, True, FIRST_KERNEL_CALL)
    np.random.seed(11)
    x = ndl.Tensor(np.random.standard_normal((16, 20)), device=dev, requires_grad=False)
    y = ndl.Tensor(np.random.randint(0, 10, 16), device=dev, requires_grad=False)
    called = set()
    roots = tuple(os.path.join(os.path.dirname(ndl.__file__), d) for d in ("ops", "nn"))

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            called.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        step(x, y)
    finally:
        sys.setprofile(None)
    assert step.stats()["kernel_replays"] == 1
    assert called == set()
    # the same profile sees the Python of an uncompiled step
    sys.setprofile(profile)
    try:
        step.__wrapped__(x, y)
    finally:
        sys.setprofile(None)
    assert {"forward", "compute"} <= called


def test_dropout_masks_are_fresh_on_every_kernel_replay(dev):
    x = ndl.Tensor(np.ones((64, 64)), device=dev, requires_grad=False)
    drop = nn.Dropout(0.5)
    step = ndl.compile(lambda a: drop(a) * 1.0)
    masks = [step(x).numpy() != 0 for _ in range(7)]
    assert step.stats()["kernel_replays"] == 3
    assert len({m.tobytes() for m in masks}) == 7


def test_kernel_replays_draw_masks_with_the_device_kernel_and_numpys_numbers(dev,
                                                                            monkeypatch):
    """A replayed program makes its dropout draws with the backend's mt19937_uniform (both
    backends have it), and they are the draws the eager steps make from the same seed."""
    made_by_kernel = []
    real = ndl.random.host_mt19937

    def counting(device=None, *, replaying=False):
        generator = real(device, replaying=replaying)
        if replaying:
            made_by_kernel.append(generator is not None)
        return generator

    monkeypatch.setattr(ndl.random, "host_mt19937", counting)
    x = ndl.Tensor(np.ones((64, 64)), device=dev, requires_grad=False)
    drop = nn.Dropout(0.5)
    step = ndl.compile(lambda a: drop(a) * 1.0)
    np.random.seed(0)
    compiled = [step(x).numpy() for _ in range(7)]
    assert step.stats()["kernel_replays"] == 3
    assert made_by_kernel == [True] * 3
    np.random.seed(0)
    eager = [(drop(x) * 1.0).numpy() for _ in range(7)]
    for a, b in zip(compiled, eager, strict=True):
        np.testing.assert_array_equal(a, b)


def test_kernel_replay_measured_peak_is_the_planned_peak(dev):
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(32, 32, device=dev), nn.ReLU(),
                          nn.Linear(32, 32, device=dev))
    opt = ndl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = ndl.compile(sum_loss_step(model, opt))
    x = ndl.Tensor(np.ones((8, 32)), device=dev, requires_grad=False)
    for _ in range(FIRST_KERNEL_CALL):
        step(x)
    for _ in range(2):
        before = mem.stats(dev)["requested_bytes"]
        mem.reset_peak(dev)
        step(x)
        peak = mem.stats(dev)["peak_requested_bytes"] - before
        assert step.replay_mode()["mode"] == "kernels"
        assert peak == step.memory()["planned_peak_bytes"]


def _lr_run(dev, compiled):
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(8, 8, device=dev), nn.Dropout(0.5))
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)

    step = sum_loss_step(model, opt)
    step = ndl.compile(step) if compiled else step
    x = ndl.Tensor(np.ones((4, 8)), device=dev, requires_grad=False)
    np.random.seed(1)
    for i in range(12):
        if i == 6:
            opt.lr = 0.5  # a scheduler's change: baked into the program as a scalar
        if i == 9:
            model.eval()  # dropout off: another program
        step(x)
    return [p.numpy() for p in model.parameters()], step


def test_state_changed_between_calls_runs_the_python_and_records_again(dev):
    want, _ = _lr_run(dev, False)
    got, step = _lr_run(dev, True)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    # calls 4, 5 replay the first program; the lr change makes calls 6, 7 record anew under
    # the same plan and 8 replay kernels; eval() (call 9) drops dropout's buffers, so the plan
    # diverges (values stay right) and call 10 traces again
    stats = step.stats()
    assert stats["divergences"] == 1 and stats["traces"] == 2
    assert stats["kernel_replays"] == 3


def test_a_step_whose_state_changes_every_call_settles_on_python_replays(dev):
    w = ndl.Tensor(np.ones((2, 2)), device=dev)
    box = {"scale": 1.0}
    step = ndl.compile(lambda a: a @ w * box["scale"])
    x = ndl.Tensor(np.ones((1, 2)), device=dev, requires_grad=False)
    for i in range(40):
        box["scale"] = float(i % 3)  # changes between calls, often
        assert float(step(x).numpy()[0, 0]) == 2.0 * (i % 3)
    mode = step.replay_mode()
    assert mode["mode"] == "python" and "changed between calls" in mode["reason"]


def _linear_step_replaying_kernels(dev):
    """(model, compiled SGD step, input) of a Linear layer, called until it replays kernels."""
    np.random.seed(0)
    model = nn.Linear(4, 3, device=dev)
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    step = ndl.compile(sum_loss_step(model, opt))
    x = ndl.Tensor(np.ones((2, 4)), device=dev, requires_grad=False)
    for _ in range(FIRST_KERNEL_CALL + 1):
        step(x)
    return model, step, x


def test_replayed_steps_note_the_parameters_they_replace(dev):
    """Each kernel replay bumps the data version of every parameter it replaces, as an eager
    optimizer step does, so a graph that saved a parameter before the step refuses to
    backpropagate through the old values afterwards."""
    from needle.autograd.versions import data_version

    model, step, x = _linear_step_replaying_kernels(dev)
    replays = step.stats()["kernel_replays"]
    before = [data_version(p) for p in model.parameters()]
    stale = (model(ndl.Tensor(np.ones((2, 4)), device=dev)) ** 2).sum()
    step(x)
    assert step.stats()["kernel_replays"] == replays + 1
    assert [data_version(p) for p in model.parameters()] == [v + 1 for v in before]
    with pytest.raises(GraphError, match="saved .* for its gradient"):
        stale.backward()


def test_parameters_replaced_between_calls_are_read_anew(dev):
    model, step, x = _linear_step_replaying_kernels(dev)
    model.load_state_dict({k: np.zeros(v.shape, "float32")
                           for k, v in model.state_dict().items()})
    assert float(step(x).numpy()) == 0.0  # the loss of the zero weights, not the old ones


@pytest.mark.parametrize("case, reason", [
    ("counter", "Sequential.calls"),
    ("checkpoint", "random state"),
    ("hook", "hooks ran"),
    ("host_read", "host read"),
])
def test_steps_a_program_cannot_replay_keep_their_python_and_say_why(case, reason, dev):
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(6, 6, device=dev), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(6, 3, device=dev))
    model.calls = 0
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    if case == "hook":
        model.parameters()[0].register_hook(lambda g: g * 2)
    labels_np = np.array([0, 1, 2, 1])

    def step(x, y):
        opt.reset_grad()
        if case == "counter":
            model.calls += 1  # Python state a kernel replay would not update
        out = ndl.checkpoint(model, x) if case == "checkpoint" else model(x)
        if case == "host_read":
            y = ndl.Tensor(y.numpy() + 0, device=dev)  # a leaf read on the host
        loss = nn.SoftmaxLoss()(out, y)
        loss.backward()
        opt.step()
        return loss

    def run(fn):
        np.random.seed(5)
        x = ndl.Tensor(np.linspace(-1, 1, 24).reshape(4, 6), device=dev, requires_grad=False)
        y = ndl.Tensor(labels_np, device=dev, requires_grad=False)
        return [float(fn(x, y).numpy()) for _ in range(7)]

    snapshot = [p.numpy() for p in model.parameters()]
    want = run(step)
    for p, v in zip(model.parameters(), snapshot, strict=True):
        p.data = ndl.Tensor(v, device=dev)
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    model.calls = 0
    compiled = ndl.compile(step)
    assert run(compiled) == want
    mode = compiled.replay_mode()
    assert mode["mode"] == "python" and reason in mode["reason"]
    assert compiled.stats()["kernel_replays"] == 0


def test_a_numpy_argument_is_not_baked_into_a_program(dev):
    w = ndl.Tensor(np.ones((3, 3)), device=dev)
    step = ndl.compile(lambda a: ndl.Tensor(a, device=dev) @ w)
    outs = [step(np.full((2, 3), float(i), "float32")).numpy()[0, 0] for i in range(6)]
    assert outs == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    assert "argument" in step.replay_mode()["reason"]


def test_compile_without_kernels_never_records(dev):
    w = ndl.Tensor(np.ones((3, 3)), device=dev)
    step = ndl.compile(lambda a: a @ w, kernels=False)
    x = ndl.Tensor(np.ones((2, 3)), device=dev, requires_grad=False)
    for _ in range(6):
        step(x)
    assert step.stats()["kernel_replays"] == 0
    assert step.replay_mode() == {"mode": "python", "reason": "compiled with kernels=False"}


SCALE = 2.0  # a module global the step below reads


def test_a_global_the_step_reads_is_guarded(dev):
    """A Python number a kernel program baked in (here a module global) may change between
    calls: the guard sees it and the step runs its Python with the new value."""
    global SCALE
    w = ndl.Tensor(np.ones((2, 2)), device=dev)

    def helper(a):
        return a * SCALE  # read through a helper function: walked as well

    step = ndl.compile(lambda a: helper(a @ w))
    x = ndl.Tensor(np.ones((1, 2)), device=dev, requires_grad=False)
    try:
        assert [float(step(x).numpy()[0, 0]) for _ in range(5)] == [4.0] * 5
        assert step.replay_mode()["mode"] == "kernels"
        SCALE = 3.0
        assert float(step(x).numpy()[0, 0]) == 6.0
    finally:
        SCALE = 2.0


def test_arguments_sharing_buffers_otherwise_than_traced_run_the_python(dev):
    """A program recorded from step(x, x) reads one buffer for both; step(a, b) needs two."""
    step = ndl.compile(lambda a, b: a * 2 + b)
    x = ndl.Tensor(np.ones(4), device=dev, requires_grad=False)
    for _ in range(5):
        step(x, x)
    assert step.replay_mode()["mode"] == "kernels"
    a = ndl.Tensor(np.full(4, 3.0), device=dev, requires_grad=False)
    b = ndl.Tensor(np.full(4, 10.0), device=dev, requires_grad=False)
    assert step(a, b).numpy().tolist() == [16.0] * 4


def test_results_arguments_and_structures_replay(dev):
    """Keyword arguments, nested argument lists, tuple results with Python values."""
    w = ndl.Tensor(np.eye(3), device=dev)

    def step(xs, scale=1.0):
        h = (xs[0] + xs[1]) @ w
        return (h * scale, [h.sum(), None], "done")

    compiled = ndl.compile(step)
    for i in range(6):
        xs = [ndl.Tensor(np.full((2, 3), float(i)), device=dev, requires_grad=False),
              ndl.Tensor(np.ones((2, 3)), device=dev, requires_grad=False)]
        got = compiled(xs, scale=2.0)
        want = step(xs, scale=2.0)
        np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
        assert float(got[1][0].numpy()) == float(want[1][0].numpy())
        assert got[1][1] is None and got[2] == "done" and isinstance(got[1], list)
    assert compiled.stats()["kernel_replays"] == 2


@pytest.mark.parametrize("fusion, native", [(False, True), (False, False), (True, False)])
def test_fusion_and_runner_options_keep_the_numbers(fusion, native):
    dev = ndl.cpu()
    if not dev.enabled():
        pytest.skip("the C++ backend is not built")
    want_params, want_losses, _ = train("mlp", dev, False, 6)
    np.random.seed(11)
    model, _, data = make("mlp", dev)
    opt = ndl.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4)
    model.train()
    step = ndl.compile(step_for(model, opt), fusion=fusion, native=native)
    np.random.seed(3)
    batches = [(ndl.Tensor(x, requires_grad=False), ndl.Tensor(y, requires_grad=False))
               for x, y in data]
    losses = [step(*batches[i % len(batches)]).numpy() for i in range(6)]
    mode = step.replay_mode()
    assert mode["runner"] == ("C++" if native else "Python")
    assert (mode["fused_runs"] > 0) == fusion
    for got, want in zip(losses, want_losses, strict=True):
        np.testing.assert_array_equal(got, want)
    for p, want in zip(model.parameters(), want_params, strict=True):
        np.testing.assert_array_equal(p.numpy(), want)


def test_a_dropped_compiled_step_frees_its_model_without_a_garbage_collection(dev):
    """No reference cycle keeps a program's model and optimizer alive once the step is
    dropped (the generated function must not reach itself through its globals)."""
    import gc

    def run():
        model = nn.Sequential(nn.Linear(16, 16, device=dev), nn.ReLU(), nn.Dropout(0.1))
        opt = ndl.optim.Adam(model.parameters(), lr=0.1)
        compiled = ndl.compile(sum_loss_step(model, opt))
        x = ndl.Tensor(np.ones((4, 16)), device=dev, requires_grad=False)
        for _ in range(6):
            compiled(x)
        assert compiled.replay_mode()["mode"] == "kernels"

    def held():  # kernel workspaces (matmul packing buffers) are kept by the backend: not ours
        stats = mem.stats(dev)
        return stats["requested_bytes"] - stats["by_category"]["workspace"]["current_requested"]

    gc.collect()
    gc.disable()
    try:
        before = held()
        run()
        assert held() == before
    finally:
        gc.enable()


def test_a_kernel_replay_begins_its_plan_prepared_and_unguarded(monkeypatch):
    """On cpu() a kernel replay begins the planned run from entries converted once
    (allocator_plan_begin_prepared), not from the Python list each call, and enters no
    host-read guard (it runs none of the step's Python)."""
    from needle.compiler import compiled as compiled_mod

    dev = ndl.cpu()
    _, _, step = train("mlp", dev, True, FIRST_KERNEL_CALL)
    assert step.replay_mode()["mode"] == "kernels"
    mod = dev.mod
    calls = {"list": 0, "prepared": 0, "guard": 0}

    def counted(name, real):
        def wrapper(*args):
            calls[name] += 1
            return real(*args)
        return wrapper

    monkeypatch.setattr(mod, "allocator_plan_begin", counted("list", mod.allocator_plan_begin))
    monkeypatch.setattr(mod, "allocator_plan_begin_prepared",
                        counted("prepared", mod.allocator_plan_begin_prepared))
    monkeypatch.setattr(compiled_mod, "refuse_host_reads",
                        counted("guard", compiled_mod.refuse_host_reads))
    np.random.seed(11)
    x = ndl.Tensor(np.random.standard_normal((16, 20)), device=dev, requires_grad=False)
    y = ndl.Tensor(np.random.randint(0, 10, 16), device=dev, requires_grad=False)
    before = step.stats()["kernel_replays"]
    for _ in range(3):
        step(x, y)
    assert step.stats()["kernel_replays"] == before + 3
    assert calls == {"list": 0, "prepared": 3, "guard": 0}


def test_recorder_binds_constant_keywords_and_refuses_others():
    """A kernel's keyword arguments that are constants of the step (conv2d's x_view of an
    NCHW input) are bound into the recorded call, which then replays them; a buffer passed
    by keyword cannot be rebound to its slot, so the step is refused kernel replay."""
    from needle.backend_ndarray import NDArray
    from needle.compiler.recorder import record_kernels
    from needle.ops import _conv_kernels

    device = ndl.cpu_numpy()
    x = NDArray(np.arange(2 * 3 * 4 * 4, dtype="float32").reshape(2, 3, 4, 4), device=device)
    w = NDArray(np.ones((3, 3, 3, 5), dtype="float32"), device=device)
    nhwc = x.permute((0, 2, 3, 1))
    with record_kernels(device) as rec:
        out = _conv_kernels.forward(nhwc, w, 1, 1)
    assert rec.problems == []
    call = [op for op in rec.ops if getattr(op, "name", None) == "conv2d_forward"][0]
    assert call.fn.keywords == {"x_view": (0, 48, 4, 1, 16)}
    want = _conv_kernels.forward(nhwc.compact(), w, 1, 1).numpy()
    np.testing.assert_array_equal(out.numpy(), want)
    with record_kernels(device) as rec:
        with pytest.raises(ValueError, match="conv2d"):
            device.mod.conv2d_forward(x._handle, w._handle, out._handle, 2, 4, 4, 3, 3, 3, 5,
                                      1, 1, x_view=x._handle)
    assert rec.problems == ["conv2d_forward takes x_view= that is not a constant of the step"]
