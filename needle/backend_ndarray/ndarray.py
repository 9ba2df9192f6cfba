"""The strided ``NDArray``: shape, strides and offset over a flat backend buffer.

View operations (reshape of a compact array, permute, broadcast_to, getitem) share the
buffer; everything else writes a new compact array through the device's kernels. Public
methods validate their input and raise :mod:`needle._core.errors` subclasses; the backend
kernels assume valid input (docs/backend_protocol.md).

Example:
    >>> import numpy as np
    >>> from needle.backend_ndarray import NDArray, cpu_numpy
    >>> a = NDArray(np.arange(6).reshape(2, 3), device=cpu_numpy())
    >>> b = a.permute((1, 0))
    >>> b.shape, b.strides, b._handle.ptr() == a._handle.ptr()
    ((3, 2), (1, 3), True)
"""
from __future__ import annotations

import builtins
import math
import operator

import numpy as np

from .._core.dtypes import LOW_PRECISION, canonical_dtype, numpy_dtype
from .._core.errors import AxisError, DTypeError, OutOfMemoryError, ShapeError
from .._core.versions import note_write as _note_write
from .devices import (
    BackendDevice,
    all_devices,
    check_enabled,
    cpu,
    cpu_numpy,
    cuda,
    default_device,
    device_by_name,
)
from .ndarray_checks import (
    check_pair,
    check_same_shape,
    index_view,
    is_scalar,
    normalize_axes,
    numpy_data,
    resolve_reshape,
    scalar_value,
)
from .ndarray_limits import (
    FAST_ALLOC_ELEMENTS,
    check_alloc,
    check_dims,
    check_view_size,
    checked_view,
    host_copy,
    out_of_memory,
)
from .ndarray_tiled import matmul_tiled, tiled_ok

__all__ = ["NDArray", "BackendDevice", "cpu", "cpu_numpy", "cuda", "default_device",
           "all_devices", "device_by_name", "prod"]

prod = math.prod

# When True, ``a @ b`` takes the course's tiled path (matmul_tiled) whenever the shapes allow.
# Off by default because the backends' plain ``matmul`` is the fast packed kernel.
USE_TILED_MATMUL = False


# shape -> (element count, compact strides): every kernel output needs both, and a model uses
# few shapes, so a bounded cache turns two Python loops per allocation into one dict lookup
_LAYOUTS: dict[tuple, tuple[int, tuple]] = {}
_MAX_LAYOUTS = 4096


# Layout facts kept by key, as _LAYOUTS keeps compact strides: a model has few layouts, and
# working them out again costs a generator frame per dimension on every call. Bounded.
_MAX_KEPT_LAYOUTS = 4096
_DENSE_LAYOUTS: dict[tuple, bool] = {}  # (shape, strides) -> _dense_layout(shape, strides)
_PERMUTATIONS: dict[tuple, operator.itemgetter] = {}  # valid axes -> itemgetter(*axes)


def _dense_layout(shape: tuple, strides: tuple) -> bool:
    """True when the dims of size > 1, ordered by stride, have compact strides (see
    :meth:`NDArray.is_dense`)."""
    expect = 1
    for stride, n in sorted((s, n) for n, s in zip(shape, strides, strict=True) if n != 1):
        if stride != expect:
            return False
        expect *= n
    return True


def _layout(shape: tuple) -> tuple[int, tuple]:
    layout = _LAYOUTS.get(shape)
    if layout is None:
        strides, stride = [], 1
        for dim in reversed(shape):
            strides.append(stride)
            stride *= dim
        layout = (stride, tuple(reversed(strides)))
        if len(_LAYOUTS) < _MAX_LAYOUTS:
            _LAYOUTS[shape] = layout
    return layout


def _compact_strides(shape: tuple) -> tuple:
    return _layout(shape)[1]


class NDArray:
    """An n-dimensional strided view of a flat buffer on a device.

    Args:
        other: an NDArray (copied, moved to ``device``), a NumPy array, or anything
            ``np.array`` accepts.
        device: target device (default: :func:`default_device`).
        dtype: ``"float32"`` (default), ``"float64"``, ``"float16"`` or ``"bfloat16"``; other
            dtypes (bool, ints) are coerced to float32 as the course does. ``None`` makes
            float32, except from a NumPy ``bfloat16`` array, whose dtype is kept.

    Example:
        >>> from needle.backend_ndarray import NDArray, cpu_numpy
        >>> NDArray([[1, 2], [3, 4]], device=cpu_numpy()).sum(axis=1).numpy().tolist()
        [3.0, 7.0]
    """

    __array_priority__ = 1000
    # Slots, not a __dict__: every kernel makes one NDArray, and slot stores and loads are
    # the cheaper ones on that path. ``_compact`` caches is_compact(): True/False once known,
    # None = not yet computed (every constructor sets it).
    __slots__ = ("_shape", "_strides", "_offset", "_device", "_handle", "_compact",
                 "__weakref__")

    def __init__(self, other, device=None, dtype=None):
        if isinstance(other, NDArray):
            device = other.device if device is None else device
            dtype = other.dtype if dtype is None else dtype
            if device == other.device and canonical_dtype(dtype) == other.dtype:
                self._init(other._copy())
                return
            other = other.numpy()
        device = default_device() if device is None else check_enabled(device, "NDArray")
        if dtype is None and getattr(getattr(other, "dtype", None), "name", None) == "bfloat16":
            dtype = "bfloat16"  # only asked for on purpose (ml_dtypes): kept, not coerced
        dtype = canonical_dtype(dtype, "NDArray")
        # np.asarray, not ascontiguousarray: the latter turns a 0-d array into shape (1,).
        src = numpy_data(other, numpy_dtype(dtype), "NDArray")
        array = _alloc(src.shape, device, dtype, "NDArray")
        device.from_numpy(src, array._handle)
        self._init(array)

    def _init(self, other: "NDArray") -> None:
        self._shape = other._shape
        self._strides = other._strides
        self._offset = other._offset
        self._device = other._device
        self._handle = other._handle
        self._compact = other._compact

    @staticmethod
    def compact_strides(shape) -> tuple:
        """Row-major strides (in elements) for ``shape``."""
        return _compact_strides(tuple(shape))

    @staticmethod
    def make(shape, strides=None, device=None, handle=None, offset=0, dtype="float32"):
        """A new NDArray; allocates (uninitialised) memory when ``handle`` is None.

        Raises:
            ShapeError: a negative or non-integer dimension or stride.
            SizeLimitError: a buffer or view beyond the limits of docs/limits.md.
            IndexOutOfRange: ``strides``/``offset`` reaching outside the buffer.
        """
        device = device if device is not None else default_device()
        if handle is None or strides is None:
            shape = check_dims("make", shape)
            if handle is None and strides is None and offset == 0:
                return _alloc(shape, device, dtype, "make")
            if handle is None:
                handle = _alloc(shape, device, dtype, "make")._handle
            strides = _compact_strides(shape) if strides is None else strides
        shape, strides = checked_view("make", shape, strides, offset, handle.size)
        return _view(shape, strides, operator.index(offset), device, handle)

    # ---- properties -------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def strides(self) -> tuple:
        return self._strides

    @property
    def device(self) -> BackendDevice:
        return self._device

    @property
    def dtype(self) -> str:
        return self._handle.dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def nbytes(self) -> int:
        return self.size * self._handle.itemsize

    @property
    def flat(self) -> "NDArray":
        """A 1-D view sharing memory (the array must be compact)."""
        return self.reshape((self.size,))

    def __repr__(self) -> str:
        return f"NDArray({self.numpy()}, device={self.device}, dtype={self.dtype})"

    def __str__(self) -> str:
        return str(self.numpy())

    # ---- conversion and layout ----------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A NumPy copy of the (possibly strided) array."""
        return host_copy(self._device, self._handle, self._shape, self._strides, self._offset)

    def fill(self, value) -> None:
        """Set every element of this (possibly strided) view to ``value``.

        An in-place write: bumps the version of the buffer (see ``needle._core.versions``).
        """
        self._fill(value)
        _note_write(self._handle)

    def _fill(self, value) -> None:
        # fill without a version bump, for arrays only their creator can see yet
        if self.is_compact():
            self._device.fill(self._handle, float(value))
        else:
            self._device.scalar_setitem(self.size, float(value), self._handle, self._shape,
                                        self._strides, self._offset)

    def _add_in_place(self, other: "NDArray") -> None:
        # self += other into self's buffer, for a compact array only its creator can see yet
        # (a fused op's result: no version bump, and nobody else reads the old values).
        # Elementwise kernels read and write each element at one index, so the output may be
        # the first operand. ``other`` of any layout (a broadcast bias is compacted first).
        if other._device is not self._device or other._handle.dtype != self._handle.dtype:
            check_pair("add", self, other)
        check_same_shape("add", self, other)
        if not (self._compact or self.is_compact()):
            raise ShapeError(f"add: expected a compact array to add into in place, got a "
                             f"view of shape {self._shape} with strides {self._strides}")
        if other._compact or other.is_compact():
            self._device.ewise_add(self._handle, other._handle, self._handle)
            return
        shape, strides = self._shape, other._strides
        add_rows = getattr(self._device.mod, "ewise_add_rows", None)
        if (add_rows is not None and len(shape) >= 2 and other._offset == 0
                and strides[-1] == 1 and not any(strides[:-1])):
            # a row broadcast to every row (a linear layer's bias): added from the row itself
            # instead of from a compacted copy of the broadcast (batch x features elements)
            n = shape[-1]
            add_rows(self._handle, other._handle, self._handle, self.size // n if n else 0, n)
            return
        self._device.ewise_add(self._handle, other._copy("add")._handle, self._handle)

    def _add_row_in_place(self, row: "NDArray") -> None:
        # self += row added to every row of self's last axis, into self's buffer: a compact
        # array only its creator can see yet (a linear layer's product). ``row`` holds
        # ``shape[-1]`` values in any shape ((n,), (1, n)); read in place where the backend
        # has ewise_add_rows, else through the broadcast.
        if row._device is not self._device or row._handle.dtype != self._handle.dtype:
            check_pair("add", self, row)
        shape = self._shape
        n = shape[-1] if shape else 1
        if row.size != n or not shape or row._shape[-1:] != (n,) or len(row._shape) > len(shape):
            raise ShapeError(f"add: expected a row of {n} values to add to every row of "
                             f"{shape}, got shape {row._shape}")
        add_rows = getattr(self._device.mod, "ewise_add_rows", None)
        if (add_rows is None or not (self._compact or self.is_compact())
                or not (row._compact or row.is_compact())):
            self._add_in_place(row.reshape((1,) * (len(shape) - 1) + (n,)).broadcast_to(shape))
            return
        add_rows(self._handle, row._handle, self._handle, self.size // n if n else 0, n)

    def to(self, device) -> "NDArray":
        """This array on ``device`` (self when already there)."""
        if device == self._device:
            return self
        return NDArray(self.numpy(), device=device, dtype=self.dtype)

    def astype(self, dtype) -> "NDArray":
        """A compact copy converted to ``dtype`` (self when the dtype already matches)."""
        dtype = canonical_dtype(dtype, "astype")
        if dtype == self.dtype:
            return self
        src = self.compact()
        out = _alloc(self._shape, self._device, dtype, "astype")
        self._device.ewise_cast(src._handle, out._handle)
        return out

    def is_compact(self) -> bool:
        compact = self._compact
        if compact is None:
            size, strides = _LAYOUTS.get(self._shape) or _layout(self._shape)
            compact = self._compact = (self._offset == 0 and self._strides == strides
                                       and size == self._handle.size)
        return compact

    def is_dense(self) -> bool:
        """True for a layout that is a permutation of a compact one over the whole buffer
        (offset 0, each element once), e.g. the NCHW view of an NHWC convolution output.
        Elementwise ops run on such a buffer as it lies and keep its layout, instead of
        copying it into row-major order first.

        Example:
            >>> from needle.backend_ndarray import NDArray, cpu_numpy
            >>> a = NDArray([[1.0, 2.0], [3.0, 4.0]], device=cpu_numpy())
            >>> a.permute((1, 0)).is_dense(), a[0:1].is_dense()
            (True, False)
        """
        if self._offset != 0 or math.prod(self._shape) != self._handle.size:
            return False
        key = (self._shape, self._strides)
        dense = _DENSE_LAYOUTS.get(key)
        if dense is None:
            dense = _dense_layout(self._shape, self._strides)
            if len(_DENSE_LAYOUTS) >= _MAX_KEPT_LAYOUTS:
                _DENSE_LAYOUTS.clear()
            _DENSE_LAYOUTS[key] = dense
        return dense

    def _memory_order(self) -> tuple:
        """Axes from the largest stride to the smallest: permuting by them lists a dense
        array's elements in buffer order."""
        return tuple(sorted(range(len(self._shape)), key=lambda d: -self._strides[d]))

    def _in_layout(self, like: "NDArray", op: str) -> "NDArray":
        """This array's values in ``like``'s buffer order (``like`` dense): self when the
        strides already agree, else a copy of the permuted view."""
        if self._strides == like._strides and self._offset == 0 and self.is_dense():
            return self
        return self.permute(like._memory_order())._copy(op)

    def swap_last_axes(self) -> "NDArray":
        """A view with the last two axes swapped (a matrix transpose per batch element).

        Example:
            >>> from needle.backend_ndarray import NDArray, cpu_numpy
            >>> NDArray([[1.0, 2.0]], device=cpu_numpy()).swap_last_axes().numpy().tolist()
            [[1.0], [2.0]]
        """
        shape, strides = self._shape, self._strides
        if len(shape) < 2:
            raise ShapeError(f"swap_last_axes: expected at least 2 dims, got shape {shape}")
        # a permutation of a valid view is valid: no bounds check needed
        return _view(shape[:-2] + (shape[-1], shape[-2]), strides[:-2] + (strides[-1],
                                                                          strides[-2]),
                     self._offset, self._device, self._handle)

    def compact(self) -> "NDArray":
        """Self if compact, else a compact copy."""
        if self._compact or self.is_compact():
            return self
        return self._copy()

    def _copy(self, op: str = "compact") -> "NDArray":
        out = _alloc(self._shape, self._device, self._handle.dtype, op)
        if out.size:
            self._device.compact(self._handle, out._handle, self._shape, self._strides,
                                 self._offset)
        return out

    def as_strided(self, shape, strides) -> "NDArray":
        """A view with the given shape and strides (elements) on the same buffer.

        Raises:
            ShapeError: ``shape`` and ``strides`` differ in length, or a negative dimension.
            SizeLimitError: more than 2**62 elements.
            IndexOutOfRange: an element of the view would lie outside the buffer.
        """
        shape, strides = checked_view("as_strided", shape, strides, self._offset,
                                      self._handle.size)
        return _view(shape, strides, self._offset, self._device, self._handle)

    def reshape(self, new_shape) -> "NDArray":
        """A view with ``new_shape`` (one dim may be -1); non-compact arrays are copied first."""
        if type(new_shape) is tuple and new_shape == self._shape:  # nothing to check or make
            return self  # (the ops' gradients reshape to the shape they have ~30 times a step)
        new_shape = resolve_reshape(self._shape, new_shape)
        if new_shape == self._shape:
            return self
        base = self.compact()
        return _view(new_shape, _compact_strides(new_shape), base._offset, self._device,
                     base._handle)

    def permute(self, new_axes) -> "NDArray":
        """A view with axes reordered (``new_axes`` is a permutation of ``range(ndim)``)."""
        ndim = len(self._shape)
        axes = tuple(new_axes)
        take = _PERMUTATIONS.get(axes)  # a permutation of non-negative ints seen before
        if take is not None and len(axes) == ndim:
            return _view(take(self._shape), take(self._strides), self._offset, self._device,
                         self._handle)
        if sorted(axes) != list(range(ndim)):  # the common case (non-negative ints) checked first
            axes = tuple(int(a) % builtins.max(ndim, 1) if isinstance(a, (int, np.integer))
                         else a for a in axes)
        if sorted(axes) != list(range(ndim)):
            raise AxisError(f"permute: expected a permutation of {tuple(range(self.ndim))}, "
                            f"got {tuple(new_axes)}")
        if ndim > 1 and axes == tuple(new_axes) and len(_PERMUTATIONS) < _MAX_KEPT_LAYOUTS:
            _PERMUTATIONS[axes] = operator.itemgetter(*axes)  # (ndim 1: a bare item)
        return _view(tuple(self._shape[a] for a in axes),
                     tuple(self._strides[a] for a in axes), self._offset, self._device,
                     self._handle)

    def broadcast_to(self, new_shape) -> "NDArray":
        """A view broadcast to ``new_shape`` (NumPy rules; stride 0 on broadcast dims).

        Raises:
            ShapeError: shapes that do not broadcast, or a negative dimension.
            SizeLimitError: a view of more than 2**62 elements.
        """
        new_shape = check_dims("broadcast_to", new_shape)
        lead = len(new_shape) - self.ndim
        if lead < 0:
            raise ShapeError(f"broadcast_to: cannot drop dimensions, expected at least "
                             f"{self.ndim} dims, got {new_shape} for {self._shape}")
        strides = [0] * lead
        for dim, (old, new) in enumerate(zip(self._shape, new_shape[lead:], strict=True)):
            if old == new:
                strides.append(self._strides[dim])
            elif old == 1:
                strides.append(0)
            else:
                raise ShapeError(f"broadcast_to: incompatible shapes, expected dims equal or 1, "
                                 f"got {self._shape} -> {new_shape}")
        check_view_size("broadcast_to", new_shape)
        return _view(new_shape, tuple(strides), self._offset, self._device, self._handle)

    # ---- indexing ---------------------------------------------------------------------
    def process_slice(self, sl, dim: int) -> slice:
        """An explicit ``slice(start, stop, step)`` for dimension ``dim``."""
        start, stop, step = sl.indices(self._shape[dim])
        return slice(start, stop, step)

    def _index_view(self, idxs, op: str) -> "NDArray":
        # A slice of a valid view stays inside the same buffer: no bounds check needed.
        shape, strides, offset = index_view(self._shape, self._strides, self._offset, idxs, op)
        return _view(shape, strides, offset, self._device, self._handle)

    def __getitem__(self, idxs) -> "NDArray":
        """A view; an int index keeps its dimension with size 1 (course semantics)."""
        return self._index_view(idxs, "getitem")

    def __setitem__(self, idxs, other) -> None:
        """Write ``other`` (an NDArray with as many elements, or a scalar) into the view.

        An in-place write: bumps the version of the buffer (see ``needle._core.versions``).
        """
        self._setitem(idxs, other)
        _note_write(self._handle)

    def _setitem(self, idxs, other) -> None:
        # __setitem__ without a version bump, for arrays only their creator can see yet
        if builtins.any(s == 0 and n > 1 for n, s in zip(self._shape, self._strides,
                                                          strict=True)):
            # several elements share one address: a write would land on them all (NumPy
            # makes such broadcast views read-only)
            raise ShapeError(f"setitem: the array repeats elements (stride 0), expected one "
                             f"whose elements are distinct, got shape {self.shape} and strides "
                             f"{self.strides} (write to the array it was broadcast from)")
        view = self._index_view(idxs, "setitem")
        if isinstance(other, NDArray):
            if other.size != view.size:
                raise ShapeError(f"setitem: size mismatch, expected {view.size} elements "
                                 f"(view {view.shape}), got {other.size} ({other.shape})")
            check_pair("setitem", self, other)
            if view.size:
                self._device.ewise_setitem(other.compact()._handle, self._handle, view._shape,
                                           view._strides, view._offset)
        elif is_scalar(other):
            self._device.scalar_setitem(view.size, float(other), self._handle, view._shape,
                                        view._strides, view._offset)
        else:
            raise DTypeError(f"setitem: expected an NDArray or a scalar, "
                             f"got {type(other).__name__}")

    # ---- elementwise ------------------------------------------------------------------
    def _ewise(self, other, ewise, scalar, op: str) -> "NDArray":
        # Kernels run on flat buffers. A dense non-compact operand (a permuted layout, such
        # as the NCHW view of an NHWC convolution output) is computed as it lies in memory,
        # the other operand brought into its order (free when the layouts agree), and the
        # result keeps that layout; otherwise both run on row-major copies.
        compact = self._compact or self.is_compact()
        layout = self if not compact and self.is_dense() else None
        out = _alloc(self._shape, self._device, self._handle.dtype, op)
        if isinstance(other, NDArray):
            if other._device is not self._device or other._handle.dtype != out._handle.dtype:
                check_pair(op, self, other)
            check_same_shape(op, self, other)
            other_compact = other._compact or other.is_compact()
            if layout is None and not compact and not other_compact and other.is_dense():
                layout = other  # self must be copied anyway: copy it into other's order
            if layout is not None:
                a, b = self._in_layout(layout, op), other._in_layout(layout, op)
            else:
                a = self if compact else self._copy(op)
                b = other if other_compact else other._copy(op)
            ewise(a._handle, b._handle, out._handle)
        else:
            a = self if compact or layout is not None else self._copy(op)
            scalar(a._handle, scalar_value(other, op), out._handle)
        if layout is None:
            return out
        return _view(self._shape, layout._strides, 0, self._device, out._handle)

    def _unary(self, kernel) -> "NDArray":
        if self._compact or self.is_compact():
            out = _alloc(self._shape, self._device, self._handle.dtype)
            kernel(self._handle, out._handle)
            return out
        if self.is_dense():  # computed in place of memory order, the layout kept
            out = _alloc(self._shape, self._device, self._handle.dtype)
            kernel(self._handle, out._handle)
            return _view(self._shape, self._strides, 0, self._device, out._handle)
        a = self.compact()
        out = _alloc(self._shape, self._device, self._handle.dtype)
        kernel(a._handle, out._handle)
        return out

    def __add__(self, other):
        d = self._device
        return self._ewise(other, d.ewise_add, d.scalar_add, "add")

    __radd__ = __add__

    def __sub__(self, other):
        d = self._device
        return self._ewise(other, d.ewise_sub, d.scalar_sub, "sub")

    def __rsub__(self, other):
        return self._ewise(other, None, self._device.scalar_rsub, "rsub")

    def __mul__(self, other):
        d = self._device
        return self._ewise(other, d.ewise_mul, d.scalar_mul, "mul")

    __rmul__ = __mul__

    def __truediv__(self, other):
        d = self._device
        return self._ewise(other, d.ewise_div, d.scalar_div, "div")

    def __rtruediv__(self, other):
        return self._ewise(other, None, self._device.scalar_rdiv, "rdiv")

    def __neg__(self):
        return self._unary(self._device.ewise_neg)

    def __pow__(self, other):
        d = self._device
        if type(other) is float and other == 0.5:
            # as NumPy's ** does: a square root, correctly rounded and vectorised (the
            # scalar pow loop took 40x as long; Adam and the norms raise to 0.5)
            return self._unary(d.ewise_sqrt)
        return self._ewise(other, d.ewise_power, d.scalar_power, "power")

    def __rpow__(self, other):
        return self._ewise(other, None, self._device.scalar_rpower, "rpower")

    def maximum(self, other):
        d = self._device
        return self._ewise(other, d.ewise_maximum, d.scalar_maximum, "maximum")

    def minimum(self, other):
        d = self._device
        return self._ewise(other, d.ewise_minimum, d.scalar_minimum, "minimum")

    # Comparisons return 1.0 / 0.0 in the array's dtype (so NDArray is unhashable).
    def __eq__(self, other):
        d = self._device
        return self._ewise(other, d.ewise_eq, d.scalar_eq, "eq")

    def __ge__(self, other):
        d = self._device
        return self._ewise(other, d.ewise_ge, d.scalar_ge, "ge")

    def __le__(self, other):
        if isinstance(other, NDArray):
            return other.__ge__(self)
        return self._ewise(other, None, self._device.scalar_le, "le")

    def __ne__(self, other):
        return 1 - (self == other)

    def __gt__(self, other):
        return 1 - (self <= other)

    def __lt__(self, other):
        return 1 - (self >= other)

    __hash__ = None

    def log(self):
        return self._unary(self._device.ewise_log)

    def exp(self):
        return self._unary(self._device.ewise_exp)

    def tanh(self):
        return self._unary(self._device.ewise_tanh)

    def sqrt(self):
        return self._unary(self._device.ewise_sqrt)

    def abs(self):
        return self._unary(self._device.ewise_abs)

    def sign(self):
        return self._unary(self._device.ewise_sign)

    def sigmoid(self):
        return self._unary(self._device.ewise_sigmoid)

    # ---- fused backward steps: one kernel where the backend has it, else composed ------
    def tanh_grad(self, t) -> "NDArray":
        """``self * (1 - t * t)``: tanh's backward from its output ``t`` (same shape).

        Example:
            >>> from needle.backend_ndarray import array, cpu_numpy
            >>> g = array([1.0, 2.0], device=cpu_numpy())
            >>> g.tanh_grad(array([0.5, 0.0], device=cpu_numpy())).numpy().tolist()
            [0.75, 2.0]
        """
        kernel = getattr(self._device.mod, "ewise_tanh_grad", None)
        if kernel is None:
            check_same_shape("tanh_grad", self, t)
            return self * (1 - t * t)
        return self._ewise(t, kernel, None, "tanh_grad")

    def relu_grad(self, r) -> "NDArray":
        """``self * sign(r)``: relu's backward from its output ``r >= 0`` (same shape)."""
        kernel = getattr(self._device.mod, "ewise_relu_grad", None)
        if kernel is None:
            check_same_shape("relu_grad", self, r)
            return self * r.sign()
        return self._ewise(r, kernel, None, "relu_grad")

    # ---- matmul -----------------------------------------------------------------------
    def __matmul__(self, other: "NDArray") -> "NDArray":
        """2-D matrix product (batched products live in :func:`matmul`)."""
        if not isinstance(other, NDArray) or len(self._shape) != 2 or len(other._shape) != 2:
            got = other.shape if isinstance(other, NDArray) else type(other).__name__
            raise ShapeError(f"matmul: expected two 2-D arrays, got {self.shape} @ {got} "
                             f"(use needle.backend_ndarray.matmul for batches)")
        if other._device is not self._device or other._handle.dtype != self._handle.dtype:
            check_pair("matmul", self, other)
        (m, n), (n2, p) = self._shape, other._shape
        if n != n2:
            raise ShapeError(f"matmul: inner dimensions differ, expected a.shape[-1] == "
                             f"b.shape[-2], got {self.shape} @ {other.shape}")
        if USE_TILED_MATMUL and tiled_ok(self._device, m, n, p):
            return matmul_tiled(self, other, m, n, p)
        dtype = self._handle.dtype
        out = _alloc((m, p), self._device, dtype, "matmul")
        if not m or not p:
            return out  # nothing to compute: operands are neither read nor compacted
        strided = getattr(self._device.mod, "matmul_strided", None)
        (ars, acs), (brs, bcs) = self._strides, other._strides
        if (strided is not None and dtype not in LOW_PRECISION and ars >= 0 and acs >= 0
                and brs >= 0 and bcs >= 0):
            # the kernel packs straight from the views: no compact copy of a transposed or
            # sliced operand (every matmul backward multiplies by a transpose)
            strided(self._handle, other._handle, out._handle, m, n, p, self._offset, ars, acs,
                    other._offset, brs, bcs)
            return out
        a = self if self._compact else self.compact()
        b = other if other._compact else other.compact()
        self._device.matmul(a._handle, b._handle, out._handle, m, n, p)
        return out

    # ---- reductions -------------------------------------------------------------------
    def _reduce(self, axis, keepdims: bool, kernel, op: str) -> "NDArray":
        axes = normalize_axes(axis, self.ndim, op)
        if self._compact or self.is_compact():
            out = self._reduce_compact(axes, keepdims, kernel, op)
            if out is not None:
                return out
        keep = tuple(a for a in range(self.ndim) if a not in axes)
        view = self.permute(keep + axes)
        kept_order = keep  # the order of the kept axes in the kernel's output buffer
        if not view.is_compact():
            if self.is_dense():
                # a permuted layout: reduce in memory order when the reduced axes lie
                # innermost there (an NCHW view of NHWC summed over N, H, W), no copy
                by_stride = self._memory_order()
                kept_order = tuple(a for a in by_stride if a in keep)
                view = self.permute(kept_order + tuple(a for a in by_stride if a in axes))
                if not view.is_compact() and op == "sum":
                    cols = self._column_sum(by_stride, keep, axes)
                    if cols is not None:
                        kept_order, summed = cols
                        return self._reduced_view(summed, kept_order, keep, keepdims)
                if not view.is_compact():
                    steps = self._reduce_in_steps(by_stride, axes, kernel, op)
                    if steps is not None:
                        kept_order, out = steps
                        return self._reduced_view(out, kept_order, keep, keepdims)
            if not view.is_compact():
                kept_order = keep
                view = self.permute(keep + axes)._copy(op)
        reduce_size = math.prod(self._shape[a] for a in axes)
        if keepdims:
            out_shape = tuple(1 if a in axes else n for a, n in enumerate(self._shape))
        else:
            out_shape = tuple(self._shape[a] for a in keep)
        reordered = kept_order != keep
        buf_shape = tuple(self._shape[a] for a in kept_order) if reordered else out_shape
        out = _alloc(buf_shape, self._device, self._handle.dtype, op)
        if out.size and reduce_size == 0:
            if op != "sum":
                raise ShapeError(f"{op}: zero-size reduction has no identity, expected a "
                                 f"non-empty axis, got shape {self._shape} axis {axis}")
            out._fill(0.0)
        elif out.size:
            kernel(view._handle, out._handle, reduce_size)
        if not reordered:
            return out
        return self._reduced_view(out, kept_order, keep, keepdims)

    def _reduce_compact(self, axes: tuple, keepdims: bool, kernel, op: str):
        """The two reductions of a compact array that need no view arithmetic: over its
        trailing axes (the kernel reads the buffer as it lies) and over its leading axes (a
        column sum, ``ones(1, M) @ X``; max and min where the backend has a column kernel,
        ``reduce_max_leading``). None for any other case (and for empty arrays), which the
        general path handles.

        This is the bias gradient of every Linear layer: the general path's permutations
        and layout checks cost ~8x the kernel on a (128, 100) array."""
        shape = self._shape
        ndim, k = len(shape), len(axes)
        if not k or 0 in shape:
            return None
        if axes[0] == ndim - k and axes[-1] == ndim - 1:  # sorted and distinct: trailing
            kept = shape[:ndim - k]
            reduce_size = math.prod(shape[ndim - k:])
            lead = False
        elif axes[-1] == k - 1 and (op == "sum" or hasattr(self._device.mod,
                                                            f"reduce_{op}_leading")):
            kept = shape[k:]  # leading
            reduce_size = math.prod(shape[:k])
            lead = True
        else:
            return None
        out_shape = kept
        if keepdims:
            out_shape = (1,) * k + kept if lead else kept + (1,) * k
        if not lead:
            out = _alloc(out_shape, self._device, self._handle.dtype, op)
            kernel(self._handle, out._handle, reduce_size)
            return out
        summed = (self._sum_rows(reduce_size, math.prod(kept)) if op == "sum"
                  else self._reduce_rows(op, reduce_size, math.prod(kept)))
        if summed._shape == out_shape:  # (1, k): one leading axis kept as a 1
            return summed
        return _view(out_shape, _compact_strides(out_shape), 0, self._device, summed._handle)

    def _sum_rows(self, m: int, k: int) -> "NDArray":
        """The buffer read as an (m, k) row-major matrix, summed over its rows; shape (1, k).
        The backend's ``reduce_sum_leading`` where it has one (one pass, the rows added in
        order), else one ``ones(1, m) @ X`` matmul (the ones a stride-0 view of one element)."""
        kernel = getattr(self._device.mod, "reduce_sum_leading", None)
        if kernel is not None:
            out = _alloc((1, k), self._device, self._handle.dtype, "sum")
            kernel(self._handle, out._handle, m, k)
            return out
        one = _alloc((1,), self._device, self._handle.dtype, "sum")
        one._fill(1.0)
        ones = _view((1, m), (0, 0), 0, self._device, one._handle)
        return ones @ _view((m, k), (k, 1), 0, self._device, self._handle)

    def _reduce_rows(self, op: str, m: int, k: int) -> "NDArray":
        """The buffer read as an (m, k) row-major matrix, reduced over its rows by the
        backend's column kernel ``reduce_<op>_leading``; shape (1, k)."""
        out = _alloc((1, k), self._device, self._handle.dtype, op)
        getattr(self._device.mod, f"reduce_{op}_leading")(self._handle, out._handle, m, k)
        return out

    def _reduced_view(self, out: "NDArray", kept_order: tuple, keep: tuple,
                      keepdims: bool) -> "NDArray":
        """``out`` (the kept axes compact in ``kept_order``) viewed in the caller's order."""
        strides = dict(zip(kept_order, _compact_strides(tuple(self._shape[a]
                                                              for a in kept_order)),
                           strict=True))
        dims = range(self.ndim) if keepdims else keep
        shape = tuple(self._shape[a] if a in strides else 1 for a in dims)
        return _view(shape, tuple(strides.get(a, 0) for a in dims), 0, self._device,
                     out._handle)

    def _column_sum(self, by_stride: tuple, keep: tuple, axes: tuple):
        """A dense array whose summed axes are outermost in memory is an (M, K) matrix to
        sum over its rows: ``ones(1, M) @ it``, one matmul instead of a transposing copy
        (the bias gradient of an NCHW view of NHWC data). None when not of this kind."""
        order = [a for a in by_stride if self._shape[a] != 1]
        summed = [a for a in order if a in axes]
        if not summed or order[:len(summed)] != summed:
            return None
        kept_order = tuple(a for a in by_stride if a in keep)
        m = math.prod(self._shape[a] for a in axes)
        k = math.prod(self._shape[a] for a in keep)
        return kept_order, self._sum_rows(m, k).reshape((k,))

    def _reduce_in_steps(self, by_stride: tuple, axes: tuple, kernel, op: str):
        """A dense array whose innermost axes in memory are some of the reduced ones, but
        not all, reduced in two passes over compact buffers instead of a transposing copy:
        the bias gradient of nn.Conv, an NHWC view of an NCHW gradient summed over N, H, W.

        * a sum whose other reduced axes are outermost in memory (N there): those first, a
          column sum of the buffer as an (N, C·H·W) matrix, then H·W per channel;
        * otherwise, with an inner run of at least ``_MIN_INNER_RUN`` values, the inner run
          first (a trailing reduction of the buffer as it lies: H·W per (n, c)), then the
          rest of the smaller result. Shorter rows cost the reduction kernel more per value
          than the copy does.

        One thread, (128, C, H, W) float32 summed to C (the copy, then this): 32x32 maps
        336 -> 117 us, 8x8 37 -> 26 us, 4x4 31 -> 23 us. Returns
        ``(kept_order, out)`` (``out`` compact, its axes the kept ones in ``kept_order``)
        or None when not of this kind."""
        inner, run = 0, 1
        for a in reversed(by_stride):
            if a not in axes:
                break
            inner += 1
            run *= self._shape[a]
        if inner == 0 or inner == len(axes) or 0 in self._shape:
            return None
        in_memory_order = self.permute(by_stride)
        if not in_memory_order.is_compact():
            return None
        ndim, reduced = len(by_stride), len(axes)
        kept_order = tuple(a for a in by_stride if a not in axes)
        lead = reduced - inner
        if op == "sum" and all(a in axes for a in by_stride[:lead]):
            m = math.prod(self._shape[a] for a in by_stride[:lead])
            rest = tuple(self._shape[a] for a in by_stride[lead:])
            summed = in_memory_order._sum_rows(m, math.prod(rest))
            mid = _view(rest, _compact_strides(rest), 0, self._device, summed._handle)
            inner_axes = tuple(range(len(rest) - inner, len(rest)))
            return kept_order, mid._reduce_compact(inner_axes, False, kernel, op)
        if run < _MIN_INNER_RUN:
            return None
        outer = by_stride[:ndim - inner]
        mid = in_memory_order._reduce_compact(tuple(range(ndim - inner, ndim)), False,
                                              kernel, op)
        rest = tuple(i for i, a in enumerate(outer) if a in axes)
        return kept_order, mid._reduce(rest, False, kernel, op).compact()

    def sum(self, axis=None, keepdims: bool = False) -> "NDArray":
        return self._reduce(axis, keepdims, self._device.reduce_sum, "sum")

    def max(self, axis=None, keepdims: bool = False) -> "NDArray":
        return self._reduce(axis, keepdims, self._device.reduce_max, "max")

    def min(self, axis=None, keepdims: bool = False) -> "NDArray":
        return self._reduce(axis, keepdims, self._device.reduce_min, "min")

    # ---- rearrangements -----------------------------------------------------------------
    def flip(self, axes) -> "NDArray":
        """A compact copy reversed along ``axes``."""
        axes = normalize_axes(axes, self.ndim, "flip")
        strides, offset = list(self._strides), self._offset
        for a in axes:
            if self._shape[a]:
                offset += (self._shape[a] - 1) * self._strides[a]
            strides[a] = -self._strides[a]
        return _view(self._shape, tuple(strides), offset, self._device, self._handle)._copy()

    def pad(self, axes) -> "NDArray":
        """Zero padding, one ``(before, after)`` pair per dimension, like ``np.pad``."""
        axes = tuple(tuple(int(x) for x in pair) for pair in axes)
        if len(axes) != self.ndim or any(len(p) != 2 or builtins.min(p) < 0 for p in axes):
            raise ShapeError(f"pad: expected {self.ndim} non-negative (before, after) pairs, "
                             f"got {axes}")
        shape = tuple(n + lo + hi for n, (lo, hi) in zip(self._shape, axes, strict=True))
        out = _alloc(shape, self._device, self._handle.dtype, "pad")
        out._fill(0.0)
        region = tuple(slice(lo, lo + n) for n, (lo, _) in zip(self._shape, axes, strict=True))
        out._setitem(region, self)
        return out


_MIN_INNER_RUN = 256  # NDArray._reduce_in_steps: the shortest inner run reduced in place

_new_ndarray = object.__new__
# Told about every NDArray that allocates a buffer (``fn(array)``, right after the allocation),
# or None. needle.memory's profiler sets it to learn each buffer's shape and dtype; L1 never
# imports L2. One global test per allocation when nobody listens.
_BUFFER_OBSERVER = None


def set_buffer_observer(fn):
    """Install ``fn(array)`` to be called for each newly allocated buffer; returns the
    previous observer (None: off)."""
    global _BUFFER_OBSERVER
    prev, _BUFFER_OBSERVER = _BUFFER_OBSERVER, fn
    return prev


def _alloc(shape: tuple, device: BackendDevice, dtype: str, op: str = "alloc") -> NDArray:
    """A fresh compact array (the hot path of every kernel's output).

    ``shape`` must be a tuple of non-negative ints. Only the size limit is checked, and only
    exactly when the element count is large enough to matter (one comparison otherwise).
    """
    size, strides = _LAYOUTS.get(shape) or _layout(shape)
    if size > FAST_ALLOC_ELEMENTS:
        check_alloc(op, shape, _itemsize(dtype), dtype)
    try:
        handle = device.new_array(size, dtype)
    except MemoryError as exc:
        if isinstance(exc, OutOfMemoryError) and exc.details:
            raise  # a limit's own report (live tensors, fragmentation) says more
        raise out_of_memory(op, shape, dtype, device, exc) from exc
    array = _new_ndarray(NDArray)
    array._shape = shape
    array._strides = strides
    array._offset = 0
    array._device = device
    array._handle = handle
    array._compact = True
    if _BUFFER_OBSERVER is not None:
        _BUFFER_OBSERVER(array)
    return array


def _view(shape: tuple, strides: tuple, offset: int, device: BackendDevice, handle) -> NDArray:
    """A view on ``handle``; the caller guarantees it lies inside the buffer."""
    array = _new_ndarray(NDArray)
    array._shape = shape
    array._strides = strides
    array._offset = offset
    array._device = device
    array._handle = handle
    array._compact = None  # unknown until is_compact() looks
    return array


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def empty_checked(op: str, shape, device: BackendDevice, dtype: str) -> NDArray:
    """An uninitialised compact array of a user-given ``shape`` (validated; ``op`` names
    the caller in errors)."""
    return _alloc(check_dims(op, shape), device, dtype, op)


from .ndarray_functions import *  # noqa: E402,F401,F403 - the course's module functions
from .ndarray_functions import __all__ as _function_names  # noqa: E402

__all__ += list(_function_names)
