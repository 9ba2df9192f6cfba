"""DistributedDataParallel on the thread transport (multi-process runs: test_multiprocess)."""
from __future__ import annotations

import numpy as np
import pytest

import needle.distributed as dist
from needle import nn
from needle._core.errors import GraphError
from needle.autograd import Tensor

from ._ddp_checks import (
    check_equal_batches,
    check_no_sync_accumulation,
    check_overlap_order,
    check_unequal_batches,
    check_unused_across_steps,
    make_model,
)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("check", [check_equal_batches, check_unequal_batches,
                                   check_no_sync_accumulation, check_overlap_order,
                                   check_unused_across_steps])
def test_ddp_gradients_equal_single_process_union(check, world: int) -> None:
    dist.spawn_threads(check, world, world)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(Tensor(np.ones(1, np.float32)))

    def forward(self, c: Tensor) -> Tensor:
        return (c * self.w).sum() / c.shape[0]


@pytest.mark.parametrize("num_examples,want", [(True, 7.0), (False, 5.0)])
def test_worked_example_global_mean(num_examples: bool, want: float) -> None:
    """Rank 0: 1 example of gradient 1; rank 1: 3 examples of mean gradient 9."""

    def job(rank: int) -> float:
        ddp = dist.DistributedDataParallel(Scale())
        c = np.array([[1.0], [9.0, 9.0, 9.0]][rank], np.float32)
        if num_examples:
            ddp.set_num_examples(len(c))
        ddp(Tensor(c)).backward()
        ddp.finish_gradient_sync()
        return float(ddp.module.w.grad.numpy()[0])

    assert dist.spawn_threads(job, 2) == [want, want]
    assert want == (1 * 1 + 3 * 9) / 4 if num_examples else (1 + 9) / 2


def test_unused_parameter_is_named() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(2, 1)
            self.unused = nn.Linear(2, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.used(x)

    def job(rank: int) -> None:
        ddp = dist.DistributedDataParallel(TwoHeads())
        ddp(Tensor(np.ones((1, 2), np.float32))).sum().backward()
        with pytest.raises(GraphError, match="got no gradient.*unused"):
            ddp.finish_gradient_sync()
        ok = dist.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
        ok(Tensor(np.ones((1, 2), np.float32))).sum().backward()
        ok.finish_gradient_sync()
        assert not ok.module.unused.weight.grad.numpy().any()
        assert ok.module.used.weight.grad.numpy().all()

    dist.spawn_threads(job, 1)


def test_forgotten_sync_says_what_to_call() -> None:
    """A plain optimizer (not wrap_optimizer) never syncs: step 2's backward says what to do."""
    from needle import optim

    def job(rank: int) -> None:
        ddp = make_model()
        opt = optim.SGD(ddp.parameters(), lr=0.1)
        x = Tensor(np.ones((2, 5), np.float32))
        ddp(x).sum().backward()
        opt.step()
        opt.reset_grad()
        with pytest.raises(GraphError, match="fired twice") as info:
            ddp(x).sum().backward()
        for advice in ("ddp.finish_gradient_sync()", "ddp.wrap_optimizer(optimizer)",
                       "ddp.no_sync()"):
            assert advice in str(info.value), str(info.value)

    dist.spawn_threads(job, 1)


def test_different_bucket_plans_name_the_ranks() -> None:
    def job(rank: int) -> None:
        model = nn.Linear(3, 2 + (rank == 2))
        with pytest.raises(dist.CommError, match=r"ranks \[2\] have a different bucket plan"):
            dist.DistributedDataParallel(model)

    dist.spawn_threads(job, 3, timeout=5)


def test_wrapped_optimizer_syncs_before_step() -> None:
    class Recorder:
        def __init__(self, ddp):
            self.ddp, self.seen = ddp, None

        def step(self):
            self.seen = self.ddp.module.weight.grad.numpy().copy()

    def job(rank: int) -> list[float]:
        ddp = dist.DistributedDataParallel(nn.Linear(2, 1))
        opt = ddp.wrap_optimizer(Recorder(ddp))
        ddp(Tensor(np.full((1, 2), float(rank), np.float32))).sum().backward()
        opt.step()
        return opt.seen.ravel().tolist()

    assert dist.spawn_threads(job, 2) == [[0.5, 0.5], [0.5, 0.5]]


class SharedGradient(nn.Module):
    """``(a + b).sum()``: the engine may hand a and b one and the same gradient Tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(Tensor(np.ones(3, np.float32)))
        self.b = nn.Parameter(Tensor(np.ones(3, np.float32)))

    def forward(self, x: Tensor) -> Tensor:
        return ((self.a + self.b) * x).sum()


def test_synced_gradients_do_not_alias_between_parameters() -> None:
    """Each parameter's synced gradient is reduced once, even when the grads alias."""

    def job(rank: int) -> list:
        ddp = dist.DistributedDataParallel(SharedGradient())
        out_grad = Tensor(np.ones((), np.float32), requires_grad=False)
        ddp(Tensor(np.full(3, rank + 1.0, np.float32))).backward(out_grad)
        ddp.finish_gradient_sync()
        a, b = ddp.module.a.grad.numpy(), ddp.module.b.grad.numpy()
        return [a.tolist(), b.tolist(), out_grad.numpy().tolist()]

    # mean of the ranks' x: (1 + 2) / 2 = 1.5 for both parameters; out_grad untouched
    want = [[1.5] * 3, [1.5] * 3, 1.0]
    assert dist.spawn_threads(job, 2) == [want, want]
