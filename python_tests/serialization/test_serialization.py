"""ndl.save / ndl.load: round trips, refusals, corrupted files and atomic writes."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim
from needle._core.errors import NeedleError, SerializationError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_nested_round_trip_keeps_types_and_values(tmp_path, device):
    obj = {
        "w": ndl.Tensor(np.arange(6.0).reshape(2, 3), device=device, dtype="float32"),
        "w64": ndl.Tensor([1.5, -2.0], device=device, dtype="float64", requires_grad=False),
        "nested": [1, 2.5, "x", None, True, (3, "y"), {"k": np.int64(7)}],
        7: np.array([[1, 2], [3, 4]], dtype=np.int32),
        "flags": np.array([True, False]),
        "half": np.array([0.5, 65504.0], dtype=np.float16),
        "nan": float("nan"), "inf": float("-inf"), "scalar": np.float32(1.25),
        "empty": np.zeros((0, 3), np.float32), "rng": np.random.get_state(),
    }
    path = tmp_path / "obj.ndl"
    ndl.save(obj, str(path))
    back = ndl.load(str(path))
    assert set(back) == set(obj)
    assert isinstance(back["w"], ndl.Tensor) and back["w"].device == device
    np.testing.assert_array_equal(back["w"].numpy(), obj["w"].numpy())
    assert back["w"].requires_grad and not back["w64"].requires_grad
    assert str(back["w64"].dtype) == "float64"
    assert back["nested"][:5] == [1, 2.5, "x", None, True]
    assert back["nested"][5] == (3, "y") and back["nested"][6]["k"] == 7
    assert back[7].dtype == np.int32 and back[7].tolist() == [[1, 2], [3, 4]]
    assert back["flags"].dtype == np.bool_ and back["half"].dtype == np.float16
    assert np.isnan(back["nan"]) and back["inf"] == float("-inf")
    assert back["scalar"] == np.float32(1.25) and back["scalar"].dtype == np.float32
    assert back["empty"].shape == (0, 3)
    state = back["rng"]
    assert state[0] == "MT19937" and (state[1] == obj["rng"][1]).all()


def test_load_to_another_device(tmp_path):
    path = str(tmp_path / "t.ndl")
    ndl.save(ndl.Tensor([1.0, 2.0], device=ndl.cpu()), path)
    t = ndl.load(path, device=ndl.cpu_numpy())
    assert t.device == ndl.cpu_numpy() and t.numpy().tolist() == [1.0, 2.0]


def test_module_and_optimizer_state_round_trip(tmp_path):
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    opt = optim.Adam(model.parameters(), lr=0.01)
    x = ndl.Tensor(np.random.randn(5, 4))
    for _ in range(2):
        opt.reset_grad()
        model(x).sum().backward()
        opt.step()
    ndl.save({"model": model.state_dict(), "opt": opt.state_dict()}, str(tmp_path / "s.ndl"))
    np.random.seed(1)
    clone = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    clone_opt = optim.Adam(clone.parameters(), lr=0.5)
    state = ndl.load(str(tmp_path / "s.ndl"))
    clone.load_state_dict(state["model"])
    clone_opt.load_state_dict(state["opt"])
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(clone.state_dict()[name], value)
    assert clone_opt.lr == 0.01 and clone_opt.t == opt.t
    for p, q in zip(model.parameters(), clone.parameters(), strict=True):
        np.testing.assert_array_equal(opt.m[p].numpy(), clone_opt.m[q].numpy())


def test_parameters_stay_parameters(tmp_path):
    np.random.seed(0)
    layer = nn.Linear(2, 2)
    ndl.save({"w": layer.weight}, str(tmp_path / "p.ndl"))
    assert isinstance(ndl.load(str(tmp_path / "p.ndl"))["w"], nn.Parameter)


@pytest.mark.parametrize("value,where", [
    (object(), "obj"), ({"a": [1, lambda: 0]}, "obj['a'][1]"),
    (np.array([1, "x"], dtype=object), "obj"), ({(1, 2): 3}, "a key of obj"),
    ({1.5: 3}, "a key of obj"),
])
def test_save_refuses_what_it_cannot_hold(tmp_path, value, where):
    with pytest.raises(SerializationError, match=__import__("re").escape(where)):
        ndl.save(value, str(tmp_path / "bad.ndl"))
    assert not (tmp_path / "bad.ndl").exists()


def _saved(tmp_path) -> str:
    path = str(tmp_path / "good.ndl")
    ndl.save({"a": np.arange(1000, dtype=np.float32), "b": [1, 2]}, path)
    return path


def test_a_flipped_byte_is_a_checksum_error(tmp_path):
    path = _saved(tmp_path)
    data = bytearray(open(path, "rb").read())
    offset = data.index(np.arange(1000, dtype=np.float32)[500:502].tobytes())
    data[offset] ^= 0x40
    open(path, "wb").write(bytes(data))
    with pytest.raises(SerializationError, match="checksum mismatch|unreadable") as err:
        ndl.load(path)
    assert path in str(err.value)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.999])
def test_truncated_files_are_clear_errors(tmp_path, keep):
    path = _saved(tmp_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:int(len(data) * keep)])
    with pytest.raises(SerializationError) as err:
        ndl.load(path)
    assert path in str(err.value)


def test_foreign_and_missing_files(tmp_path):
    with pytest.raises(SerializationError, match="no such file"):
        ndl.load(str(tmp_path / "absent.ndl"))
    (tmp_path / "text.ndl").write_text("hello")
    with pytest.raises(SerializationError, match="not a needle file"):
        ndl.load(str(tmp_path / "text.ndl"))
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("readme.txt", "hi")
    with pytest.raises(SerializationError, match="no needle.json"):
        ndl.load(str(tmp_path / "other.zip"))


def _rewrite_index(path, change):
    with zipfile.ZipFile(path) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    index = json.loads(entries["needle.json"])
    change(index)
    entries["needle.json"] = json.dumps(index).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, payload in entries.items():
            zf.writestr(name, payload)


def test_newer_format_version_is_refused(tmp_path):
    path = _saved(tmp_path)
    _rewrite_index(path, lambda index: index.update(version=99))
    with pytest.raises(SerializationError, match="format version 99 is newer"):
        ndl.load(path)


def test_a_pickled_object_array_is_never_unpickled(tmp_path):
    # A crafted entry whose .npy holds a pickle; allow_pickle=False must refuse it.
    path = _saved(tmp_path)
    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    payload = buf.getvalue()
    with zipfile.ZipFile(path) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    index = json.loads(entries["needle.json"])
    name = index["root"]["__dict__"][0][1]["__array__"]
    entries[name] = payload
    import hashlib

    index["arrays"][name]["sha256"] = hashlib.sha256(payload).hexdigest()
    # the index describes the payload as it is, so the refusal must come from read_array
    index["arrays"][name].update(dtype="object", shape=[1])
    entries["needle.json"] = json.dumps(index).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for n, p in entries.items():
            zf.writestr(n, p)
    with pytest.raises(SerializationError, match="not a plain .npy"):
        ndl.load(path)


def test_errors_are_needle_errors():
    assert issubclass(SerializationError, NeedleError)


_WRITER = r"""
import sys, numpy as np
sys.path.insert(0, {repo!r})
import needle as ndl
i = 0
print("ready", flush=True)
while True:
    i += 1
    ndl.save({{"version": i, "data": np.full(2_000_000, i, dtype=np.float32)}}, {path!r})
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_during_save_leaves_a_loadable_file(tmp_path):
    path = str(tmp_path / "ckpt.ndl")
    ndl.save({"version": 0, "data": np.zeros(2_000_000, np.float32)}, path)
    for delay in (0.05, 0.2, 0.45):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER.format(repo=REPO, path=path)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        state = ndl.load(path)  # whatever version survived, it is whole
        assert (state["data"] == state["version"]).all()
    leftovers = [n for n in os.listdir(tmp_path) if n != "ckpt.ndl"]
    assert all(n.startswith(".ckpt.ndl.tmp.") for n in leftovers)
