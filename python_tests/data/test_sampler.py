"""DistributedSampler: each rank's share of one permutation; DataLoader(..., sampler=...)."""
from __future__ import annotations

import numpy as np
import pytest

from needle._core.errors import IndexOutOfRange, NeedleError, ShapeError
from needle.data import DataLoader, DistributedSampler, NDArrayDataset


def _dataset(n: int) -> NDArrayDataset:
    return NDArrayDataset(np.arange(n, dtype=np.float32).reshape(n, 1), np.arange(n))


def _oracle_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """What the sampler documents: NumPy's PCG64 seeded by SeedSequence([seed, epoch])."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))) \
        .permutation(n)


@pytest.mark.parametrize("n", [0, 1, 7, 10, 11])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_cover_the_permutation(n: int, world: int) -> None:
    """Without drop_last: every index, each rank ceil(n / world), padding from the start of the
    permutation. With drop_last: disjoint shards of n // world each."""
    want = _oracle_permutation(n, 5, 2)
    for drop_last in (False, True):
        shards = []
        for rank in range(world):
            s = DistributedSampler(_dataset(n), world, rank, seed=5, drop_last=drop_last)
            s.set_epoch(2)
            shards.append(list(s))
            assert len(shards[-1]) == len(s) == (n // world if drop_last else -(-n // world))
        total = len(shards[0]) * world
        padded = np.resize(want, total) if total else want[:0]
        for rank in range(world):
            assert shards[rank] == padded[rank::world].tolist()
        merged = sorted(sum(shards, []))
        if drop_last:
            assert len(set(merged)) == len(merged) == n - n % world
        else:
            assert set(merged) == set(range(n)) and len(merged) == total


def test_every_rank_agrees_and_the_epoch_changes_the_order() -> None:
    ds = _dataset(50)

    def shards(seed: int, epoch: int) -> list[list[int]]:
        out = []
        for rank in range(2):  # separate objects, as in separate processes
            s = DistributedSampler(ds, num_replicas=2, rank=rank, seed=seed)
            s.set_epoch(epoch)
            out.append(list(s))
        return out

    first = shards(7, 0)
    assert sorted(first[0] + first[1]) == list(range(50))  # one permutation, cut in two
    assert shards(7, 0) == first
    assert shards(7, 1) != first and shards(8, 0) != first
    assert first[0] != list(range(0, 50, 2))  # shuffled


def test_global_random_stream_is_untouched() -> None:
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    s = DistributedSampler(_dataset(20), num_replicas=2, rank=1, seed=1)
    list(DataLoader(_dataset(20), 4, sampler=s))
    s.set_epoch(3)
    list(s)
    assert np.array_equal(before, np.random.get_state()[1])


def test_no_shuffle_deals_indices_round_robin() -> None:
    s = DistributedSampler(_dataset(7), num_replicas=3, rank=1, shuffle=False)
    assert list(s) == [1, 4, 0]  # 7 padded to 9 with indices 0 and 1


def test_defaults_come_from_the_launcher_environment(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    s = DistributedSampler(_dataset(8), shuffle=False)
    assert (s.num_replicas, s.rank, list(s)) == (4, 3, [3, 7])
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("PMI_SIZE", raising=False)
    monkeypatch.delenv("PMI_RANK", raising=False)
    s = DistributedSampler(_dataset(3), shuffle=False)
    assert (s.num_replicas, s.rank, list(s)) == (1, 0, [0, 1, 2])


def test_bad_arguments() -> None:
    with pytest.raises(IndexOutOfRange, match=r"expected 0 <= rank < 2, got 2"):
        DistributedSampler(_dataset(4), num_replicas=2, rank=2)
    with pytest.raises(NeedleError, match="num_replicas must be positive"):
        DistributedSampler(_dataset(4), num_replicas=0, rank=0)
    with pytest.raises(NeedleError, match="shuffle and sampler exclude each other"):
        DataLoader(_dataset(4), 2, True, sampler=DistributedSampler(_dataset(4), 1, 0))


def test_loader_batches_the_samplers_indices() -> None:
    s = DistributedSampler(_dataset(11), num_replicas=2, rank=0, seed=4)
    s.set_epoch(1)
    loader = DataLoader(_dataset(11), 4, sampler=s)
    want = _oracle_permutation(11, 4, 1)
    mine = np.resize(want, 12)[0::2]
    assert len(loader) == 2
    got = [b[0].numpy().ravel().astype(int).tolist() for b in loader]
    assert got == [mine[:4].tolist(), mine[4:].tolist()]
    labels = [b[1].numpy().astype(int).tolist() for b in loader]
    assert labels == got
    assert len(DataLoader(_dataset(11), 4, sampler=s, drop_last=True)) == 1
    s.set_epoch(2)  # the loader reads the sampler anew at each pass
    again = [b[0].numpy().ravel().astype(int).tolist() for b in loader]
    assert sum(again, []) == np.resize(_oracle_permutation(11, 4, 2), 12)[0::2].tolist()


def test_resume_with_a_sampler() -> None:
    s = DistributedSampler(_dataset(9), num_replicas=2, rank=1, seed=2)
    loader = DataLoader(_dataset(9), 2, sampler=s)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = []
    while True:
        try:
            rest.append(next(it)[0].numpy().ravel().tolist())
        except StopIteration:
            break
    fresh = DataLoader(_dataset(9), 2, sampler=s)
    fresh.load_state_dict(state)
    assert [b[0].numpy().ravel().tolist() for b in fresh] == rest
    with pytest.raises(ShapeError, match="expected shape \\(5,\\)"):
        fresh.load_state_dict({"order": np.arange(9), "batch_index": 0})
