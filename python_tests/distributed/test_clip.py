"""Gradient clipping by the whole model's norm on thread ranks: ZeRO's gradient pieces,
tensor-parallel shards, pipeline stages and the dp x tp x pp mesh all give the norm one
process computes over the whole model's gradients, and the clipped step its parameters."""
from __future__ import annotations

import math

import numpy as np
import pytest

import needle.distributed as dist
from needle import nn, optim
from needle._core.errors import CommError
from needle.autograd import Tensor
from needle.distributed import pipeline
from needle.distributed import tensor_parallel as tp

from ._pipeline_checks import build_mlp, data, numpy_loss_and_grads

pytestmark = pytest.mark.timeout(240)

LR = 0.1
N = 13


def _reference(fraction: float = 0.25):
    """(norm, max_norm, parameters after one clipped SGD step) of the whole model in float64,
    with ``max_norm`` a ``fraction`` of the norm, so clipping really scales."""
    before = [p.numpy() for p in build_mlp().parameters()]
    X, y = data(N)
    _, grads = numpy_loss_and_grads(before, X, y)
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    max_norm = fraction * norm
    coef = max_norm / (norm + 1e-6)
    return norm, max_norm, [b - LR * coef * g for b, g in zip(before, grads, strict=True)]


def _close(got: list, want: list, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(np.asarray(g).reshape(w.shape), w, rtol=1e-4, atol=1e-6,
                                   err_msg=f"{what}: parameter {i}")


def test_one_process_clips_by_the_whole_norm():
    norm, max_norm, after = _reference()
    model = build_mlp()
    X, y = data(N)
    nn.SoftmaxLoss()(model(Tensor(X)), Tensor(y)).backward()
    got = optim.clip_grad_norm(model.parameters(), max_norm)
    optim.SGD(model.parameters(), lr=LR).step()
    assert got == pytest.approx(norm, rel=1e-5)
    _close([p.numpy() for p in model.parameters()], after, "single process")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_zero_pieces_give_the_whole_norm_and_step(stage, world):
    norm, max_norm, after = _reference()
    X, y = data(N)

    def job(rank):
        zero = dist.ZeroDataParallel(build_mlp(), stage=stage,
                                     optimizer=lambda ps: optim.SGD(ps, lr=LR))
        Xr, yr = X[rank::world], y[rank::world]
        zero.set_num_examples(len(yr))
        nn.SoftmaxLoss()(zero(Tensor(Xr)), Tensor(yr)).backward()
        got = zero.clip_grad_norm(max_norm)
        zero.step()
        params = zero.full_parameters()
        zero.close()
        return got, params

    out = dist.spawn_threads(job, world)
    norms = [n for n, _ in out]
    assert len(set(norms)) == 1, norms  # the same float on every rank: the same scale
    assert norms[0] == pytest.approx(norm, rel=1e-5)
    for r, (_, params) in enumerate(out):
        _close(params, after, f"ZeRO-{stage} rank {r}")


def test_zero_mixed_precision_unscales_once_then_clips():
    # float16 weights and a loss scale: scaler.unscale_ gives the true pieces, the clip
    # takes their whole norm, and the step does not unscale again
    from needle import amp

    norm, max_norm, after = _reference()
    before = [p.numpy() for p in build_mlp().parameters()]
    X, y = data(N)

    def job(rank):
        model = amp.cast_parameters(build_mlp())
        zero = dist.ZeroDataParallel(model, stage=2, optimizer=lambda ps: optim.SGD(ps, lr=LR))
        scaler = amp.GradScaler(init_scale=2.0 ** 10)
        Xr, yr = X[rank::2], y[rank::2]
        zero.set_num_examples(len(yr))
        with amp.autocast():
            loss = nn.SoftmaxLoss()(zero(Tensor(Xr)), Tensor(yr))
        scaler.scale(loss).backward()
        scaler.unscale_(zero.optimizer)
        got = zero.clip_grad_norm(max_norm)
        ran = scaler.step(zero.optimizer)
        params = zero.full_parameters()
        zero.close()
        return got, ran, params

    for got, ran, params in dist.spawn_threads(job, 2):
        assert ran and got == pytest.approx(norm, rel=2e-2)
        for i, (p, b, a) in enumerate(zip(params, before, after, strict=True)):
            # the step moved each weight by the clipped update (float16 rounding aside)
            np.testing.assert_allclose(np.asarray(p, np.float64).reshape(b.shape) - b, a - b,
                                       rtol=0.1, atol=2e-3, err_msg=f"parameter {i}")


def _mesh_job(rank, shape, max_norm, schedule="1f1b"):
    """One clipped SGD step of the 8-layer MLP on ``shape`` = (dp, tp, pp): (norm, the norm
    a rank would get without counting replicated parameters once, this rank's whole
    parameters by index)."""
    dp, _, pp = shape
    mesh = dist.init_device_mesh(shape)
    tp_group, pp_group = mesh.get_group("tp"), mesh.get_group("pp")
    pieces = pipeline.split_sequential(build_mlp(), pp)
    k = mesh.local_rank("pp")
    module = tp.parallelize_sequential(pieces[k], tp_group)
    stage = pipeline.PipelineStage(module, k, pp, group=pp_group)
    sched = pipeline.schedule_class(schedule)(stage, 2, loss_fn=nn.SoftmaxLoss())
    X, y = data(N)
    d = mesh.local_rank("dp")
    Xr, yr = X[d::dp], y[d::dp]
    sched.step(Xr if k == 0 else None, yr if k == pp - 1 else None)
    params = module.parameters()
    dist.mesh.average_gradients(params, mesh.get_group("dp"), len(yr))
    # max_norm far above any norm: the norm without scaling anything
    double_counted = dist.clip_grad_norm(params, 1e30, group=[tp_group, pp_group])
    norm = dist.clip_grad_norm(params, max_norm, group=[tp_group, pp_group],
                               replicated=tp.replicated_parameters(module),
                               replicated_group=tp_group)
    optim.SGD(params, lr=LR).step()
    first = sum(len(p.parameters()) for p in pieces[:k])
    whole = dict(enumerate(tp.gather_full_parameters(module), start=first))
    return norm, double_counted, whole


@pytest.mark.parametrize("shape", [(1, 2, 1), (1, 1, 2), (2, 1, 1), (1, 2, 2), (2, 2, 2)],
                         ids=["tp", "pp", "dp", "tp-pp", "3d"])
def test_sharded_and_staged_models_give_the_whole_norm_and_step(shape):
    norm, max_norm, after = _reference()
    world = int(np.prod(shape))
    out = dist.spawn_threads(_mesh_job, world, shape, max_norm, timeout=240)
    norms = [n for n, _, _ in out]
    assert len(set(norms)) == 1, norms
    assert norms[0] == pytest.approx(norm, rel=1e-5)
    if shape[1] > 1:  # the replicated biases and last layer, counted by every tp rank
        assert out[0][1] > norm * (1 + 1e-3)
    for r, (_, _, whole) in enumerate(out):
        _close(list(whole.values()), [after[i] for i in whole], f"{shape} rank {r}")


def test_a_local_norm_differs_on_every_rank():
    # why the groups matter: ZeRO's pieces alone give each rank its own, smaller norm
    norm, _, _ = _reference()
    X, y = data(N)

    def job(rank):
        zero = dist.ZeroDataParallel(build_mlp(), stage=2,
                                     optimizer=lambda ps: optim.SGD(ps, lr=LR))
        zero.set_num_examples(len(y[rank::2]))
        nn.SoftmaxLoss()(zero(Tensor(X[rank::2])), Tensor(y[rank::2])).backward()
        zero.finish_gradient_sync()
        local = optim.clip_grad_norm(zero.optimizer.params, 1e30)
        zero.close()
        return local

    a, b = dist.spawn_threads(job, 2)
    assert a != b and a < norm and b < norm
    assert math.hypot(a, b) == pytest.approx(norm, rel=1e-5)


def test_bad_arguments_are_refused():
    with pytest.raises(CommError, match="clip_grad_norm: max_norm must be a positive"):
        dist.clip_grad_norm([], 0.0)
    with pytest.raises(CommError, match="max_norm"):
        dist.clip_grad_norm([], float("nan"))

    def job(rank):
        g = dist.new_group()
        p = Tensor([1.0])
        p.grad = Tensor([1.0])
        with pytest.raises(CommError, match="replicated_group"):
            dist.clip_grad_norm([p], 1.0, group=[g, g], replicated=[p])
        return dist.clip_grad_norm([p], 1.0, group=g, replicated=[p])  # counted once

    assert dist.spawn_threads(job, 2) == [1.0, 1.0]
