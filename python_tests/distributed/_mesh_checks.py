"""A training step on a dp x tp x pp mesh against NumPy's serial step (threads or processes)."""
from __future__ import annotations

import numpy as np

import needle.distributed as dist
from needle import nn, optim
from needle.distributed import pipeline
from needle.distributed import tensor_parallel as tp

from ._pipeline_checks import build_mlp, data, numpy_loss_and_grads

LR = 0.1


def check_mesh_step(rank: int, world: int, shape: tuple, schedule: str = "1f1b",
                    m: int = 2, n: int = 13) -> float:
    """One SGD step of the 8-layer MLP on ``shape`` = (dp, tp, pp) equals the serial step:
    returns the global loss (on every rank)."""
    dp, _, pp = shape
    mesh = dist.init_device_mesh(shape)
    model = build_mlp()
    before = [p.numpy() for p in model.parameters()]
    pieces = pipeline.split_sequential(model, pp)
    k = mesh.local_rank("pp")
    module = tp.parallelize_sequential(pieces[k], mesh.get_group("tp"))
    stage = pipeline.PipelineStage(module, k, pp, group=mesh.get_group("pp"))
    sched = pipeline.schedule_class(schedule)(stage, m, loss_fn=nn.SoftmaxLoss())
    X, y = data(n)
    d = mesh.local_rank("dp")
    Xr, yr = X[d::dp], y[d::dp]  # this replica's share of the global batch
    opt = optim.SGD(module.parameters(), lr=LR)
    loss = sched.step(Xr if k == 0 else None, yr if k == pp - 1 else None)
    dist.mesh.average_gradients(module.parameters(), mesh.get_group("dp"), len(yr))
    opt.step()
    # the whole updated model, assembled from every stage's gathered tensor-parallel shards
    mine = tp.gather_full_parameters(module)
    first = sum(len(p.parameters()) for p in pieces[:k])
    want_loss, grads = numpy_loss_and_grads(before, X, y)
    for i, got in enumerate(mine, start=first):
        np.testing.assert_allclose(got, before[i] - LR * grads[i], rtol=1e-4, atol=1e-6,
                                   err_msg=f"rank {rank} {mesh} parameter {i}")
    total = np.zeros(1)
    if k == pp - 1 and mesh.local_rank("tp") == 0:
        total[0] = loss * len(yr) / n
    dist.all_reduce(total)
    assert abs(total[0] - want_loss) < 1e-5, (total[0], want_loss)
    return float(total[0])
