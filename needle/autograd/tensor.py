"""The :class:`Tensor` class: a graph value holding one backend array.

Lives apart from ``needle/autograd.py`` only to keep files short; import it from there (or
``needle``). Operators dispatch to the op classes of :mod:`needle.ops`.

Example:
    >>> import needle as ndl
    >>> a = ndl.Tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> (a @ a + 1).numpy().tolist()
    [[8.0, 11.0], [16.0, 23.0]]
"""
from __future__ import annotations

import numpy

from .._core.errors import DTypeError, ShapeError
from ..autograd import Value, backward
from ..autograd import _make_from_op as _make
from ..backend_selection import BACKEND, NDArray, array_api, cpu, default_device

_ND = BACKEND == "nd"


def _scalar_like(x) -> bool:
    return not isinstance(x, Value)


class Tensor(Value):
    """An n-dimensional array that records the ops applied to it for ``backward``.

    Args:
        array: a Tensor, NDArray, NumPy array, list or scalar.
        device: where to put the data (nd mode); default: the NDArray's own device, else
            ``default_device()``.
        dtype: ``"float32"`` (default in nd mode), ``"float64"``, ``"float16"``.
        requires_grad: record ops on this tensor for ``backward`` (default True).

    Example:
        >>> import needle as ndl
        >>> t = ndl.Tensor([1, 2, 3], dtype="float32")
        >>> t.shape, str(t.dtype)
        ((3,), 'float32')
    """

    grad: Tensor | None
    # NumPy must hand `ndarray <op> Tensor` to the Tensor's reflected operator.
    __array_priority__ = 1000
    __array_ufunc__ = None

    def __init__(self, array, *, device=None, dtype=None, requires_grad=True, **kwargs):
        if isinstance(array, Tensor):
            device = array.device if device is None else device
            dtype = array.dtype if dtype is None else dtype
            if device == array.device and dtype == array.dtype:
                data = array.realize_cached_data()
            else:
                data = _array_from(array.numpy(), device, dtype)
        else:
            data = _array_from(array, device, dtype)
        self._init(None, (), cached_data=data, requires_grad=requires_grad)

    @staticmethod
    def from_numpy(numpy_array, dtype):
        return Tensor.make_const(numpy.array(numpy_array, dtype=dtype))

    @staticmethod
    def make_const(data, requires_grad=False):
        tensor = Tensor.__new__(Tensor)
        if isinstance(data, Value):
            data = data.realize_cached_data()
        tensor._init(None, (), cached_data=data, requires_grad=requires_grad)
        return tensor

    # ----- properties -------------------------------------------------------------------
    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, value):
        if not isinstance(value, Tensor):
            raise DTypeError(f"Tensor.data: expected a Tensor, got {type(value).__name__}")
        if value.dtype != self.dtype:
            raise DTypeError(
                f"Tensor.data: dtype differs, expected {self.dtype}, got {value.dtype}")
        self.cached_data = value.realize_cached_data()

    @property
    def shape(self) -> tuple:
        return tuple(self.realize_cached_data().shape)

    @property
    def ndim(self) -> int:
        return len(self.realize_cached_data().shape)

    @property
    def dtype(self):
        return self.realize_cached_data().dtype

    @property
    def device(self):
        if not _ND:
            return cpu()
        return self.realize_cached_data().device

    def detach(self) -> Tensor:
        """A new leaf sharing this tensor's data, cut from the graph."""
        return Tensor.make_const(self.realize_cached_data())

    def numpy(self):
        """A NumPy copy of the data."""
        data = self.realize_cached_data()
        return data.copy() if not _ND else data.numpy()

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def backward(self, out_grad=None, *, retain_graph=None, create_graph=None) -> None:
        """Compute gradients of this tensor with respect to every leaf that requires grad.

        nd mode (PyTorch's meaning): gradients carry no graph unless ``create_graph``; the graph
        is freed step by step unless ``retain_graph``; leaves accumulate into ``.grad``.
        np mode (course): both default to True and ``.grad`` is assigned on every node.
        ``out_grad`` defaults to ones (a warning in nd mode for non-scalar outputs).

        Example:
            >>> import needle as ndl
            >>> w = ndl.Tensor([2.0, 3.0])
            >>> (w * w).sum().backward(); w.grad.numpy().tolist()
            [4.0, 6.0]
        """
        backward(self, out_grad, retain_graph=retain_graph, create_graph=create_graph)

    def __repr__(self) -> str:
        return "needle.Tensor(" + str(self.realize_cached_data()) + ")"

    def __str__(self) -> str:
        return self.realize_cached_data().__str__()

    # ----- operators --------------------------------------------------------------------
    def __add__(self, other):
        if isinstance(other, Tensor) or isinstance(other := _operand(self, other), Tensor):
            return _make(Tensor, _ops._ADD, (self, other))
        return _make(Tensor, _ops.AddScalar(other), (self,))

    def __mul__(self, other):
        if isinstance(other, Tensor) or isinstance(other := _operand(self, other), Tensor):
            return _make(Tensor, _ops._MUL, (self, other))
        return _make(Tensor, _ops.MulScalar(other), (self,))

    def __pow__(self, other):
        if isinstance(other, Tensor) or isinstance(other := _operand(self, other), Tensor):
            return _ops.EWisePow()(self, other)
        return _ops.PowerScalar(other)(self)

    def __sub__(self, other):
        # course contract: x - y is x + (-y) (the topological order test relies on it)
        if isinstance(other, Tensor) or isinstance(other := _operand(self, other), Tensor):
            return _ops._ADD(self, _ops._NEG(other))
        return _ops.AddScalar(-_ops.as_scalar(other, "sub"))(self)

    def __rsub__(self, other):
        if isinstance(other := _operand(self, other), Tensor):
            return _ops._ADD(other, _ops._NEG(self))
        return _ops.AddScalar(other)(_ops._NEG(self))

    def __truediv__(self, other):
        if isinstance(other, Tensor) or isinstance(other := _operand(self, other), Tensor):
            return _ops.EWiseDiv()(self, other)
        return _ops.DivScalar(other)(self)

    def __rtruediv__(self, other):
        if isinstance(other := _operand(self, other), Tensor):
            return _ops.EWiseDiv()(other, self)
        return _ops.MulScalar(other)(_ops.PowerScalar(-1)(self))

    def __matmul__(self, other):
        return _make(Tensor, _ops._MATMUL, (self, other))

    def __rmatmul__(self, other):
        return _ops.MatMul()(Tensor(other, device=self.device, dtype=self.dtype,
                                    requires_grad=False), self)

    def __neg__(self):
        return _make(Tensor, _ops._NEG, (self,))

    __radd__ = __add__
    __rmul__ = __mul__

    def __getitem__(self, key):
        return _ops.get_item(self, key)

    # ----- methods ----------------------------------------------------------------------
    def matmul(self, other):
        return _ops.MatMul()(self, other)

    def sum(self, axes=None):
        return _ops.Summation(axes)(self)

    def mean(self, axes=None, keepdims=False):
        return _ops.mean(self, axes, keepdims)

    def max(self, axes=None, keepdims=False):
        return _ops.max(self, axes, keepdims)

    def broadcast_to(self, shape):
        return _ops.BroadcastTo(shape)(self)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        return _ops.Reshape(shape)(self)

    def transpose(self, axes=None):
        return _ops.Transpose(axes)(self)

    def permute(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = axes[0]
        return _ops.Permute(axes)(self)

    def to(self, device) -> Tensor:
        """This tensor on ``device`` (differentiable; a no-op when already there)."""
        if device == self.device:
            return self
        return _ops.ToDevice(device)(self)

    def astype(self, dtype) -> Tensor:
        """This tensor converted to ``dtype`` (differentiable; a no-op when already so)."""
        return _ops.astype(self, dtype)


def _operand(tensor, other):
    """Arrays with more than one element become constant Tensors of ``tensor``'s dtype and
    device (so ``ndarray * Tensor`` is elementwise); scalars pass through unchanged."""
    if isinstance(other, NDArray) or isinstance(other, numpy.ndarray) and other.size != 1:
        return Tensor(other, device=tensor.device, dtype=tensor.dtype, requires_grad=False)
    return other


def _array_from(array, device, dtype):
    if not _ND:
        if isinstance(array, Tensor):
            array = array.numpy()
        return numpy.array(array, dtype=dtype)
    if isinstance(array, NDArray):
        dtype = array.dtype if dtype is None else dtype
        device = array.device if device is None else device
        return array_api.array(array, dtype=dtype, device=device)
    if device is None:
        device = default_device()
    if isinstance(array, (list, tuple)) and array and any(isinstance(x, Value) for x in array):
        raise ShapeError(
            "Tensor: cannot build from a list holding Tensors, expected numbers or arrays, got "
            f"a list of {type(array[0]).__name__}; use ndl.stack")
    return array_api.array(array, dtype=dtype, device=device)


_ops = None  # needle.ops, bound by needle/autograd.py once both modules exist
