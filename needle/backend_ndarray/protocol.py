"""The backend module protocol as :class:`typing.Protocol` classes (docs/backend_protocol.md).

A backend is a *module* (``ndarray_backend_numpy``, the compiled ``ndarray_backend_cpu``,
``ndarray_backend_cuda``) that :class:`~needle.backend_ndarray.NDArray` calls with flat
buffers; :class:`Backend` lists what every one of them exports, :class:`BackendArray` what its
``Array`` buffers provide. mypy checks the Python backends against :class:`Backend` (the
assignments at the bottom of this file); ``python_tests/backend_ndarray/test_backend_protocol.py``
checks every backend, the compiled one included, by calling each entry point.

Shapes, strides and offsets are in elements (strides signed); every array argument except
``compact``'s / ``ewise_setitem``'s strided side is compact. A kernel's element type is the
dtype of its ``out``; all array inputs share it, except ``ewise_cast``. Scalars arrive as
Python floats. Optional entry points (``matmul_tiled``, ``matmul_strided``, the fused
convolution and LSTM kernels) are listed in :data:`OPTIONAL`; callers test for them with
``hasattr``.

Example:
    >>> from needle.backend_ndarray import ndarray_backend_numpy as backend
    >>> from needle.backend_ndarray.protocol import Backend, missing
    >>> isinstance(backend, Backend), missing(backend)
    (True, [])
    >>> a = backend.Array(3); backend.fill(a, 2.0); out = backend.Array(3)
    >>> backend.scalar_rsub(a, 5.0, out); backend.to_numpy(out, (3,), (1,), 0).tolist()
    [3.0, 3.0, 3.0]
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import numpy as np

__all__ = ["BackendArray", "Backend", "OPTIONAL", "missing"]

Shape = Sequence[int]


class BackendArray(Protocol):
    """A flat, uninitialised buffer: ``Array(size, dtype="float32")``."""

    @property
    def size(self) -> int: ...  # elements, read-only
    @property
    def dtype(self) -> str: ...  # "float32", "float64" or "float16"
    @property
    def itemsize(self) -> int: ...  # bytes per element
    def ptr(self) -> int: ...  # the address of element 0 (256-byte aligned)


A = TypeVar("A", bound=BackendArray)


@runtime_checkable
class Backend(Protocol[A]):
    """The entry points every array backend module exports, with the same meaning; ``A`` is
    the backend's own buffer type (its kernels take only their own ``Array``)."""

    __device_name__: str  # "numpy", "cpu", "cuda"
    __tile_size__: int  # tile edge of matmul_tiled's layout

    def Array(self, size: int, dtype: str = "float32") -> A: ...  # noqa: N802 - the course name

    # transfers and strided views
    def to_numpy(self, a: A, shape: Shape, strides: Shape, offset: int) -> np.ndarray: ...
    def from_numpy(self, a: np.ndarray, out: A) -> None: ...
    def fill(self, out: A, val: float) -> None: ...
    def compact(self, a: A, out: A, shape: Shape, strides: Shape, offset: int) -> None: ...
    def ewise_setitem(self, a: A, out: A, shape: Shape, strides: Shape,
                      offset: int) -> None: ...
    def scalar_setitem(self, size: int, val: float, out: A, shape: Shape, strides: Shape,
                       offset: int) -> None: ...

    # elementwise on compact arrays of one size: out = a <op> b
    def ewise_add(self, a: A, b: A, out: A) -> None: ...
    def ewise_sub(self, a: A, b: A, out: A) -> None: ...
    def ewise_mul(self, a: A, b: A, out: A) -> None: ...
    def ewise_div(self, a: A, b: A, out: A) -> None: ...
    def ewise_maximum(self, a: A, b: A, out: A) -> None: ...
    def ewise_minimum(self, a: A, b: A, out: A) -> None: ...
    def ewise_power(self, a: A, b: A, out: A) -> None: ...
    def ewise_eq(self, a: A, b: A, out: A) -> None: ...  # 1.0 / 0.0
    def ewise_ge(self, a: A, b: A, out: A) -> None: ...

    # with a scalar: out = a <op> val (rsub: val - a, rdiv: val / a, rpower: val ** a)
    def scalar_add(self, a: A, val: float, out: A) -> None: ...
    def scalar_sub(self, a: A, val: float, out: A) -> None: ...
    def scalar_rsub(self, a: A, val: float, out: A) -> None: ...
    def scalar_mul(self, a: A, val: float, out: A) -> None: ...
    def scalar_div(self, a: A, val: float, out: A) -> None: ...
    def scalar_rdiv(self, a: A, val: float, out: A) -> None: ...
    def scalar_power(self, a: A, val: float, out: A) -> None: ...
    def scalar_rpower(self, a: A, val: float, out: A) -> None: ...
    def scalar_maximum(self, a: A, val: float, out: A) -> None: ...
    def scalar_minimum(self, a: A, val: float, out: A) -> None: ...
    def scalar_eq(self, a: A, val: float, out: A) -> None: ...
    def scalar_ge(self, a: A, val: float, out: A) -> None: ...
    def scalar_le(self, a: A, val: float, out: A) -> None: ...

    # unary, and the one dtype-changing copy
    def ewise_neg(self, a: A, out: A) -> None: ...
    def ewise_log(self, a: A, out: A) -> None: ...
    def ewise_exp(self, a: A, out: A) -> None: ...
    def ewise_tanh(self, a: A, out: A) -> None: ...
    def ewise_sqrt(self, a: A, out: A) -> None: ...
    def ewise_abs(self, a: A, out: A) -> None: ...
    def ewise_sign(self, a: A, out: A) -> None: ...
    def ewise_sigmoid(self, a: A, out: A) -> None: ...
    def ewise_cast(self, a: A, out: A) -> None: ...

    # out (m x p) = a (m x n) @ b (n x p), row-major, overwritten
    def matmul(self, a: A, b: A, out: A, m: int, n: int, p: int) -> None: ...

    # reduce each contiguous block of reduce_size elements of a into one element of out
    def reduce_sum(self, a: A, out: A, reduce_size: int) -> None: ...
    def reduce_max(self, a: A, out: A, reduce_size: int) -> None: ...
    def reduce_min(self, a: A, out: A, reduce_size: int) -> None: ...

    def set_num_threads(self, n: int) -> None: ...
    def get_num_threads(self) -> int: ...


OPTIONAL = ("new_array", "matmul_tiled", "matmul_strided", "conv2d_forward", "conv2d_forward_bias",
            "conv2d_weight_grad", "conv2d_input_grad", "conv2d_workspace", "lstm_cell_forward",
            "lstm_cell_backward",
            "batch_norm_forward", "batch_norm_backward", "softmax_xent_forward",
            "softmax_xent_backward", "embedding_forward", "embedding_backward",
            "ewise_program", "ewise_program_many", "mt19937_uniform", "ewise_add_rows",
            "reduce_sum_leading", "reduce_max_leading", "reduce_min_leading")


def missing(module: object) -> list[str]:
    """The names of :class:`Backend` that ``module`` lacks or exports as a non-callable."""
    names = [n for n in _members() if not hasattr(module, n)]
    for name in _members():
        if name not in ("__device_name__", "__tile_size__") and hasattr(module, name) \
                and not callable(getattr(module, name)):
            names.append(name)
    return names


def _members() -> list[str]:
    own = set(Backend.__dict__) | set(Backend.__annotations__)
    return sorted(n for n in own if not n.startswith("_") or n in ("__device_name__",
                                                                     "__tile_size__"))


if TYPE_CHECKING:  # mypy: the Python backends conform (the compiled one has no stubs)
    from . import ndarray_backend_cuda, ndarray_backend_numpy

    _numpy_backend: Backend[ndarray_backend_numpy.Array] = ndarray_backend_numpy
    _cuda_backend: Backend[ndarray_backend_cuda.Array] = ndarray_backend_cuda
