"""Collectives, point-to-point and DDP on cuda() tensors (host-staged), on the CUDA emulator."""
from __future__ import annotations

import numpy as np
import pytest

import needle.distributed as dist
from needle import nn
from needle.autograd import Tensor

from ._zero_checks import _BUILD

pytestmark = pytest.mark.slow


def test_all_reduce_and_p2p_of_cuda_tensors(emulated_cuda):
    dev = emulated_cuda

    def job(rank):
        t = Tensor(np.arange(4, dtype=np.float32) + rank, device=dev)
        dist.all_reduce(t, op="sum")
        got = Tensor(np.zeros(3, np.float32), device=dev)
        if rank == 0:
            dist.send(Tensor(np.array([1.0, 2.0, 3.0], np.float32), device=dev), dst=1)
        else:
            dist.recv(got, src=0)
        return t.device == dev, t.numpy().tolist(), got.numpy().tolist()

    (on0, sum0, _), (on1, sum1, got1) = dist.spawn_threads(job, 2)
    assert on0 and on1 and sum0 == sum1 == [1.0, 3.0, 5.0, 7.0]
    assert got1 == [1.0, 2.0, 3.0]


def test_ddp_on_cuda_tensors_matches_the_host(emulated_cuda):
    dev = emulated_cuda
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3)).astype(np.float32)

    def job(rank):
        np.random.seed(0)
        layer = nn.Linear(3, 2, device=dev)
        ddp = dist.DistributedDataParallel(layer)
        part = Tensor(x[rank * 2:(rank + 1) * 2], device=dev, requires_grad=False)
        ddp(part).sum().backward()
        ddp.finish_gradient_sync()
        return layer.weight.grad.device == dev, layer.weight.grad.numpy()

    results = dist.spawn_threads(job, 2)
    np.random.seed(0)
    host = nn.Linear(3, 2)
    (host(Tensor(x, requires_grad=False)).sum() / 2).backward()
    for on_device, grad in results:
        assert on_device
        np.testing.assert_allclose(grad, host.weight.grad.numpy(), rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_on_cuda_tensors_matches_the_host(emulated_cuda, stage):
    """ZeRO stages on cuda() parameters (host-staged communication): the pieces, gathered
    weights and updates stay on the device and equal the host run."""
    from needle import optim

    dev = emulated_cuda
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)

    def job(rank, device):
        with _BUILD:  # NumPy's global generator is shared by the thread ranks
            np.random.seed(0)
            model = nn.Sequential(nn.Linear(3, 4, device=device), nn.ReLU(),
                                  nn.Linear(4, 2, device=device))
        zero = dist.ZeroDataParallel(model, optimizer=lambda ps: optim.SGD(ps, lr=0.5),
                                     stage=stage)
        part = Tensor(x[rank * 2:(rank + 1) * 2], device=device, requires_grad=False)
        zero(part).sum().backward()
        zero.step()
        on_device = all(p.device == device for p in zero.inner.params)
        return on_device, zero.full_parameters()

    host = dist.spawn_threads(job, 2, None)
    cuda = dist.spawn_threads(job, 2, dev)
    for (on_device, got), (_, want) in zip(cuda, host, strict=True):
        assert on_device
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
