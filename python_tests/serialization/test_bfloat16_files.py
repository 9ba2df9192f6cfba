"""bfloat16 through ``ndl.save``/``ndl.load`` (needle's format and ``.safetensors``, whose
``BF16`` PyTorch reads and writes): every bit comes back, NaN payloads, -0 and subnormals
included."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import needle as ndl

BF16 = np.dtype(ml_dtypes.bfloat16)
# 1, 2.5, -0, the smallest subnormal, a quiet NaN with a payload, -inf, the largest value
BITS = np.array([0x3F80, 0x4020, 0x8000, 0x0001, 0x7FC1, 0xFF80, 0x7F7F], np.uint16)


def test_needle_format_round_trips_bfloat16_bitwise(tmp_path, device):
    x = BITS.view(BF16)
    path = tmp_path / "state.ndl"
    ndl.save({"array": x, "tensor": ndl.Tensor(x, device=device),
              "view": x.reshape(7, 1).T}, path)
    back = ndl.load(path, device=device)
    assert back["array"].dtype == BF16 and back["tensor"].dtype == "bfloat16"
    for name in ("array", "tensor"):
        np.testing.assert_array_equal(np.asarray(back[name].numpy() if name == "tensor"
                                                 else back[name]).view(np.uint16), BITS)
    np.testing.assert_array_equal(np.asarray(back["view"]).view(np.uint16), BITS.reshape(1, 7))


def test_safetensors_bf16_round_trips_through_pytorch(tmp_path, device):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "torch.safetensors"
    st_torch.save_file({"w": torch.from_numpy(BITS.view(np.int16).copy()).view(torch.bfloat16)},
                       str(path))
    loaded = ndl.load(path, device=device)
    assert loaded["w"].dtype == "bfloat16"
    np.testing.assert_array_equal(loaded["w"].numpy().view(np.uint16), BITS)
    again = tmp_path / "needle.safetensors"
    ndl.save({"w": loaded["w"]}, again)
    back = st_torch.load_file(str(again))["w"]
    assert back.dtype == torch.bfloat16
    np.testing.assert_array_equal(back.view(torch.int16).numpy().view(np.uint16), BITS)
