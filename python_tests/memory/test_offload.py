"""ndl.memory.offload_saved_tensors: saved tensors wait in host memory, the device is freed."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle import nn
from needle.autograd import saved_tensors_hooks
from needle.autograd.release import sweep

DEVICES = [ndl.cpu_numpy()] + ([ndl.cpu()] if ndl.cpu().enabled() else [])
LAYERS, WIDTH, BATCH = 6, 256, 128
ARRAY = BATCH * WIDTH * 4  # one layer output


def _model(device, width=WIDTH):
    np.random.seed(0)
    mods = [m for _ in range(LAYERS) for m in (nn.Linear(width, width, device=device),
                                               nn.ReLU())]
    return nn.Sequential(*mods)


def _held_between_forward_and_backward(model, x, context):
    """Device bytes the step holds after its forward (what waits for backward), and grads."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    before = mem.stats(x.device)["allocated_bytes"]
    with context():
        loss = model(x).sum()
    sweep(final=True)  # what backward() does first: the same moment for every variant
    held = mem.stats(x.device)["allocated_bytes"] - before
    loss.backward()
    return held, [p.grad.numpy() for p in model.parameters()]


class _Plain:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _HandWritten:
    """What the issue's user wrote: pack to NumPy, unpack back, through the raw hooks."""

    def __enter__(self):
        def pack(t):
            return (t.numpy(), t.device)

        def unpack(p):
            return ndl.Tensor(p[0], device=p[1], requires_grad=False)

        self.hooks = saved_tensors_hooks(pack, unpack)
        return self.hooks.__enter__()

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_offload_lowers_the_device_bytes_held_for_backward(device):
    model = _model(device)
    x = ndl.Tensor(np.random.RandomState(1).randn(BATCH, WIDTH), device=device,
                   requires_grad=False)
    plain, g_plain = _held_between_forward_and_backward(model, x, _Plain)
    offl, g_off = _held_between_forward_and_backward(model, x, mem.offload_saved_tensors)
    # plain: every ReLU output waits on the device (saved by ReLU and by the next matmul)
    assert plain >= LAYERS * ARRAY
    # offloaded: only the loss the caller holds (one 512 B block) stays on the device
    assert offl == 512
    for a, b in zip(g_plain, g_off, strict=True):
        np.testing.assert_array_equal(a, b)  # exact copies: the same gradients, bit for bit


def test_small_activations_leave_the_device_too(monkeypatch):
    """Outputs under autograd's release threshold stay on the device in a plain graph, and a
    hand-written pack-to-NumPy hook does not change that; the block releases every size."""
    from needle.autograd import release

    monkeypatch.setattr(release, "RELEASE_MIN_ELEMENTS", 16384)  # the library's default
    device = ndl.cpu_numpy()
    model = _model(device, width=32)  # 16 x 32 outputs: far below the release threshold
    x = ndl.Tensor(np.ones((16, 32)), device=device, requires_grad=False)
    plain, g_plain = _held_between_forward_and_backward(model, x, _Plain)
    hand, _ = _held_between_forward_and_backward(model, x, _HandWritten)
    offl, g_off = _held_between_forward_and_backward(model, x, mem.offload_saved_tensors)
    assert hand >= plain >= 2 * LAYERS * 2048  # linear (one op), relu of every layer
    assert offl == 512
    for a, b in zip(g_plain, g_off, strict=True):
        np.testing.assert_array_equal(a, b)


def test_offload_counts_and_unpacks_in_the_activation_category():
    device = ndl.cpu_numpy()
    x = ndl.Tensor(np.ones((64, 64)), device=device)
    with mem.offload_saved_tensors() as off:
        y = (ndl.exp(x * 2) * 3).sum()
    assert off.packed == 1 and off.packed_bytes == 64 * 64 * 4  # exp's output; x is a leaf
    with mem.record(device) as events:
        y.backward()
    assert off.unpacked == 1
    assert any(e.kind == "alloc" and e.category == "activation" and e.requested == 64 * 64 * 4
               for e in events)
    np.testing.assert_allclose(x.grad.numpy(), 6 * np.exp(2.0), rtol=1e-6)
