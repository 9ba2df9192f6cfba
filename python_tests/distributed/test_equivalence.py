"""check_equivalence: N ranks x G micro-batches reproduce the full-batch gradient."""
from __future__ import annotations

import numpy as np
import pytest

import needle.distributed as dist
from needle import nn

from ._zero_checks import float64_mlp

X = np.random.default_rng(1).standard_normal((37, 5))
Y = np.arange(37) % 3


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy,stage", [("ddp", 0), ("zero", 1), ("zero", 2),
                                            ("zero", 3)])
def test_ranks_times_micro_batches_equal_the_full_batch(strategy, stage, world, capsys):
    report = dist.check_equivalence(float64_mlp, nn.SoftmaxLoss(), X, Y, world_size=world,
                                    accumulate=3, strategy=strategy, stage=stage)
    assert report.total == 37 and sum(report.local) == 37
    assert all(sum(m) == n for m, n in zip(report.micro_batches, report.local, strict=True))
    sizes = {n for m in report.micro_batches for n in m}
    assert len(sizes) > 1  # the micro-batches really differ in size
    out = capsys.readouterr().out
    assert "micro-batch denominators n_i per rank" in out and "global denominator N = " \
        "sum n_rank: 37" in out


def test_a_wrong_weighting_is_caught():
    """A loss that sums instead of averaging over its examples is not the mean loss: the
    accumulated gradient differs and the harness names the parameter."""
    summed = nn.SoftmaxLoss()

    def loss_sum(logits, y):
        return summed(logits, y) * y.shape[0]

    with pytest.raises(AssertionError, match="gradient of 'modules.0.weight' differs"):
        dist.check_equivalence(float64_mlp, loss_sum, X, Y, world_size=2, verbose=False)


def test_bad_arguments():
    with pytest.raises(ValueError, match="expected at least 4 examples"):
        dist.check_equivalence(float64_mlp, nn.SoftmaxLoss(), X[:3], Y[:3], world_size=1,
                               accumulate=4, verbose=False)
    with pytest.raises(ValueError, match="strategy must be 'ddp' or 'zero'"):
        dist.check_equivalence(float64_mlp, nn.SoftmaxLoss(), X, Y, strategy="ps")
