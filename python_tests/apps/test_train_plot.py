"""``training.png``: the accuracy panel shows a history of one epoch (markers) and labels
epochs with whole numbers."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.figure  # noqa: E402
import pytest  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from training.summary import write_outputs  # noqa: E402


@pytest.fixture
def saved(monkeypatch):
    figures = []
    real = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures


def test_one_epoch_is_visible_and_epochs_are_whole(tmp_path, saved):
    summary = {"history": {"epoch": [1], "train_acc": [0.8], "test_acc": [0.7],
                           "test_loss": [0.5]},
               "losses": [1.0, 0.9, 0.8], "steps_per_epoch": 3,
               "config": {"model": "mlp", "data": "digits"}, "strategy": "ps",
               "world_size": 3, "device": "cpu()"}
    write_outputs(summary, str(tmp_path))
    accuracy = saved[-1].axes[1]
    assert all(line.get_marker() == "o" for line in accuracy.get_lines())
    assert isinstance(accuracy.xaxis.get_major_locator(), MaxNLocator)
    ticks = [t for t in accuracy.get_xticks() if float(t).is_integer() is False]
    assert ticks == []
