"""CUDA graph replay on a real GPU: the emulator's tests (test_graph_replay.py) on ``cuda()``.

Graph-replayed steps give bitwise the parameters, BatchNorm statistics and losses of eager
steps, and each step past the capture is one graph launch. Skipped, with the reason, where
``cuda()`` is not available.
"""
from __future__ import annotations

import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle.backend_ndarray import devices as _devices

if not nd.cuda().enabled():
    pytest.skip(f"cuda() is not available here ({_devices._LOAD_ERRORS.get('cuda', '?')})",
                allow_module_level=True)

from test_graph_replay import _conv_net, _mlp, _mlp_resnet, _same, train  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("make_model, x_shape", [(_mlp, (4, 6)), (_conv_net, (2, 2, 5, 5)),
                                                 (_mlp_resnet, (4, 6))])
def test_graph_replays_equal_eager_steps_on_the_gpu(make_model, x_shape):
    dev = ndl.cuda()
    eager = train(dev, make_model, x_shape, "eager", steps=7, load_at=6)
    graph = train(dev, make_model, x_shape, None, steps=7, load_at=6)
    _same(eager[:2], graph[:2])
    step = graph[2]
    stats = step.stats()
    assert stats["captures"] == 1 and stats["graph_replays"] == 3, \
        step.replay_mode()["graph_reason"]
