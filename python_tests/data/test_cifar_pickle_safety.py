"""The CIFAR-10 loader reads the real batch format and never runs code named by a pickle."""
from __future__ import annotations

import io
import os
import pickle
import struct

import numpy as np
import pytest

from needle._core.errors import DataError, NeedleError
from needle.data import CIFAR10Dataset
from needle.data.datasets.safe_pickle import RestrictedUnpickler, load_cifar_batch


def _string(b: bytes) -> bytes:
    """A Python 2 ``str`` as cPickle writes it (SHORT_BINSTRING / BINSTRING)."""
    if len(b) < 256:
        return b"U" + bytes([len(b)]) + b
    return b"T" + struct.pack("<i", len(b)) + b


def _int(v: int) -> bytes:
    """A small non-negative int as cPickle writes it (BININT1 / BININT2 / BININT)."""
    if v < 256:
        return b"K" + bytes([v])
    return b"M" + struct.pack("<H", v) if v < 65536 else b"J" + struct.pack("<i", v)


def py2_batch(data: np.ndarray, labels, filenames, batch_label: bytes) -> bytes:
    """A batch as Python 2's cPickle wrote the files the CIFAR-10 site ships: protocol 2,
    str as SHORT_BINSTRING/BINSTRING, the array pickled by the NumPy of that time through
    numpy.core.multiarray._reconstruct, ndarray and dtype."""
    u1 = (b"cnumpy\ndtype\n" + _string(b"u1") + b"K\x00K\x01\x87R"   # dtype('u1', 0, 1)
          + b"(K\x03" + _string(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
    array = (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
             + b"K\x00\x85" + _string(b"b") + b"\x87R"  # _reconstruct(ndarray, (0,), 'b')
             + b"(K\x01" + _int(data.shape[0]) + _int(data.shape[1]) + b"\x86"
             + u1 + b"\x89" + _string(data.tobytes()) + b"tb")      # __setstate__
    items = (_string(b"batch_label") + _string(batch_label)
             + _string(b"labels") + b"](" + b"".join(_int(v) for v in labels) + b"e"
             + _string(b"data") + array
             + _string(b"filenames") + b"](" + b"".join(_string(f) for f in filenames) + b"e")
    return b"\x80\x02}(" + items + b"u."


@pytest.fixture
def real_format(tmp_path):
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=(6, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, 10, size=6)]
    names = [f"img_{i}.png".encode() for i in range(6)]
    raw = py2_batch(data, labels, names, b"testing batch 1 of 1")
    (tmp_path / "test_batch").write_bytes(raw)
    return tmp_path, raw, data, labels


def test_the_original_format_loads(real_format):
    folder, raw, data, labels = real_format
    # The assembled bytes are a genuine pickle of that content (plain pickle, trusted here).
    trusted = pickle.loads(raw, encoding="bytes")
    np.testing.assert_array_equal(trusted[b"data"], data)
    assert trusted[b"labels"] == labels
    restricted = RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    assert restricted.keys() == trusted.keys()
    assert restricted[b"filenames"] == trusted[b"filenames"]
    got_data, got_labels = load_cifar_batch(str(folder / "test_batch"))
    np.testing.assert_array_equal(got_data, data)
    np.testing.assert_array_equal(got_labels, labels)
    ds = CIFAR10Dataset(str(folder), train=False)
    assert len(ds) == 6 and ds[2][1] == labels[2]
    assert ds[2][0][1, 4, 5] == pytest.approx(data[2, 1024 + 4 * 32 + 5] / 255.0)


class _WritesMarker:
    """Unpickling this calls open(marker, "w"): a stand-in for any code a pickle can run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _payloads(marker: str) -> dict:
    evil = _WritesMarker(marker)
    data = np.zeros((1, 3072), np.uint8)
    return {
        "alone": pickle.dumps(evil, protocol=2),
        "inside_a_batch": pickle.dumps({b"data": data, b"labels": [evil]}),
        "os_system": b"cos\nsystem\n(S'touch " + marker.encode() + b"'\ntR.",
        "numpy_function": pickle.dumps({b"data": data, b"labels": [np.load]}),
    }


@pytest.mark.parametrize("kind", ["alone", "inside_a_batch", "os_system", "numpy_function"])
def test_a_pickle_that_runs_code_is_refused_unrun(tmp_path, kind):
    marker = str(tmp_path / "ran")
    (tmp_path / "test_batch").write_bytes(_payloads(marker)[kind])
    with pytest.raises(DataError, match=r"refused global (io\.open|builtins\.open|os\.system|"
                                        r"posix\.system|numpy\.load)") as info:
        CIFAR10Dataset(str(tmp_path), train=False)
    assert isinstance(info.value, NeedleError) and "test_batch" in str(info.value)
    assert not os.path.exists(marker), "the pickle ran code"


@pytest.mark.parametrize("content, what", [
    ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "uint8 array"),
    ({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, r"shape \(N, 3072\)"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, r"ints in \[0, 10\)"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "list of 2 ints"),
    ({b"labels": [0]}, "b'data' and b'labels'"),
    ([1, 2, 3], "expected a dict"),
])
def test_content_of_the_wrong_kind_is_refused(tmp_path, content, what):
    (tmp_path / "test_batch").write_bytes(pickle.dumps(content))
    with pytest.raises(DataError, match=what):
        CIFAR10Dataset(str(tmp_path), train=False)


def test_a_truncated_file_is_a_data_error(tmp_path, real_format):
    _, raw, _, _ = real_format
    (tmp_path / "test_batch").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match="not a CIFAR-10 batch"):
        CIFAR10Dataset(str(tmp_path), train=False)
