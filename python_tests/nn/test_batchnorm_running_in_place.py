"""BatchNorm's running statistics are updated in their own buffers in eager training.

The update is one elementwise program that reads each element before it stores it, so it may
write its result over the old statistics: no new buffers per layer and step. It does so only
while nothing but the layer's Tensors can see those buffers; otherwise (a caller holding the
array) the old arrays keep their values and new ones are installed, as before.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle import nn
from needle.autograd.versions import data_version


def _input(seed: int = 0) -> ndl.Tensor:
    rng = np.random.default_rng(seed)
    return ndl.Tensor(rng.standard_normal((4, 3, 5, 5)).astype("float32"), device=ndl.cpu())


@pytest.mark.parametrize("cls, shape", [(nn.BatchNorm2d, (4, 3, 5, 5)),
                                        (nn.BatchNorm1d, (6, 3))])
def test_training_updates_the_running_statistics_in_their_own_buffers(cls, shape):
    bn = cls(3, device=ndl.cpu())
    x = ndl.Tensor(np.random.default_rng(1).standard_normal(shape).astype("float32"),
                   device=ndl.cpu())
    ids = (id(bn.running_mean.cached_data), id(bn.running_var.cached_data))
    handles = (id(bn.running_mean.cached_data._handle), id(bn.running_var.cached_data._handle))
    versions = (data_version(bn.running_mean), data_version(bn.running_var))
    for _ in range(3):
        bn(x)
    assert (id(bn.running_mean.cached_data), id(bn.running_var.cached_data)) == ids
    assert (id(bn.running_mean.cached_data._handle),
            id(bn.running_var.cached_data._handle)) == handles
    # every update still counts as a change of the Tensors' data
    assert data_version(bn.running_mean) == versions[0] + 3
    assert data_version(bn.running_var) == versions[1] + 3


def test_in_place_and_new_buffers_give_bitwise_the_same_statistics():
    x = _input()
    alone, watched = nn.BatchNorm2d(3, device=ndl.cpu()), nn.BatchNorm2d(3, device=ndl.cpu())
    for step in range(3):
        held = watched.running_mean.cached_data, watched.running_var.cached_data
        alone(x)
        watched(x)  # the held arrays make it install new ones
        assert watched.running_mean.cached_data is not held[0]
        for a, b in ((alone.running_mean, watched.running_mean),
                     (alone.running_var, watched.running_var)):
            assert a.numpy().tobytes() == b.numpy().tobytes(), step


def test_a_held_array_keeps_its_values():
    bn = nn.BatchNorm2d(3, device=ndl.cpu())
    held = bn.running_var.cached_data
    bn(_input())
    assert held.numpy().tolist() == [1.0, 1.0, 1.0]
    assert bn.running_var.numpy().tolist() != [1.0, 1.0, 1.0]
    view = bn.running_mean.cached_data.reshape((3, 1))  # a view shares the buffer
    before = view.numpy().copy()
    bn(_input(1))
    assert view.numpy().tolist() == before.tolist()
