"""MNIST and CIFAR-10 loaders against malformed files: every refusal is a NeedleError that
names the file, never a bare MemoryError, struct.error or OSError, and nothing is read or
allocated past what the file can hold."""
from __future__ import annotations

import gzip
import os
import struct
import tracemalloc

import pytest

from needle._core.errors import DataError, NeedleError, ShapeError
from needle.data.datasets.cifar10_dataset import CIFAR10Dataset
from needle.data.datasets.mnist_dataset import read_idx

IMAGES = 2051


def _idx(path, header: bytes, payload: bytes = b"", packed: bool = True) -> str:
    path = str(path) + (".gz" if packed else "")
    with (gzip.open if packed else open)(path, "wb") as f:
        f.write(header + payload)
    return path


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("header, what", [
    (b"", "expected 4 bytes of magic number, got 0"),
    (b"\x00\x00", "expected 4 bytes of magic number, got 2"),
    (struct.pack(">i", IMAGES) + b"\x00\x00\x00\x02", "expected 12 bytes of dimensions, got 4"),
])
def test_a_truncated_idx_header_is_a_data_error(tmp_path, header, what, packed):
    path = _idx(tmp_path / "images", header, packed=packed)
    with pytest.raises(DataError, match=f"truncated header in '{path}', {what}"):
        read_idx(path, IMAGES)


@pytest.mark.parametrize("packed", [True, False])
def test_declared_sizes_beyond_the_file_are_refused_before_reading(tmp_path, packed):
    header = struct.pack(">iiii", IMAGES, 2**31 - 1, 2**31 - 1, 2**31 - 1)
    path = _idx(tmp_path / "images", header, b"\x00" * 64, packed=packed)
    tracemalloc.start()
    with pytest.raises(DataError, match=r"declares dimensions \(2147483647, 2147483647, "
                                        r"2147483647\).*expected non-negative dimensions of "
                                        r"at most \d+ values"):
        read_idx(path, IMAGES)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < (16 << 20)


def test_negative_dimensions_are_refused(tmp_path):
    path = _idx(tmp_path / "images", struct.pack(">iiii", IMAGES, 2, -28, 28))
    with pytest.raises(DataError, match=r"declares dimensions \(2, -28, 28\)"):
        read_idx(path, IMAGES)


def test_a_corrupted_gzip_stream_is_a_data_error(tmp_path):
    path = str(tmp_path / "images.gz")
    good = gzip.compress(struct.pack(">iiii", IMAGES, 1, 2, 2) + b"\x01\x02\x03\x04")
    open(path, "wb").write(good[:12] + b"\xff" * 8 + good[20:])
    with pytest.raises(DataError, match=f"read_idx: '{path}' is unreadable"):
        read_idx(path, IMAGES)


def test_data_longer_or_shorter_than_declared_is_a_shape_error(tmp_path):
    header = struct.pack(">iiii", IMAGES, 1, 2, 2)
    with pytest.raises(ShapeError, match="overlong file .*expected 4 values, got more than 4"):
        read_idx(_idx(tmp_path / "long", header, b"\x01" * 5), IMAGES)
    with pytest.raises(ShapeError, match="truncated file .*expected 4 values, got 3"):
        read_idx(_idx(tmp_path / "short", header, b"\x01" * 3), IMAGES)
    exact = read_idx(_idx(tmp_path / "exact", header, b"\x01\x02\x03\x04"), IMAGES)
    assert exact.tolist() == [[[1, 2], [3, 4]]]


def test_an_idx_path_that_is_a_directory_or_fifo_is_refused(tmp_path):
    with pytest.raises(DataError, match="is not a regular file"):
        read_idx(str(tmp_path), IMAGES)
    os.mkfifo(tmp_path / "pipe.gz")
    with pytest.raises(DataError, match="is not a regular file"):
        read_idx(str(tmp_path / "pipe.gz"), IMAGES)


@pytest.mark.parametrize("opcode", [b"\x8e", b"B"])  # BINBYTES8 (protocol 4), BINBYTES
def test_a_cifar_pickle_declaring_a_huge_length_is_a_data_error(tmp_path, opcode):
    size = struct.pack("<Q", 2**50) if opcode == b"\x8e" else struct.pack("<I", 2**31 - 1)
    (tmp_path / "test_batch").write_bytes(b"\x80\x04" + opcode + size + b"abc")
    tracemalloc.start()
    with pytest.raises(DataError, match="is not a CIFAR-10 batch.*bytes") as err:
        CIFAR10Dataset(str(tmp_path), train=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "test_batch" in str(err.value) and peak < (16 << 20)


def test_a_cifar_batch_that_is_a_directory_is_a_data_error(tmp_path):
    (tmp_path / "test_batch").mkdir()
    with pytest.raises(DataError, match="is not a regular file"):
        CIFAR10Dataset(str(tmp_path), train=False)


def test_every_loader_error_is_a_needle_error():
    assert issubclass(DataError, NeedleError) and issubclass(ShapeError, NeedleError)
