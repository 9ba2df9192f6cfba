"""ndl.save / ndl.load against hostile files: bombs, shared references, planted symlinks,
special files, nesting bombs and malformed indexes. Each is refused with a
SerializationError that names the file, before memory is spent on it."""
from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import tracemalloc
import zipfile

import numpy as np
import pytest

import needle as ndl
from needle import serialization
from needle._core.errors import SerializationError


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=False)
    return buf.getvalue()


def _archive(path, root, arrays: dict[str, tuple[np.ndarray | None, bytes]],
             compression=zipfile.ZIP_STORED, extra: tuple = ()) -> str:
    """A needle file written by hand: ``arrays`` maps an entry name to (the array the index
    describes, the payload actually stored)."""
    meta = {name: {"dtype": str(a.dtype), "shape": list(a.shape),
                   "sha256": hashlib.sha256(payload).hexdigest()}
            for name, (a, payload) in arrays.items()}
    index = {"format": "needle", "version": 1, "root": root, "arrays": meta}
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, (_, payload) in arrays.items():
            zf.writestr(name, payload)
        zf.writestr("needle.json", json.dumps(index))
        for name, payload in extra:
            zf.writestr(name, payload)
    return str(path)


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except SerializationError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


# ---- decompression bombs --------------------------------------------------------------------
def test_a_deflated_bomb_is_refused_from_its_declared_size_before_inflating(tmp_path):
    bomb = b"\0" * (64 << 20)  # deflates to about 64 KiB
    small = np.zeros(10, np.float32)
    path = _archive(tmp_path / "bomb.ndl", {"__array__": "arrays/0.npy"},
                    {"arrays/0.npy": (small, bomb)}, compression=zipfile.ZIP_DEFLATED)
    assert os.path.getsize(path) < (1 << 20)
    with pytest.raises(SerializationError, match=r"arrays/0.npy declares 67108864 bytes, "
                       r"expected float32 \[10\]: 40 bytes") as err:
        ndl.load(path)
    assert path in str(err.value)
    assert _peak_bytes(lambda: ndl.load(path)) < (8 << 20)


def test_a_consistent_bomb_is_refused_by_the_byte_budget(tmp_path, monkeypatch):
    big = np.zeros(4 << 20, np.float32)  # 16 MiB of zeros, a few KiB deflated
    path = _archive(tmp_path / "bomb.ndl", {"__array__": "arrays/0.npy"},
                    {"arrays/0.npy": (big, _npy(big))}, compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(SerializationError, match="expected at most 1048576 .*max_bytes="):
        ndl.load(path, max_bytes=1 << 20)
    monkeypatch.setattr(serialization, "INFLATE_ALLOWANCE", 1 << 20)
    with pytest.raises(SerializationError, match=r"declare \d+ bytes in all, expected at "
                                                 r"most \d+ \(pass max_bytes="):
        ndl.load(path)
    assert _peak_bytes(lambda: ndl.load(path)) < (4 << 20)
    monkeypatch.undo()
    assert ndl.load(path).shape == (4 << 20,)  # within the default allowance it loads


def test_an_oversized_index_is_refused_before_it_is_read(tmp_path):
    path = _archive(tmp_path / "a.ndl", " " * (2 << 20), {},
                    compression=zipfile.ZIP_DEFLATED)  # 2 MiB of index in a few KiB
    with pytest.raises(SerializationError, match=r"needle.json declares 209\d{4} bytes, "
                                                 r"expected at most 1048576"):
        ndl.load(path, max_bytes=1 << 20)
    assert len(ndl.load(path)) == 2 << 20


@pytest.mark.parametrize("compression", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_compressions_that_inflate_without_bound_are_refused(tmp_path, compression):
    a = np.arange(4, dtype=np.float32)
    path = _archive(tmp_path / "c.ndl", {"__array__": "arrays/0.npy"},
                    {"arrays/0.npy": (a, _npy(a))}, compression=compression)
    with pytest.raises(SerializationError, match=f"compression {compression}, expected "
                                                 f"stored"):
        ndl.load(path)


def test_duplicate_entries_are_refused(tmp_path):
    a = np.arange(4, dtype=np.float32)
    other = _npy(np.arange(4, dtype=np.float32) + 1)
    with pytest.warns(UserWarning, match="Duplicate name"):
        path = _archive(tmp_path / "d.ndl", {"__array__": "arrays/0.npy"},
                        {"arrays/0.npy": (a, _npy(a))}, extra=(("arrays/0.npy", other),))
    with pytest.raises(SerializationError, match="entry arrays/0.npy appears twice"):
        ndl.load(path)


# ---- repeated references --------------------------------------------------------------------
def test_an_array_named_many_times_is_decoded_once_and_shared(tmp_path):
    a = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    node = {"__array__": "arrays/0.npy"}
    path = _archive(tmp_path / "r.ndl", [node] * 100, {"arrays/0.npy": (a, _npy(a))})
    back = ndl.load(path)
    assert len(back) == 100 and all(x is back[0] for x in back)
    np.testing.assert_array_equal(back[0], a)
    assert _peak_bytes(lambda: ndl.load(path)) < 8 * a.nbytes  # not 100 copies


def test_a_tensor_named_twice_comes_back_as_one_tensor(tmp_path):
    a = np.arange(6, dtype=np.float32)
    node = {"__tensor__": "arrays/0.npy", "requires_grad": True, "device": "cpu()"}
    path = _archive(tmp_path / "t.ndl", {"__tuple__": [node, node]},
                    {"arrays/0.npy": (a, _npy(a))})
    first, second = ndl.load(path)
    assert first is second and first.numpy().tolist() == a.tolist()


def test_one_entry_named_as_two_kinds_of_value_is_refused(tmp_path):
    a = np.arange(6, dtype=np.float32)
    path = _archive(tmp_path / "t.ndl", [{"__array__": "arrays/0.npy"},
                                         {"__tensor__": "arrays/0.npy"}],
                    {"arrays/0.npy": (a, _npy(a))})
    with pytest.raises(SerializationError, match="named by two different entries"):
        ndl.load(path)


# ---- writing through planted names ----------------------------------------------------------
def test_save_never_writes_through_a_symlink_at_the_old_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "ckpt.ndl"
    os.symlink(victim, tmp_path / f".ckpt.ndl.tmp.{os.getpid()}")
    ndl.save({"x": 1}, str(path))
    assert victim.read_text() == "precious"
    assert ndl.load(str(path)) == {"x": 1} and not os.path.islink(path)


def test_save_skips_a_planted_temporary_name_and_never_follows_it(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    names = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(serialization.secrets, "token_hex", lambda n: next(names))
    os.symlink(victim, tmp_path / f".ckpt.ndl.tmp.{'0' * 16}")
    ndl.save({"x": 2}, str(tmp_path / "ckpt.ndl"))
    assert victim.read_text() == "precious"
    assert ndl.load(str(tmp_path / "ckpt.ndl")) == {"x": 2}
    assert not os.path.exists(tmp_path / f".ckpt.ndl.tmp.{'1' * 16}")  # renamed, not left


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "ckpt.ndl")
    ndl.save({"x": 3}, str(tmp_path / "ckpt.ndl"))
    assert victim.read_text() == "precious" and not os.path.islink(tmp_path / "ckpt.ndl")


# ---- special files --------------------------------------------------------------------------
def test_load_of_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = str(tmp_path / "pipe.ndl")
    os.mkfifo(fifo)
    outcome = []

    def attempt():
        try:
            ndl.load(fifo)
        except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():  # release the blocked open before failing
        with open(fifo, "wb"):
            pass
        worker.join(timeout=10)
        pytest.fail("ndl.load blocked on a FIFO")
    assert isinstance(outcome[0], SerializationError)
    assert "not a regular file, expected a file written by ndl.save, got a FIFO" in str(
        outcome[0])


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_load_of_a_device_or_directory_is_refused(tmp_path):
    with pytest.raises(SerializationError, match="/dev/zero: not a regular file.*character"):
        ndl.load("/dev/zero")
    with pytest.raises(SerializationError, match="not a regular file.*got a directory"):
        ndl.load(str(tmp_path))


# ---- nesting bombs and malformed indexes ----------------------------------------------------
def _with_root(tmp_path, root_json: str) -> str:
    path = str(tmp_path / "n.ndl")
    index = '{"format": "needle", "version": 1, "arrays": {}, "root": ' + root_json + "}"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("needle.json", index)
    return path


@pytest.mark.parametrize("depth", [150, 100_000])
def test_nesting_bombs_are_serialization_errors(tmp_path, depth):
    path = _with_root(tmp_path, "[" * depth + "]" * depth)
    with pytest.raises(SerializationError, match="nests"):
        ndl.load(path)


def test_nesting_within_the_limit_loads(tmp_path):
    path = _with_root(tmp_path, "[" * 50 + "]" * 50)
    back = ndl.load(path)
    for _ in range(49):
        back = back[0]
    assert back == []


_A = '"arrays/0.npy"'
_MALFORMED = {
    "dict payload not a list": '{"__dict__": 5}',
    "dict pair with a list key": '{"__dict__": [[[1], 2]]}',
    "dict pair of three": '{"__dict__": [[1, 2, 3]]}',
    "tuple payload not a list": '{"__tuple__": 3}',
    "float payload a number": '{"__float__": 3}',
    "float payload a word": '{"__float__": "1e999999"}',
    "array name a list": '{"__array__": ["x"]}',
    "array name unknown": '{"__array__": "arrays/9.npy"}',
    "tensor device a number": '{"__tensor__": ' + _A + ', "device": 5}',
    "unknown tag": '{"__lambda__": 1}',
}


@pytest.mark.parametrize("root", list(_MALFORMED.values()), ids=list(_MALFORMED))
def test_malformed_entries_are_serialization_errors(tmp_path, root):
    a = np.arange(3, dtype=np.float32)
    path = str(tmp_path / "m.ndl")
    _archive(path, None, {"arrays/0.npy": (a, _npy(a))})
    with zipfile.ZipFile(path) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    index = json.loads(entries["needle.json"])
    index["root"] = json.loads(root)
    entries["needle.json"] = json.dumps(index).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, payload in entries.items():
            zf.writestr(name, payload)
    if root.startswith('{"__tensor__"'):  # a bad device name falls back to the default
        assert ndl.load(path).numpy().tolist() == [0.0, 1.0, 2.0]
        return
    with pytest.raises(SerializationError, match="load: .*m.ndl: "):
        ndl.load(path)


_BAD_TABLES = {
    "table a list": [],
    "entry a string": {"arrays/0.npy": "float32"},
    "shape of strings": {"arrays/0.npy": {"dtype": "float32", "shape": ["3"], "sha256": "0"}},
    "negative shape": {"arrays/0.npy": {"dtype": "float32", "shape": [-3], "sha256": "0"}},
    "unknown dtype": {"arrays/0.npy": {"dtype": "float99", "shape": [3], "sha256": "0"}},
    "no sha256": {"arrays/0.npy": {"dtype": "float32", "shape": [3]}},
}


@pytest.mark.parametrize("table", list(_BAD_TABLES.values()), ids=list(_BAD_TABLES))
def test_malformed_array_tables_are_serialization_errors(tmp_path, table):
    a = np.arange(3, dtype=np.float32)
    path = str(tmp_path / "m.ndl")
    _archive(path, {"__array__": "arrays/0.npy"}, {"arrays/0.npy": (a, _npy(a))})
    with zipfile.ZipFile(path) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    index = json.loads(entries["needle.json"])
    index["arrays"] = table
    entries["needle.json"] = json.dumps(index).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, payload in entries.items():
            zf.writestr(name, payload)
    with pytest.raises(SerializationError, match="load: .*m.ndl: "):
        ndl.load(path)
