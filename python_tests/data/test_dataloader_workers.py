"""DataLoader(num_workers=..., collate_fn=...): worker processes serve the batches of
num_workers=0, in its order, and the resume position stays exact."""
from __future__ import annotations

import numpy as np
import pytest

from needle._core.errors import NeedleError
from needle.data import DataLoader, NDArrayDataset

# the suite kills processes a test leaves behind, multiprocessing's resource tracker too: it
# is started again by the next test that needs it, with this warning
pytestmark = pytest.mark.filterwarnings("ignore:resource_tracker:UserWarning")


def _dataset():
    x = np.arange(46 * 3, dtype=np.float32).reshape(46, 3)
    return NDArrayDataset(x, np.arange(46, dtype=np.float32))


def _batches(loader, count=None):
    it = iter(loader)
    out = []
    while count is None or len(out) < count:
        try:
            batch = next(it)
        except StopIteration:
            break
        out.append(tuple(t.numpy() for t in batch))
    return out


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y)
        for u, v in zip(x, y, strict=True):
            np.testing.assert_array_equal(u, v)


def _pair_sum(items):
    # a PyTorch-style collate_fn: a list of (x, y) items -> arrays with a batch axis
    return np.stack([x + 1 for x, _ in items]), np.array([y for _, y in items])


@pytest.mark.parametrize("collate_fn", [None, _pair_sum], ids=["default", "collate_fn"])
def test_workers_serve_the_batches_of_num_workers_0(collate_fn):
    expected, states = [], []
    for workers in (0, 2):
        np.random.seed(5)
        loader = DataLoader(_dataset(), 4, shuffle=True, num_workers=workers,
                            collate_fn=collate_fn)
        got = _batches(loader) + _batches(loader)  # two passes, two permutations
        loader.close()
        expected.append(got)
        states.append(np.random.get_state()[1].copy())  # the workers drew nothing here
    _same(expected[0], expected[1])
    np.testing.assert_array_equal(states[0], states[1])
    assert len(expected[0]) == 2 * 12


def test_resume_with_workers_is_exact():
    np.random.seed(2)
    whole = DataLoader(_dataset(), 5, shuffle=True)
    expected = _batches(whole)
    np.random.seed(2)
    first = DataLoader(_dataset(), 5, shuffle=True, num_workers=2)
    head = _batches(first, count=4)  # the workers have fetched further ahead
    state = first.state_dict()
    first.close()
    assert state["batch_index"] == 4
    second = DataLoader(_dataset(), 5, shuffle=True, num_workers=2)
    second.load_state_dict(state)
    tail = _batches(second)
    second.close()
    _same(head + tail, expected)


def test_bad_num_workers_is_refused():
    for bad in (-1, 1.5, True):
        with pytest.raises(NeedleError, match=r"DataLoader: num_workers must be an int >= 0"):
            DataLoader(_dataset(), 2, num_workers=bad)
