"""TrainState.load_state_dict restores the random streams after every part.

A part whose ``load_state_dict`` draws random numbers (a data loader reshuffling, a model
re-initialising a buffer) must not move the restored streams: the draws after loading are
those that followed the save.
"""
from __future__ import annotations

import numpy as np

import needle as ndl
from needle.train_state import TrainState


class _DrawsWhileLoading:
    """A part that draws from needle's streams and NumPy's global generator when loaded."""

    def __init__(self):
        self.loaded = None

    def state_dict(self) -> dict:
        return {"value": 1}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = (ndl.random.rand(3), np.random.rand(2), state["value"])


def test_a_part_that_draws_while_loading_does_not_move_the_restored_streams():
    ndl.random.seed(5)
    np.random.seed(5)
    ndl.random.rand(4)  # somewhere in the middle of the streams
    saved = TrainState(extra={"step": 2}, sampler=_DrawsWhileLoading()).state_dict()
    want_ndl, want_np = ndl.random.rand(6), np.random.rand(6)

    ndl.random.seed(99)  # another position, as in a fresh process
    np.random.seed(99)
    part = _DrawsWhileLoading()
    TrainState(sampler=part).load_state_dict(saved)
    assert part.loaded is not None and part.loaded[2] == 1  # the part did draw
    np.testing.assert_array_equal(ndl.random.rand(6), want_ndl)
    np.testing.assert_array_equal(np.random.rand(6), want_np)


def test_every_part_loads_before_the_streams_whatever_the_order_of_parts():
    """Several drawing parts, declared before and after the built-in ones."""
    ndl.random.seed(1)
    np.random.seed(1)
    saved = TrainState(first=_DrawsWhileLoading(), model=_DrawsWhileLoading(),
                       last=_DrawsWhileLoading()).state_dict()
    want = ndl.random.rand(5)
    ndl.random.seed(2)
    parts = {k: _DrawsWhileLoading() for k in ("first", "model", "last")}
    TrainState(**parts).load_state_dict(saved)
    assert all(p.loaded is not None for p in parts.values())
    np.testing.assert_array_equal(ndl.random.rand(5), want)
