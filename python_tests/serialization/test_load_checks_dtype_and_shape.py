"""ndl.load checks each array's dtype and its shape against the index, each on its own.

The files here are consistent except for one field: the payload is a valid ``.npy`` array
whose SHA-256 is the one the index records, so only the dtype check (or only the shape check)
stands between the file and a wrong tensor.
"""
from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

import needle as ndl
from needle._core.errors import SerializationError

INDEX = "needle.json"


def _rewrite_index(path, change) -> None:
    """Rewrite ``path`` with ``change(meta)`` applied to its one array's index entry."""
    with zipfile.ZipFile(path) as zf:
        entries = {name: zf.read(name) for name in zf.namelist()}
    index = json.loads(entries[INDEX])
    (meta,) = index["arrays"].values()
    change(meta)
    entries[INDEX] = json.dumps(index).encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, payload in entries.items():
            zf.writestr(name, payload)


def _saved(tmp_path, array):
    path = str(tmp_path / "one.ndl")
    ndl.save({"a": array}, path)
    np.testing.assert_array_equal(ndl.load(path)["a"], array)  # consistent as written
    return path


@pytest.mark.parametrize("claimed", ["float64", "int32", "float16"])
def test_a_dtype_that_differs_from_the_index_is_refused(tmp_path, claimed):
    path = _saved(tmp_path, np.arange(6, dtype=np.float32).reshape(2, 3))
    _rewrite_index(path, lambda meta: meta.update(dtype=claimed))
    with pytest.raises(SerializationError, match=f"expected {claimed} \\[2, 3\\], got "
                                                 f"float32 \\[2, 3\\]"):
        ndl.load(path)


@pytest.mark.parametrize("claimed", [[3, 2], [6], [2, 3, 1], [1, 2, 3]])
def test_a_shape_that_differs_from_the_index_is_refused(tmp_path, claimed):
    """Same dtype, same number of elements: only the shape check can tell."""
    path = _saved(tmp_path, np.arange(6, dtype=np.float32).reshape(2, 3))
    _rewrite_index(path, lambda meta: meta.update(shape=claimed))
    with pytest.raises(SerializationError, match="differs from its index"):
        ndl.load(path)


def test_the_checksum_alone_does_not_vouch_for_dtype_or_shape(tmp_path):
    """Both fields wrong at once, checksum intact: still refused (and the file is named)."""
    path = _saved(tmp_path, np.ones(4, dtype=np.int64))
    _rewrite_index(path, lambda meta: meta.update(dtype="float64", shape=[2, 2]))
    with pytest.raises(SerializationError, match="one.ndl"):
        ndl.load(path)
