"""Tensor parallelism on thread ranks: the worked example, layers equal to their unsharded
versions (outputs and gradients), numerical gradient checks, attention split by heads.
Real processes: test_pipeline_mp.py."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.distributed as dist
from needle import nn
from needle._core.errors import ShapeError
from needle.autograd import Tensor
from needle.distributed import tensor_parallel as tp

from . import _tp_checks as checks
from ._pipeline_checks import _BUILD

pytestmark = pytest.mark.timeout(240)


def test_worked_example_gives_3_6_on_both_ranks_and_its_gradients():
    dist.spawn_threads(checks.check_worked_example, 2, 2)


def test_worked_example_equals_the_unsharded_layer():
    sharded = dist.spawn_threads(checks.worked_example, 2, 2)
    W1 = np.hstack([np.eye(2), 2 * np.eye(2)])
    W2 = np.vstack([np.eye(2), np.eye(2)])
    x = Tensor(np.array([[1.0, 2.0]]), dtype="float64")
    w1, w2 = Tensor(W1, dtype="float64"), Tensor(W2, dtype="float64")
    y = (x @ w1) @ w2
    y.sum().backward()
    np.testing.assert_array_equal(y.numpy(), [[3.0, 6.0]])
    np.testing.assert_array_equal(sharded[0]["dx"], x.grad.numpy())
    np.testing.assert_array_equal(np.hstack([s["dW1"] for s in sharded]), w1.grad.numpy())
    np.testing.assert_array_equal(np.vstack([s["dW2"] for s in sharded]), w2.grad.numpy())


@pytest.mark.parametrize("world", [2, 4])
def test_column_and_row_layers_equal_linear(world):
    def job(rank):
        with _BUILD:
            np.random.seed(0)
            fc = nn.Linear(4, 8, dtype="float64")
        X = np.random.RandomState(1).randn(3, 2, 4)
        out = {}
        for name, layer in (("full", fc),
                            ("col", tp.ColumnParallelLinear.from_full(fc, gather_output=True)),
                            ("row", tp.RowParallelLinear.from_full(fc, input_is_parallel=False))):
            x = Tensor(X, dtype="float64")
            y = layer(x)
            (y * y).sum().backward()
            out[name] = (y.numpy(), x.grad.numpy())
        return out

    for res in dist.spawn_threads(job, world):
        for name in ("col", "row"):
            np.testing.assert_allclose(res[name][0], res["full"][0], rtol=1e-12)
            np.testing.assert_allclose(res[name][1], res["full"][1], rtol=1e-12)


def test_seeded_construction_does_not_depend_on_the_number_of_ranks():
    def job(rank, world):
        with _BUILD:
            np.random.seed(7)
            ndl.random.seed(7)
            mlp = tp.ParallelMLP(4, 8, 3)
        return tp.gather_full_parameters(mlp)

    one, two = dist.spawn_threads(job, 1, 1)[0], dist.spawn_threads(job, 2, 2)[1]
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("world", [2, 4])
def test_parallelized_model_equals_the_model(world):
    dist.spawn_threads(checks.check_parallel_sequential, world, world)


def test_parallelized_model_in_float64():
    dist.spawn_threads(checks.check_parallel_sequential, 2, 2, "float64")


@pytest.mark.parametrize("causal,cross", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("world", [2, 4])
def test_attention_split_by_heads_equals_multihead_attention(world, causal, cross):
    dist.spawn_threads(checks.check_attention, world, world, causal, cross)


def test_numerical_gradient_check_through_the_collectives():
    def job(rank):
        with _BUILD:
            np.random.seed(3)
            mlp = tp.ParallelMLP(3, 4, 2, activation=nn.Tanh(), dtype="float64")
        x = np.random.RandomState(4).randn(2, 3)
        return ndl.autograd.gradcheck(lambda t: mlp(t), x)

    assert dist.spawn_threads(job, 2) == [True, True]


@pytest.mark.parametrize("op,expect_fwd,expect_bwd", [
    (tp.copy_to_parallel, lambda xs, r: xs[r], lambda gs, r: sum(gs)),
    (tp.reduce_from_parallel, lambda xs, r: sum(xs), lambda gs, r: gs[r]),
])
def test_conjugate_ops_against_numpy(op, expect_fwd, expect_bwd):
    xs = [np.array([1.0, 2.0, 3.0]) * (r + 1) for r in range(3)]
    gs = [np.array([0.5, -1.0, 2.0]) + r for r in range(3)]

    def job(rank):
        x = Tensor(xs[rank], dtype="float64")
        y = op(x)
        y.backward(Tensor(gs[rank], dtype="float64"))
        return y.numpy(), x.grad.numpy()

    for r, (y, g) in enumerate(dist.spawn_threads(job, 3)):
        np.testing.assert_allclose(y, expect_fwd(xs, r))
        np.testing.assert_allclose(g, expect_bwd(gs, r))


def test_gather_and_scatter_are_inverse():
    def job(rank):
        x = Tensor(np.arange(4.0).reshape(2, 2) + 10 * rank, dtype="float64")
        y = tp.gather_from_parallel(x)
        back = tp.scatter_to_parallel(y)
        (y * Tensor(np.arange(8.0).reshape(2, 4), dtype="float64")).sum().backward()
        return y.numpy(), back.numpy(), x.grad.numpy()

    res = dist.spawn_threads(job, 2)
    np.testing.assert_array_equal(res[0][0], [[0, 1, 10, 11], [2, 3, 12, 13]])
    np.testing.assert_array_equal(res[1][1], [[10, 11], [12, 13]])
    np.testing.assert_array_equal(res[1][2], [[2, 3], [6, 7]])  # its slice of the weights


def test_indivisible_sizes_are_named():
    def job(rank):
        with pytest.raises(ShapeError, match=r"out_features 5 must divide among 2 ranks, "
                                             r"expected a multiple of 2, got 5"):
            tp.ColumnParallelLinear(3, 5)
        with pytest.raises(ShapeError, match="num_heads must divide among 2 ranks"):
            tp.ParallelMultiHeadAttention(6, 3)
        return rank

    dist.spawn_threads(job, 2)
