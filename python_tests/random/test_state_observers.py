"""``needle.random.add_state_observer``: every ``set_state`` is seen, with its arguments and after
the state took effect; removing the handle stops it."""
from __future__ import annotations

import numpy as np
import pytest

from needle import random as nr
from needle._core.errors import RNGStateError


def test_an_observer_sees_every_set_state_after_it_took_effect():
    nr.seed(4)
    saved_all, saved_host = nr.get_state(), nr.get_state("cpu")
    seen = []

    def observer(state, device):
        host = np.random.get_state()  # what is in force when the observer runs
        seen.append((state, device, (host[1].copy(), host[2])))

    first = nr.rand(3)
    with nr.add_state_observer(observer):
        nr.set_state(saved_all)
        np.testing.assert_array_equal(nr.rand(3), first)
        nr.set_state(saved_host, "cpu")
    assert [(s is saved_all, d) for s, d, _ in seen] == [(True, None), (False, "cpu")]
    assert seen[1][0] is saved_host
    key, pos = seen[0][2]  # NumPy's generator was already back at the saved state
    np.testing.assert_array_equal(key, saved_all["host"][1])
    assert pos == saved_all["host"][2]
    nr.set_state(saved_all)
    assert len(seen) == 2  # removed with the block


def test_fork_rng_restoring_its_state_is_seen():
    seen = []
    with nr.add_state_observer(lambda state, device: seen.append(device)):
        with nr.fork_rng():
            nr.rand(2)
    assert seen == [None]


def test_a_refused_state_is_not_reported():
    seen = []
    with nr.add_state_observer(lambda state, device: seen.append(device)):
        with pytest.raises(RNGStateError):
            nr.set_state(nr.RNGState({"no such stream": None}))
    assert seen == []


def test_set_state_stays_the_modules_own_function():
    # observers are the declared way in: nobody needs to rebind nr.set_state
    original = nr.set_state
    with nr.add_state_observer(lambda state, device: None):
        assert nr.set_state is original
    assert "add_state_observer" in nr.__all__
