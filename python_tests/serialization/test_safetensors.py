"""``.safetensors`` through ``ndl.save``/``ndl.load``, and weights that move between needle
and PyTorch both ways (layouts converted by ``nn.torch_state_dict`` /
``nn.load_torch_state_dict``)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import needle as ndl
from needle import nn
from needle._core.errors import SerializationError, ShapeError

pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")


def _needle_model():
    return nn.Sequential(nn.Conv(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 6),
                         nn.ReLU(), nn.Linear(6, 2))


def _torch_model():
    # needle's Conv pads "same" (K // 2): padding=1 for K = 3
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(100, 6), torch.nn.ReLU(),
                               torch.nn.Linear(6, 2))


def _x():
    return np.random.default_rng(0).standard_normal((2, 3, 5, 5)).astype(np.float32)


def test_state_dict_round_trips_by_extension(tmp_path):
    np.random.seed(0)
    state = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float64),
             "c": np.array([1, 2], np.int64), "t": ndl.Tensor([1.0, 2.0])}
    path = tmp_path / "m.safetensors"
    ndl.save(state, str(path))
    assert path.read_bytes()[8:9] == b"{"  # a safetensors header, not a zip archive
    back = ndl.load(str(path))
    assert sorted(back) == sorted(state)
    for name, value in state.items():
        expected = np.asarray(value)
        assert back[name].dtype == expected.dtype
        np.testing.assert_array_equal(back[name], expected)
    tensors = ndl.load(str(path), device=ndl.cpu())
    assert isinstance(tensors["a"], ndl.Tensor) and tensors["a"].shape == (2, 3)


def test_pytorch_written_weights_load_into_needle_and_back(tmp_path):
    torch.manual_seed(0)
    reference = _torch_model()
    path = str(tmp_path / "torch.safetensors")
    st_torch.save_file(reference.state_dict(), path)  # written by PyTorch's tools

    np.random.seed(1)
    model = _needle_model()
    nn.load_torch_state_dict(model, ndl.load(path))
    x = _x()
    expected = reference(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(model(ndl.Tensor(x)).numpy(), expected, rtol=1e-4, atol=1e-5)

    # and back: needle writes, PyTorch reads into a fresh model that computes the same
    out = str(tmp_path / "needle.safetensors")
    ndl.save(nn.torch_state_dict(model), out)
    fresh = _torch_model()
    fresh.load_state_dict(st_torch.load_file(out))
    np.testing.assert_allclose(fresh(torch.tensor(x)).detach().numpy(), expected,
                               rtol=1e-5, atol=1e-6)


def test_layouts_are_pytorchs():
    np.random.seed(0)
    model = _needle_model()
    state = nn.torch_state_dict(model)
    torch_shapes = {k: tuple(v.shape) for k, v in _torch_model().state_dict().items()}
    assert {k: v.shape for k, v in state.items()} == torch_shapes
    np.testing.assert_array_equal(state["3.weight"], model.modules[3].weight.numpy().T)


def test_mismatched_names_are_listed():
    np.random.seed(0)
    with pytest.raises(ShapeError, match=r"load_torch_state_dict: names differ.*'0.weight'"):
        nn.load_torch_state_dict(_needle_model(), {"0.weight": np.zeros((4, 3, 3, 3))})


def test_nested_state_and_models_are_refused(tmp_path):
    np.random.seed(0)
    model = nn.Linear(2, 2)
    opt = ndl.optim.Adam(model.parameters())
    with pytest.raises(SerializationError, match=r"'optimizer' is a dict, expected an array.*"
                                                 r"needle's own format"):
        ndl.save({"optimizer": opt.state_dict()}, str(tmp_path / "s.safetensors"))
    for path in ("m.safetensors", "m.ndl"):
        with pytest.raises(SerializationError, match=r"got a Linear object.*state_dict\(\)"):
            ndl.save(model, str(tmp_path / path))
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_a_missing_package_and_a_bad_file_are_clear(tmp_path, monkeypatch):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors at all")
    with pytest.raises(SerializationError, match=r"not a readable .safetensors file"):
        ndl.load(str(bad))
    with pytest.raises(SerializationError, match=r"no such file"):
        ndl.load(str(tmp_path / "none.safetensors"))
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)  # import fails
    with pytest.raises(SerializationError, match=r"needs the safetensors package"):
        ndl.save({"w": np.ones(2)}, str(tmp_path / "w.safetensors"))
