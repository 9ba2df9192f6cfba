"""DataLoader: batch order, the one-permutation-per-pass rule, Tensor batches, resume."""
from __future__ import annotations

import numpy as np
import pytest

from needle._core.errors import NeedleError, ShapeError
from needle.autograd import Tensor
from needle.data import DataLoader, Dataset, NDArrayDataset


def _dataset(n=10, d=3):
    return NDArrayDataset(np.arange(n * d, dtype=np.float32).reshape(n, d), np.arange(n) % 4)


def _ids(batches):
    # First feature / d identifies the example in _dataset().
    return [(b[0].numpy()[:, 0] / 3).astype(int).tolist() for b in batches]


def _drain(it):
    out = []
    while True:
        try:
            out.append(next(it))
        except StopIteration:
            return out


def test_in_order_batches_with_short_tail():
    loader = DataLoader(_dataset(10), batch_size=4)
    assert len(loader) == 3
    batches = list(loader)
    assert _ids(batches) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    X, y = batches[0]
    assert isinstance(X, Tensor) and X.dtype == "float32" and y.shape == (4,)
    np.testing.assert_array_equal(y.numpy(), [0, 1, 2, 3])
    assert _ids(list(loader)) == _ids(batches)  # a second pass restarts


def test_drop_last_and_bad_batch_size():
    loader = DataLoader(_dataset(10), batch_size=4, drop_last=True)
    assert len(loader) == 2 and _ids(list(loader)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(NeedleError, match="batch_size"):
        DataLoader(_dataset(), batch_size=0)


def test_shuffle_draws_one_permutation_per_pass_at_iteration_start():
    np.random.seed(11)
    loader = DataLoader(_dataset(10), batch_size=3, shuffle=True)
    first = _ids(list(loader))
    second = _ids(list(loader))
    marker = np.random.rand()
    np.random.seed(11)  # constructing the loader consumed nothing
    p1, p2 = np.random.permutation(10), np.random.permutation(10)
    assert marker == np.random.rand()  # and nothing else was drawn
    expect = [np.array_split(p, range(3, 10, 3)) for p in (p1, p2)]
    assert first == [list(b) for b in expect[0]]
    assert second == [list(b) for b in expect[1]]


def test_permutation_is_drawn_when_iteration_starts_not_at_construction():
    loader = DataLoader(_dataset(8), batch_size=8, shuffle=True)
    np.random.seed(5)
    got = _ids(list(loader))[0]
    np.random.seed(5)
    assert got == list(np.random.permutation(8))


def test_resume_mid_epoch_gives_the_remaining_batches():
    np.random.seed(3)
    loader = DataLoader(_dataset(11), batch_size=3, shuffle=True)
    it = iter(loader)
    seen = [next(it), next(it)]
    state = loader.state_dict()
    rest = _drain(it)  # list(it) would call iter() again and start a new pass (course rule)
    assert state["batch_index"] == 2 and sorted(state["order"].tolist()) == list(range(11))

    fresh = DataLoader(_dataset(11), batch_size=3, shuffle=True)
    fresh.load_state_dict(state)
    np.random.seed(999)
    before = np.random.get_state()[1].copy()
    resumed = list(fresh)
    assert np.array_equal(before, np.random.get_state()[1])  # resuming draws nothing
    assert _ids(resumed) == _ids(rest)
    assert sorted(sum(_ids(seen) + _ids(resumed), [])) == list(range(11))
    assert len(_ids(list(fresh))) == 4  # the pass after that is a normal new pass


def test_load_state_dict_rejects_other_dataset():
    loader = DataLoader(_dataset(6), batch_size=2)
    iter(loader)
    with pytest.raises(ShapeError, match="order"):
        DataLoader(_dataset(7), batch_size=2).load_state_dict(loader.state_dict())


class _IntOnly(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        if not isinstance(i, int):
            raise TypeError("int only")
        return np.full(2, i, dtype=np.float32), i


def test_dataset_that_only_takes_ints_is_stacked():
    batches = list(DataLoader(_IntOnly(), batch_size=2))
    np.testing.assert_array_equal(batches[0][0].numpy(), [[0, 0], [1, 1]])
    np.testing.assert_array_equal(batches[2][1].numpy(), [4])


def test_batches_on_a_given_device():
    import needle.backend_ndarray as nd

    dev = nd.cpu_numpy()
    X, _ = next(iter(DataLoader(_dataset(4), batch_size=2, device=dev)))
    assert X.device == dev
