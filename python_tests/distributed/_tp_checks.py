"""Tensor-parallel checks shared by the thread tests and the multi-process script."""
from __future__ import annotations

import numpy as np

import needle as ndl
from needle import nn
from needle.autograd import Tensor
from needle.distributed import tensor_parallel as tp

from ._pipeline_checks import _BUILD

I2 = np.eye(2, dtype=np.float32)


def worked_example(rank: int, world: int) -> dict:
    """x = [1, 2], W1a = I, W1b = 2I, W2a = W2b = I on 2 ranks; loss = sum(y)."""
    assert world == 2
    fc1, fc2 = nn.Linear(2, 4, bias=False), nn.Linear(4, 2, bias=False)
    fc1.weight.data = Tensor(np.hstack([I2, 2 * I2]))
    fc2.weight.data = Tensor(np.vstack([I2, I2]))
    mlp = tp.ParallelMLP.from_full(fc1, fc2, activation=nn.Identity())
    x = Tensor(np.array([[1.0, 2.0]], np.float32))
    y = mlp(x)
    y.sum().backward()
    return {"y": y.numpy(), "dx": x.grad.numpy(), "dW1": mlp.fc1.weight.grad.numpy(),
            "dW2": mlp.fc2.weight.grad.numpy(), "W1": mlp.fc1.weight.numpy(),
            "W2": mlp.fc2.weight.numpy()}


def check_worked_example(rank: int, world: int) -> None:
    got = worked_example(rank, world)
    np.testing.assert_array_equal(got["W1"], I2 * (1 + rank))  # W1a = I, W1b = 2I
    np.testing.assert_array_equal(got["y"], [[3.0, 6.0]])
    # input gradient: [1, 1] from shard a plus [2, 2] from shard b
    np.testing.assert_array_equal(got["dx"], [[3.0, 3.0]])
    # dW1 shard = x^T (dy W2_shard^T) = x^T [1, 1]; dW2 shard = z_shard^T [1, 1]
    np.testing.assert_array_equal(got["dW1"], [[1.0, 1.0], [2.0, 2.0]])
    z = np.array([[1.0, 2.0]]) * (1 + rank)
    np.testing.assert_array_equal(got["dW2"], z.T @ np.ones((1, 2)))


def _model(seed: int, dtype: str = "float32", dropout: float = 0.0) -> nn.Sequential:
    with _BUILD:
        np.random.seed(seed)
        ndl.random.seed(seed)
        kw = {"dtype": dtype}
        inner = nn.Sequential(nn.Linear(8, 4, **kw), nn.BatchNorm1d(4, dtype=dtype), nn.ReLU(),
                              nn.Linear(4, 8, **kw))
        return nn.Sequential(nn.Linear(6, 8, **kw), nn.ReLU(), nn.Residual(inner),
                             nn.Linear(8, 8, **kw), nn.Tanh(), nn.Linear(8, 4, **kw))


def check_parallel_sequential(rank: int, world: int, dtype: str = "float32") -> None:
    """A sharded model computes the unsharded model's output and gradients."""
    full, sharded_src = _model(3, dtype), _model(3, dtype)
    sharded = tp.parallelize_sequential(sharded_src)
    names = [type(m).__name__ for m in sharded.modules]
    assert names == ["ColumnParallelLinear", "ReLU", "Residual", "ColumnParallelLinear",
                     "Tanh", "RowParallelLinear"], names
    X = np.random.RandomState(5).randn(5, 6).astype(dtype)
    outs = []
    for model in (full, sharded):
        x = Tensor(X, dtype=dtype)
        out = model(x)
        (out * out).sum().backward()
        outs.append((out.numpy(), x.grad.numpy()))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(outs[1][0], outs[0][0], **tol)
    np.testing.assert_allclose(outs[1][1], outs[0][1], **tol)
    # each shard's gradient is its slice of the full gradient (parameters stay in order)
    pairs = list(zip(full.parameters(), sharded.parameters(), strict=True))
    for f, p in pairs:
        np.testing.assert_allclose(p.grad.numpy(), _slice_like(f.grad.numpy(), p, rank), **tol)
    for want, got in zip([p.numpy() for p in full.parameters()],
                         tp.gather_full_parameters(sharded), strict=True):
        np.testing.assert_array_equal(got, want)


def _slice_like(full: np.ndarray, shard, rank: int) -> np.ndarray:
    """The slice of ``full`` that rank ``rank`` holds when its shard has ``shard``'s shape."""
    shape = tuple(shard.shape)
    if full.shape == shape:
        return full
    axis = next(i for i, (a, b) in enumerate(zip(full.shape, shape, strict=True)) if a != b)
    width = shape[axis]
    index = [slice(None)] * full.ndim
    index[axis] = slice(rank * width, (rank + 1) * width)
    return full[tuple(index)]


def check_attention(rank: int, world: int, causal: bool, cross: bool) -> None:
    """Heads split over ranks: the same output and gradients as nn.MultiHeadAttention."""
    with _BUILD:
        np.random.seed(1)
        full = nn.MultiHeadAttention(8, 4, causal=causal, dtype="float64")
    sharded = tp.ParallelMultiHeadAttention.from_full(full)
    assert sharded.local_heads == 4 // world
    rng = np.random.RandomState(2)
    X, C = rng.randn(2, 3, 8), rng.randn(2, 5, 8)
    results = []
    for layer in (full, sharded):
        x = Tensor(X, dtype="float64")
        c = Tensor(C, dtype="float64") if cross else None
        out = layer(x, c)
        (out * out).sum().backward()
        grads = [x.grad.numpy()] + ([c.grad.numpy()] if cross else [])
        results.append((out.numpy(), grads))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-10, atol=1e-12)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
    h = 8 // world
    np.testing.assert_allclose(sharded.q_proj.weight.grad.numpy(),
                               full.q_proj.weight.grad.numpy()[:, rank * h:(rank + 1) * h],
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sharded.out_proj.weight.grad.numpy(),
                               full.out_proj.weight.grad.numpy()[rank * h:(rank + 1) * h],
                               rtol=1e-10, atol=1e-12)
