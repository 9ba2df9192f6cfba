"""The limits of docs/limits.md: which error a user gets, and what it says.

The property tests of test_overflow_safety.py cover the space of huge arguments in child
processes; these in-process tests pin the exact error classes and messages, and the CUDA
launcher's checks without a GPU or a compiler.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle._core.errors import (
    IndexOutOfRange,
    NeedleError,
    OutOfMemoryError,
    ShapeError,
    SizeLimitError,
)
from needle.backend_ndarray._cuda import launch as L

LIMIT = "4611686018427387904"  # 2**62, as the messages print it


def test_a_buffer_past_the_limit_names_op_shape_and_limit(device):
    with pytest.raises(SizeLimitError, match=rf"^empty: array too large, expected at most "
                                             rf"{LIMIT} bytes .*\(2147483648, 2147483648\)"):
        nd.empty((2**31, 2**31), device=device)
    with pytest.raises(SizeLimitError, match=r"^zeros: .* of float64 = 9223372036854775808 b"):
        device.zeros(2**60, dtype="float64")
    with pytest.raises(SizeLimitError, match=r"^randn: "):
        device.randn(2**31, 2**31)
    assert issubclass(SizeLimitError, ShapeError) and issubclass(SizeLimitError, ValueError)


def test_a_buffer_no_machine_has_is_an_out_of_memory_needle_error(device):
    """2**52 bytes is within the limit but beyond any address space: refused, typed."""
    with pytest.raises(OutOfMemoryError, match=r"^empty: out of memory on .*"
                                               r"\(1125899906842624,\) of float32") as info:
        nd.empty((2**50,), device=device)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, NeedleError)
    view = nd.array([1.0], device=device).broadcast_to((2**50,))
    with pytest.raises(OutOfMemoryError, match=r"^sum: out of memory"):
        view.sum()
    with pytest.raises(OutOfMemoryError, match=r"^numpy: out of memory on the host"):
        view.numpy()


def test_bad_shapes_and_views_name_the_op(device):
    a = nd.array(np.arange(12.0), device=device)
    with pytest.raises(ShapeError, match=r"^make: negative dimension, .* got \(2, -1\)"):
        nd.NDArray.make((2, -1), device=device)
    with pytest.raises(ShapeError, match=r"^make: dimensions must be integers"):
        nd.NDArray.make((2.0, 3), device=device)
    with pytest.raises(IndexOutOfRange, match=r"^as_strided: view reaches outside its buffer, "
                                              r"expected element offsets in \[0, 12\), "
                                              r"got \[-2, 0\]"):
        a.as_strided((3,), (-1,))
    with pytest.raises(IndexOutOfRange, match=r"^make: stride or offset out of range"):
        nd.NDArray.make((3,), strides=(1,), device=device, handle=a._handle, offset=2**63)
    with pytest.raises(SizeLimitError, match=r"^broadcast_to: view too large"):
        a.broadcast_to((2**62, 12))
    with pytest.raises(SizeLimitError, match=r"^broadcast_to: dimension too large"):
        a.broadcast_to((0, 2**63, 12))
    with pytest.raises(ShapeError, match=r"^broadcast_to: negative dimension"):
        nd.array([1.0], device=device).broadcast_to((-3,))
    with pytest.raises(SizeLimitError, match=r"^reshape: dimension too large"):
        nd.array(np.zeros(0), device=device).reshape((0, 2**63))
    assert a.as_strided((0, 5), (2**62, -2**62)).shape == (0, 5)  # empty: any strides


def test_numpy_refusing_an_empty_shape_is_a_size_limit_error(device):
    empty = nd.array([1.0], device=device).broadcast_to((0, 2**61))
    assert empty.size == 0
    with pytest.raises(SizeLimitError, match=r"^numpy: NumPy cannot hold shape"):
        empty.numpy()


def test_an_empty_product_reads_no_operand(device):
    """m or p == 0: nothing is computed, so a 2**50-long inner dimension costs nothing."""
    a = nd.array([[1.0]], device=device).broadcast_to((0, 2**50))
    b = nd.array([[1.0]], device=device).broadcast_to((2**50, 3))
    assert (a @ b).shape == (0, 3)


def test_cpu_entry_points_check_again():
    """The C++ module refuses what the Python layer would have refused, with needle errors."""
    cpu = pytest.importorskip("needle.backend_ndarray.ndarray_backend_cpu")
    a, out = cpu.Array(12), cpu.Array(12)
    with pytest.raises(SizeLimitError, match=rf"^Array: buffer too large, expected at most "
                                             rf"{LIMIT} bytes"):
        cpu.Array(2**61)  # 2**63 bytes: would wrap to a tiny block
    with pytest.raises(OutOfMemoryError, match=r"^Array: out of memory"):
        cpu.Array(2**50)
    with pytest.raises(IndexOutOfRange, match=r"^to_numpy: view reaches outside its buffer, "
                                              r".*got an offset beyond int64"):
        cpu.to_numpy(a, (5,), (2**62,), 0)
    with pytest.raises(IndexOutOfRange, match=r"^compact: offset must be >= 0"):
        cpu.compact(a, out, (3,), (1,), -1)
    with pytest.raises(SizeLimitError, match=r"^compact: view too large"):
        cpu.compact(a, out, (2**40, 2**40), (0, 0), 0)
    with pytest.raises(SizeLimitError, match=r"^to_numpy: dimension too large"):
        cpu.to_numpy(a, (0, 2**62 + 1), (1, 1), 0)
    with pytest.raises(IndexOutOfRange, match=r"^matmul_strided: a reaches outside its buffer"):
        cpu.matmul_strided(a, a, out, 9, 2, 1, 0, 2**61, 1, 0, 1, 1)
    with pytest.raises(SizeLimitError, match=r"^matmul: a too large"):
        cpu.matmul(a, a, out, 2**40, 2**40, 1)
    with pytest.raises(SizeLimitError, match=r"^reduce_sum: a too large"):
        cpu.reduce_sum(a, cpu.Array(3), 2**62)
    with pytest.raises(ShapeError, match=r"^reduce_sum: a too small"):
        cpu.reduce_sum(a, cpu.Array(3), 5)
    with pytest.raises(ValueError, match=r"^allocate: request too large"):
        cpu._allocator_bench(2**64 - 1, 1)  # rounding up to a block would wrap to 0


class _Buffer:
    """Stands in for a CUDA Array in the launcher's checks (no GPU, no compiler)."""

    def __init__(self, size: int, dtype: str = "float32"):
        self.size, self.dtype = size, dtype

    def ptr(self) -> int:
        return 4096


def test_cuda_launcher_checks_views_without_a_gpu():
    compact = L.KernelSpec("strided.cu", "compact", ("a", "a", "view"), grid="indexed",
                           view_of=0)
    src, out = _Buffer(12), _Buffer(12)
    name, _, _, args = L.prepare(compact, "float32", 6, (src, out, ((2, 3), (1, 2), 5)))
    assert name == "compact_f32" and int(args[2]["size"][0]) == 6
    with pytest.raises(IndexOutOfRange, match=r"^compact: view reaches outside its buffer"):
        L.prepare(compact, "float32", 9, (src, out, ((9,), (2**61,), 0)))
    with pytest.raises(IndexOutOfRange, match=r"^compact: view reaches outside"):
        L.prepare(compact, "float32", 3, (src, out, ((3,), (-1,), 1)))
    with pytest.raises(ShapeError, match=r"^compact: compact buffer too small"):
        L.prepare(compact, "float32", 12, (src, _Buffer(4), ((12,), (1,), 0)))
    with pytest.raises(ShapeError, match=r"^compact: launch size differs from the view"):
        L.prepare(compact, "float32", 2, (src, out, ((3,), (1,), 0)))
    with pytest.raises(SizeLimitError, match=r"^compact: view too large"):
        L.prepare(compact, "float32", 1, (src, out, ((2**40, 2**40), (0, 0), 0)))
    with pytest.raises(SizeLimitError, match=r"^cuda Array: buffer too large"):
        L.check_buffer_bytes("cuda Array", 2**61, 4)
    assert L.check_buffer_bytes("cuda Array", 2**60, 4) == 2**62
