"""ndl.compile and Plan.run on cuda() through the CUDA emulator (kernels compiled for the
host): replay == eager bitwise, measured peak == planned peak."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle import nn
from needle.memory.cuda_allocator import install_cuda_allocator
from needle.memory.registry import register_allocator, unregister_allocator


@pytest.fixture
def dev(emulated_cuda):
    """The emulated cuda() with needle's caching allocator over the emulator's memory (what
    the device hook installs on a real GPU)."""
    mod = emulated_cuda.mod
    register_allocator("cuda", install_cuda_allocator(mod, mod.runtime.cupy_module().cuda.alloc))
    yield emulated_cuda
    unregister_allocator("cuda")
    mod.set_allocator(None)


def _mlp(dev):
    return nn.Sequential(nn.Linear(8, 16, device=dev), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(16, 4, device=dev))


def run(dev, compiled, calls=4, make_model=_mlp, x_shape=(4, 8), classes=4, x_grad=True):
    """SGD-with-momentum steps of ``make_model(dev)`` on random batches: (parameters after,
    the step, the peak bytes each call requested)."""
    np.random.seed(0)
    model = make_model(dev)
    opt = ndl.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    loss_fn = nn.SoftmaxLoss()

    def step(x, y):
        opt.reset_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    if compiled:
        step = ndl.compile(step, graphs=False)  # the plain replay: its peaks are planned
    rng = np.random.default_rng(1)
    np.random.seed(2)
    peaks = []
    for _ in range(calls):
        x = ndl.Tensor(rng.standard_normal(x_shape), device=dev, requires_grad=x_grad)
        y = ndl.Tensor(rng.integers(0, classes, x_shape[0]), device=dev)
        before = mem.stats(dev)["requested_bytes"]
        mem.reset_peak(dev)
        step(x, y)
        peaks.append(mem.stats(dev)["peak_requested_bytes"] - before)
    return [p.numpy() for p in model.parameters()], step, peaks


def test_compiled_steps_equal_eager_steps_on_emulated_cuda(dev):
    want, _, _ = run(dev, False)
    got, step, peaks = run(dev, True)
    assert step.stats()["replays"] == 2 and step.stats()["divergences"] == 0
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert peaks[-1] == peaks[-2] == step.memory()["planned_peak_bytes"]


def test_a_softmax_loss_step_becomes_a_kernel_program_on_emulated_cuda(dev):
    """SoftmaxLoss runs the CUDA backend's fused softmax_xent kernels (labels checked on the
    host inside the kernel call, no one-hot built there): the step replays as a kernel
    program, and its parameters are those of eager steps bitwise."""
    want, _, _ = run(dev, False, calls=6)
    got, step, peaks = run(dev, True, calls=6)
    mode = step.replay_mode()
    assert mode["mode"] == "kernels", mode
    assert step.stats()["kernel_replays"] == 2
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert peaks[-1] == peaks[-2] == step.memory()["planned_peak_bytes"]


def test_kernel_replays_equal_eager_steps_on_emulated_cuda(dev):
    """A squared-error step (no labels) as a kernel program on the emulated device."""

    def run_kernels(compiled):
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(8, 16, device=dev), nn.ReLU(), nn.Dropout(0.3),
                              nn.Linear(16, 4, device=dev))
        opt = ndl.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)

        def step(x, y):
            opt.reset_grad()
            loss = ((model(x) - y) ** 2).sum()
            loss.backward()
            opt.step()
            return loss

        step = ndl.compile(step, graphs=False) if compiled else step
        rng = np.random.default_rng(1)
        np.random.seed(2)
        losses, peaks = [], []
        for _ in range(6):  # warm-up, trace, two recorded replays, two kernel replays
            x = ndl.Tensor(rng.standard_normal((4, 8)), device=dev, requires_grad=False)
            y = ndl.Tensor(rng.standard_normal((4, 4)), device=dev, requires_grad=False)
            before = mem.stats(dev)["requested_bytes"]
            mem.reset_peak(dev)
            losses.append(step(x, y).numpy())
            peaks.append(mem.stats(dev)["peak_requested_bytes"] - before)
        return [p.numpy() for p in model.parameters()] + losses, step, peaks

    want, _, _ = run_kernels(False)
    got, step, peaks = run_kernels(True)
    assert step.stats()["kernel_replays"] == 2 and step.replay_mode()["mode"] == "kernels"
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert peaks[-1] == peaks[-2] == step.memory()["planned_peak_bytes"]


def test_plan_run_on_emulated_cuda(dev):
    w = ndl.Tensor(np.ones((16, 16)), device=dev)

    def infer(a):
        with ndl.no_grad():
            return ndl.ops.relu(ndl.ops.relu(a @ w) @ w) @ w

    x = ndl.Tensor(np.full((4, 16), 0.5), device=dev)
    g = mem.trace(infer, x)
    assert [op.name for op in g.ops][:2] == ["MatMul", "ReLU"]
    assert g.ops[1].inputs == g.ops[0].outputs  # reads are seen on cuda() buffers too
    p = mem.plan(g)
    out = p.run(x)
    np.testing.assert_array_equal(out.numpy(), infer(x).numpy())


def test_conv_batch_norm_step_replays_kernels_on_emulated_cuda(dev):
    """A conv + batch-norm step (the CUDA convolution kernels take a patch-matrix workspace
    inside the call) replays as a kernel program with eager's parameters bitwise, its
    planned peak measured, and the SGD-with-momentum updates fused (ewise_program)."""

    def conv_net(dev):
        return nn.Sequential(nn.Conv(2, 4, 3, stride=2, device=dev),
                             nn.BatchNorm2d(4, device=dev), nn.ReLU(), nn.Flatten(),
                             nn.Linear(4 * 3 * 3, 3, device=dev))

    def run_conv(compiled):
        return run(dev, compiled, calls=6, make_model=conv_net, x_shape=(2, 2, 5, 5),
                   classes=3, x_grad=False)

    want, _, _ = run_conv(False)
    got, step, peaks = run_conv(True)
    mode = step.replay_mode()
    assert mode["mode"] == "kernels" and step.stats()["kernel_replays"] == 2, mode
    assert mode["fused_runs"] > 0, mode
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    # a kernel program frees a pool buffer right after its last kernel (eagerly it may go
    # later), so a kernel replay needs at most the planned peak, itself within the eager one
    m = step.memory()
    assert peaks[-1] == peaks[-2] <= m["planned_peak_bytes"] <= m["eager_peak_bytes"]
