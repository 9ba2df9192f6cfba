"""ndl.compile on cuda(): a kernel program captured once as a CUDA graph, launched per step.

Runs on the CUDA emulator, whose stream capture records each launch with its arguments by
value (device pointers included) and each device-to-device copy, as a real graph freezes
them: a buffer that moved after the capture would be read stale, and the equality with eager
steps would break. Each step draws new inputs, so an input not copied into its fixed buffer
breaks it too.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import needle as ndl
from needle import nn
from needle._core.errors import IndexOutOfRange
from needle.memory.cuda_allocator import install_cuda_allocator
from needle.memory.registry import register_allocator, unregister_allocator

sys.path.append(os.path.join(os.path.dirname(__file__), "..", "..", "apps"))
import mlp_resnet  # noqa: E402 - apps/ on sys.path


@pytest.fixture
def dev(emulated_cuda):
    """The emulated cuda() under needle's caching allocator (as on a real device)."""
    mod = emulated_cuda.mod
    register_allocator("cuda", install_cuda_allocator(mod, mod.runtime.cupy_module().cuda.alloc))
    yield emulated_cuda
    unregister_allocator("cuda")
    mod.set_allocator(None)


def _counts(dev) -> dict:
    """The emulator's launch and copy counts (none on a real GPU)."""
    return dict(getattr(dev.mod.runtime.cupy_module(), "counts", {}))


def _mlp(dev):
    return nn.Sequential(nn.Linear(6, 8, device=dev), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(8, 3, device=dev))


def _conv_net(dev):
    """ResNet9's pieces, small: convolutions, BatchNorm (running statistics are state the
    step reads and replaces), a residual add."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv(2, 4, 3, stride=2, device=dev),
                                      nn.BatchNorm2d(4, device=dev), nn.ReLU())
            self.res = nn.Sequential(nn.Conv(4, 4, 3, device=dev),
                                     nn.BatchNorm2d(4, device=dev), nn.ReLU())
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 3 * 3, 3, device=dev))

        def forward(self, x):
            h = self.stem(x)
            return self.head(self.res(h) + h)

    return Net()


def _mlp_resnet(dev):
    return mlp_resnet.MLPResNet(6, 8, num_blocks=1, num_classes=3, drop_prob=0.2, device=dev)


def train(dev, make_model, x_shape, graphs, steps, opt="sgd", load_at=None, arena="bounded",
          lr_at=None):
    """``steps`` SGD-with-momentum steps on fresh batches (eager when ``graphs`` is "eager");
    returns the parameters and BatchNorm statistics after each step, every step's loss
    (read at the end: a returned loss must survive later steps), the compiled step and the
    emulator's counts over the last step."""
    np.random.seed(0)
    model = make_model(dev)
    params = model.parameters()
    optimizer = (ndl.optim.SGD(params, lr=0.1, momentum=0.5, weight_decay=0.01)
                 if opt == "sgd" else ndl.optim.Adam(params, lr=0.01))
    loss_fn = nn.SoftmaxLoss()

    def step(x, y):
        optimizer.reset_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    if graphs != "eager":
        step = ndl.compile(step, graphs=graphs, arena=arena)
    stats = [m for m in _modules(model) if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))]
    rng = np.random.default_rng(1)
    np.random.seed(2)
    losses, seen = [], []
    for i in range(steps):
        if i == load_at:  # a parameter loaded between calls is read, not the graph's copy
            params[0].data = ndl.Tensor(np.full(params[0].shape, 0.05), device=dev)
        if i == lr_at:  # the guard sees it: the step records and is captured anew
            optimizer.lr = 0.03
        x = ndl.Tensor(rng.standard_normal(x_shape), device=dev)
        y = ndl.Tensor(rng.integers(0, 3, x_shape[0]), device=dev)
        before = _counts(dev)
        losses.append(step(x, y))
        after = _counts(dev)
        seen.append([p.numpy() for p in params]
                    + [b.running_mean.numpy() for b in stats]
                    + [b.running_var.numpy() for b in stats])
    delta = {k: after[k] - before[k] for k in after}
    return seen, [loss.numpy() for loss in losses], step, delta


def _modules(module):
    yield module
    for child in module._children():
        yield child


def _same(a, b) -> None:
    (seen_a, loss_a), (seen_b, loss_b) = a, b
    for step_a, step_b in zip(seen_a, seen_b, strict=True):
        for u, v in zip(step_a, step_b, strict=True):
            np.testing.assert_array_equal(u, v)
    for u, v in zip(loss_a, loss_b, strict=True):
        np.testing.assert_array_equal(u, v)


def test_graph_replays_equal_eager_steps_in_one_launch_each(dev):
    """Dropout (masks drawn on the host before each launch), SoftmaxLoss (labels checked
    through the fixed label buffer), SGD with momentum and weight decay: every step's
    parameters and loss bitwise those of eager steps. The last step is one graph launch, no
    kernel launched from Python, the two inputs copied into their fixed buffers and the
    loss copied out; parameters and momenta stay where the graph put them (no copies). The
    plan's arena holds every intermediate, at the offsets the graph uses too."""
    eager = train(dev, _mlp, (4, 6), "eager", steps=6)
    graph = train(dev, _mlp, (4, 6), None, steps=6, arena="all")
    _same(eager[:2], graph[:2])
    step, delta = graph[2], graph[3]
    stats = step.stats()
    assert stats["captures"] == 1 and stats["graph_replays"] == 2, \
        step.replay_mode()["graph_reason"]
    assert step.replay_mode()["graph"] is True, step.replay_mode()
    assert delta["graph_launches"] == 1 and delta["kernels"] == 0, delta
    assert delta["copies"] == 2 + 1, delta  # x and y in, the loss out
    assert delta["captures"] == 0, delta
    assert step._last.cuda_graph.copies == 2
    assert len(step._last.cuda_graph.fills) == 1  # the dropout mask, drawn on the host
    # a bad label is still reported at the next synchronisation, as eagerly
    x = ndl.Tensor(np.zeros((4, 6)), device=dev)
    loss = step(x, ndl.Tensor(np.array([0, 1, 7, 2]), device=dev))
    assert step.stats()["graph_replays"] == 3
    with pytest.raises(IndexOutOfRange, match="7"):
        loss.numpy()


@pytest.mark.slow
def test_graph_replays_of_a_conv_batch_norm_net_equal_eager_steps(dev):
    eager = train(dev, _conv_net, (2, 2, 5, 5), "eager", steps=6)
    graph = train(dev, _conv_net, (2, 2, 5, 5), None, steps=6)
    _same(eager[:2], graph[:2])
    assert graph[2].stats()["graph_replays"] == 2


@pytest.mark.slow
def test_graph_replays_of_mlp_resnet_equal_eager_steps_with_a_load_between(dev):
    """MLPResNet (BatchNorm1d, Dropout); a parameter loaded between two graph replays is
    copied in by the next one."""
    eager = train(dev, _mlp_resnet, (4, 6), "eager", steps=6, load_at=5)
    graph = train(dev, _mlp_resnet, (4, 6), None, steps=6, load_at=5)
    _same(eager[:2], graph[:2])
    assert graph[2].stats()["graph_replays"] == 2


def test_a_learning_rate_set_between_graph_replays_is_captured_anew(dev):
    eager = train(dev, _mlp, (4, 6), "eager", steps=9, lr_at=5)
    graph = train(dev, _mlp, (4, 6), None, steps=9, lr_at=5)
    _same(eager[:2], graph[:2])
    stats = graph[2].stats()
    assert stats["captures"] == 2 and stats["graph_replays"] == 3, stats


def test_adam_steps_fall_back_to_the_plain_replay_and_say_why(dev):
    _, _, step, delta = train(dev, _mlp, (4, 6), None, steps=5, opt="adam")
    mode = step.replay_mode()
    assert mode["mode"] == "kernels" and mode["graph"] is False, mode
    assert "replayed()" in mode["graph_reason"] and "freeze" in mode["graph_reason"]
    assert step.stats()["kernel_replays"] == 1 and step.stats()["graph_replays"] == 0
    assert delta["graph_launches"] == 0 and delta["kernels"] > 0, delta


def test_graphs_false_keeps_the_plain_replay(dev):
    _, _, step, delta = train(dev, _mlp, (4, 6), False, steps=5)
    mode = step.replay_mode()
    assert mode["graph"] is False and mode["graph_reason"] is None, mode
    assert step.stats()["kernel_replays"] == 1 and step.stats()["captures"] == 0
    assert delta["graph_launches"] == 0 and delta["kernels"] > 0, delta


def test_a_cupy_without_stream_capture_falls_back(dev, monkeypatch):
    cuda = dev.mod.runtime.cupy_module().cuda

    class OldStream:  # a CuPy before stream capture
        def __init__(self, non_blocking=False):
            self.ptr = 1

    monkeypatch.setattr(cuda, "Stream", OldStream)
    _, _, step, _ = train(dev, _mlp, (4, 6), None, steps=5)
    reason = step.replay_mode()["graph_reason"]
    assert "no stream capture" in reason and "begin_capture" in reason, reason
    assert step.stats()["kernel_replays"] == 1 and step.stats()["captures"] == 0


def test_graphs_true_off_cuda_warns_once_with_the_reason():
    w = ndl.Tensor(np.ones((3, 3)), device=ndl.cpu_numpy())
    step = ndl.compile(lambda x: ndl.ops.relu(x @ w), graphs=True)
    x = ndl.Tensor(np.ones((2, 3)), device=ndl.cpu_numpy())
    for _ in range(4):
        step(x)
    with pytest.warns(RuntimeWarning, match=r"without a CUDA graph: CUDA graphs need a "
                                            r"cuda\(\) program, got cpu_numpy\(\)"):
        step(x)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(x)  # once: the reason is kept, not warned again
    assert step.stats()["kernel_replays"] == 2


def test_bad_graphs_option_is_refused():
    with pytest.raises(ndl.CompileError, match=r"bad graphs, expected None, True or False, "
                                               r"got 'yes'"):
        ndl.compile(lambda x: x, graphs="yes")


def test_a_workspace_made_inside_a_kernel_call_falls_back(dev):
    """One long row summed: the backend splits it and makes the partials' workspace inside
    the call, unseen by the recording, so the capture is refused with that reason."""
    from needle.backend_ndarray._cuda import launch

    n = 8192
    assert launch.plan_reduce(1, n, dev.mod.runtime.num_sms(0)).kind == "split"
    w = ndl.Tensor(np.linspace(0.0, 1.0, n), device=dev)
    step = ndl.compile(lambda x: (x * w).sum())
    x = ndl.Tensor(np.full(n, 2.0), device=dev)
    for _ in range(5):
        out = step(x)
    reason = step.replay_mode()["graph_reason"]
    assert "workspace" in reason and "did not see" in reason, reason
    assert step.stats()["kernel_replays"] == 1 and step.stats()["captures"] == 0
    np.testing.assert_allclose(out.numpy(), 2 * np.linspace(0.0, 1.0, n).sum(), rtol=1e-5)
