"""The user-facing graph classes: :class:`Tensor`, :class:`TensorTuple` and the ops that make
them (:class:`TensorOp`, :class:`TensorTupleOp`).

Operators and methods (``a + b``, ``a @ b``, ``a.sum()``, ``a.reshape(...)``) dispatch to
the op classes of :mod:`needle.ops`. ``needle.ops`` sits in the layer above autograd, so this
module does not import it: the ops layer registers itself once at import through
:func:`register_operator_ops` (``import needle`` always loads it). ``Tensor.backward`` builds
the seed gradient and hands the walk to :mod:`needle.autograd.engine`.

Example:
    >>> import needle as ndl
    >>> a = ndl.Tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> (a @ a + 1).numpy().tolist()
    [[8.0, 11.0], [16.0, 23.0]]
"""
from __future__ import annotations

import warnings

import numpy

from .._core.errors import AxisError, DTypeError, GraphError, ShapeError
from ..backend_selection import BACKEND, NDArray, array_api, cpu, default_device
from ..memory import categories as _mem_categories
from . import engine
from .value import Op, Value, leaf, make_from_op
from .versions import note_replaced

__all__ = ["Tensor", "TensorTuple", "TensorOp", "TensorTupleOp", "SparseTupleGrad",
           "ImplicitGradWarning", "register_operator_ops", "const", "set_host_read_guard"]

_ND = BACKEND == "nd"

# Called as guard(tensor, what) before a tensor's values are copied to the host; set by
# needle.compile while it runs a step, so that a step whose Python depends on tensor values
# is refused (one global test per read: free when unset).
_HOST_READ_GUARD = None


def set_host_read_guard(guard):
    """Install ``guard(tensor, what)`` (None removes it); returns the previous one."""
    global _HOST_READ_GUARD
    prev, _HOST_READ_GUARD = _HOST_READ_GUARD, guard
    return prev


class _Unregistered:
    """Stands in for the ops namespace until ``needle.ops`` registers it."""

    def __getattr__(self, name):
        raise GraphError(
            f"Tensor operators: the ops layer is not loaded, expected needle.ops to have "
            f"registered itself (import needle first), got a request for {name!r}")


_ops = _Unregistered()


def register_operator_ops(namespace) -> None:
    """Give Tensor's operators and methods the op classes they dispatch to.

    Called once by ``needle.ops`` at import with the ``needle.ops`` module itself; the names
    read from it are the op classes and functions (``_ADD``, ``MatMul``, ``Summation``,
    ``tuple_get_item``, ...).
    """
    global _ops
    _ops = namespace


class ImplicitGradWarning(UserWarning):
    """``backward()`` of a non-scalar without ``out_grad`` (ones are used, as the course does)."""


class TensorOp(Op):
    """An op whose output is a single Tensor."""

    def __call__(self, *args):
        return make_from_op(Tensor, self, args)


class TensorTupleOp(Op):
    """An op whose output is a TensorTuple."""

    def __call__(self, *args):
        return make_from_op(TensorTuple, self, args)


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
        replace_data(self, value.realize_cached_data())

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
        if _HOST_READ_GUARD is not None:
            _HOST_READ_GUARD(self, "Tensor.numpy()")
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
        if not self.requires_grad and _ND:
            raise GraphError(
                f"backward: tensor does not require grad, expected a result of ops on tensors "
                f"with requires_grad=True, got {engine.describe(self)}")
        engine.prepare_backward()
        # The seed and everything the backward pass allocates count as "gradient" memory.
        with _mem_categories.framework_category("gradient"):
            grad = _seed_gradient(self, out_grad)
            engine.backward(self, grad, retain_graph=retain_graph, create_graph=create_graph)

    def __repr__(self) -> str:
        return "needle.Tensor(" + str(self.realize_cached_data()) + ")"

    def __str__(self) -> str:
        return self.realize_cached_data().__str__()

    # ----- operators --------------------------------------------------------------------
    def __add__(self, other):
        if isinstance(other, Tensor) or isinstance(other := _operand(self, other), Tensor):
            return make_from_op(Tensor, _ops._ADD, (self, other))
        return make_from_op(Tensor, _ops.AddScalar(other), (self,))

    def __mul__(self, other):
        if isinstance(other, Tensor) or isinstance(other := _operand(self, other), Tensor):
            return make_from_op(Tensor, _ops._MUL, (self, other))
        return make_from_op(Tensor, _ops.MulScalar(other), (self,))

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
        return make_from_op(Tensor, _ops._MATMUL, (self, other))

    def __rmatmul__(self, other):
        return _ops.MatMul()(Tensor(other, device=self.device, dtype=self.dtype,
                                    requires_grad=False), self)

    def __neg__(self):
        return make_from_op(Tensor, _ops._NEG, (self,))

    __radd__ = __add__
    __rmul__ = __mul__

    def __getitem__(self, key):
        return _ops.get_item(self, key)

    # ----- methods ----------------------------------------------------------------------
    def matmul(self, other):
        return _ops.MatMul()(self, other)

    # sum/mean/max also take PyTorch's spelling, ``dim=`` and ``keepdim=`` (keywords only, so
    # the course's positional ``sum(axes)`` keeps its meaning).
    def sum(self, axes=None, keepdims=False, *, dim=None, keepdim=None):
        axes, keepdims = _torch_axes("sum", axes, keepdims, dim, keepdim)
        return _ops.summation(self, axes, keepdims)

    def mean(self, axes=None, keepdims=False, *, dim=None, keepdim=None):
        axes, keepdims = _torch_axes("mean", axes, keepdims, dim, keepdim)
        return _ops.mean(self, axes, keepdims)

    def max(self, axes=None, keepdims=False, *, dim=None, keepdim=None):
        axes, keepdims = _torch_axes("max", axes, keepdims, dim, keepdim)
        return _ops.max(self, axes, keepdims)

    # ----- PyTorch's reading habits: views of the shape and the value, nothing new -------
    def item(self) -> float:
        """The value of a one-element tensor (any shape) as a Python number.

        Raises:
            ShapeError: when the tensor holds more or fewer than one element.

        Example:
            >>> import needle as ndl
            >>> loss = (ndl.Tensor([1.0, 2.0]) * 2).sum()
            >>> loss.item(), float(loss)
            (6.0, 6.0)
        """
        values = self.numpy()
        if values.size != 1:
            raise ShapeError(f"Tensor.item: expected a tensor with one element, got shape "
                             f"{self.shape} ({values.size} elements)")
        return values.reshape(()).item()

    def __float__(self) -> float:
        return float(self.item())

    def __len__(self) -> int:
        shape = self.shape
        if not shape:
            raise ShapeError("len(Tensor): expected at least one dimension, got shape ()")
        return shape[0]

    # A tensor stays truthy whatever it holds, as in the course framework: with __len__
    # defined, Python would otherwise read `if tensor:` as "has rows".
    def __bool__(self) -> bool:
        return True

    def numel(self) -> int:
        """The number of elements (the product of the shape).

        Example:
            >>> import needle as ndl
            >>> t = ndl.zeros(2, 3)
            >>> t.numel(), t.size(), t.size(-1), t.dim(), len(t)
            (6, (2, 3), 3, 2, 2)
        """
        return int(numpy.prod(self.shape, dtype=numpy.int64))

    def size(self, dim: int | None = None):
        """The shape (a tuple) or, given ``dim``, its length along ``dim`` (negative counts
        from the end).

        Raises:
            AxisError: ``dim`` outside the tensor's dimensions.
        """
        shape = self.shape
        if dim is None:
            return shape
        if isinstance(dim, bool) or not isinstance(dim, (int, numpy.integer)) \
                or not -len(shape) <= dim < len(shape):
            raise AxisError(f"Tensor.size: dim out of range, expected an int in "
                            f"[{-len(shape)}, {len(shape) - 1}], got {dim!r}")
        return shape[dim]

    def dim(self) -> int:
        """The number of dimensions (``ndim``)."""
        return self.ndim

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


def _torch_axes(op: str, axes, keepdims, dim, keepdim):
    """``(axes, keepdims)`` from the course's ``axes``/NumPy's ``keepdims`` or PyTorch's
    ``dim``/``keepdim``; giving both spellings of one argument is refused."""
    if dim is not None:
        if axes is not None:
            raise AxisError(f"Tensor.{op}: axes given twice, expected axes= or dim=, got "
                            f"axes={axes!r} and dim={dim!r}")
        axes = tuple(dim) if isinstance(dim, list) else dim
    if keepdim is not None:
        if keepdims:
            raise AxisError(f"Tensor.{op}: keepdims given twice, expected keepdims= or "
                            f"keepdim=, got both")
        keepdims = keepdim
    return axes, bool(keepdims)


def _operand(tensor, other):
    """Arrays with more than one element become constant Tensors of ``tensor``'s dtype and
    device (so ``ndarray * Tensor`` is elementwise); scalars pass through unchanged."""
    if isinstance(other, NDArray) or isinstance(other, numpy.ndarray) and other.size != 1:
        return Tensor(other, device=tensor.device, dtype=tensor.dtype, requires_grad=False)
    return other


def replace_data(tensor: Tensor, array) -> None:
    """Point ``tensor`` at ``array``, in the tensor's own dtype (np mode lets float64 results
    reach float32 tensors), and stamp the replacement: a graph that saved the old data
    refuses to backward through it. What ``Tensor.data = ...``, optimizer steps and
    BatchNorm's running statistics do.

    Example:
        >>> import numpy as np, needle as ndl
        >>> t = ndl.Tensor([1.0, 2.0], dtype="float32")
        >>> replace_data(t, ndl.Tensor([3.0, 4.0], dtype="float64").realize_cached_data())
        >>> t.numpy().tolist(), str(t.dtype)
        ([3.0, 4.0], 'float32')
    """
    dtype = tensor.realize_cached_data().dtype
    tensor.cached_data = array if array.dtype == dtype else array.astype(dtype)
    note_replaced(tensor)  # a graph that saved this tensor must not use the new data


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



def _seed_gradient(tensor, out_grad):
    """The gradient ``backward`` starts from: ``out_grad`` checked, or ones."""
    data = tensor.realize_cached_data()
    if out_grad is None:
        if _ND and data.size != 1:
            warnings.warn(
                f"backward: output of shape {tuple(data.shape)} is not a scalar and no "
                f"out_grad was given; using ones (pass out_grad explicitly)",
                ImplicitGradWarning, stacklevel=3)
        return Tensor.make_const(tensor.device.ones(*data.shape, dtype=data.dtype))
    if not isinstance(out_grad, Value):
        out_grad = Tensor(out_grad, device=tensor.device, dtype=data.dtype,
                          requires_grad=False)
    have = out_grad.realize_cached_data()
    if have.shape != data.shape:
        raise ShapeError(
            f"backward: out_grad shape differs from the output's, expected "
            f"{tuple(data.shape)}, got {tuple(have.shape)}")
    if _ND and have.dtype != data.dtype:
        raise DTypeError(
            f"backward: out_grad dtype differs from the output's, expected {data.dtype}, got "
            f"{have.dtype}")
    return out_grad


def const(data) -> Tensor:
    """A constant Tensor leaf around the backend array ``data`` (no graph, no copy): the fast
    ``Tensor.make_const`` that op gradients wrap their arrays in."""
    return leaf(Tensor, data)


class TensorTuple(Value):
    """A tuple of tensors produced by one op (``split``, ``make_tuple``)."""

    _is_tuple = True

    def __len__(self) -> int:
        return len(self.realize_cached_data())

    def __getitem__(self, index: int):
        return _ops.tuple_get_item(self, index)

    def __iter__(self):
        # Explicit so unpacking (``i, f, g, o = split(x, 1)``) and ``list()`` work.
        return iter(self.tuple())

    def tuple(self) -> tuple:
        return tuple(self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return "needle.TensorTuple" + str(self.tuple())

    def __str__(self) -> str:
        return self.__repr__()

    def __add__(self, other):
        if not isinstance(other, TensorTuple) or len(self) != len(other):
            raise ShapeError(
                f"TensorTuple.__add__: expected a TensorTuple of length {len(self)}, got "
                f"{other!r}")
        return _ops.make_tuple(*[self[i] + other[i] for i in range(len(self))])

    def detach(self):
        return TensorTuple.make_const(self.realize_cached_data())


def _zeros_like(array):
    if not _ND:
        return numpy.zeros(array.shape, dtype=array.dtype)
    return array.device.full(tuple(array.shape), 0.0, array.dtype)


class SparseTupleGrad(TensorTuple):
    """A gradient for a tuple in which only some entries are non-zero (plain backward only).

    ``split(x)[i]`` used once per ``i`` would otherwise give each ``tuple_get_item`` a full
    tuple of zeros and a sum of those: O(n²) arrays for an n-way split (an unrolled LSTM
    over its time steps). Entries are merged by index when gradients are summed, and the
    dense tuple (zeros where nothing arrived) is built once, when an op reads it.
    """

    @classmethod
    def make(cls, entries: dict, like: tuple) -> SparseTupleGrad:
        value = cls.make_const(None)
        value._like, value._entries = like, entries
        return value

    def __len__(self) -> int:
        return len(self._like)

    _dense = None

    @property
    def cached_data(self):
        # Materialised on first read, by whichever path reads it (ops read the field).
        if self._dense is None and self.__dict__.get("_entries") is not None:
            self._dense = tuple(self._entries[i] if i in self._entries else _zeros_like(like)
                                for i, like in enumerate(self._like))
        return self._dense

    @cached_data.setter
    def cached_data(self, value):
        self._dense = value

    def realize_cached_data(self):
        return self.cached_data

    def __add__(self, other):
        if type(other) is SparseTupleGrad and len(other) == len(self):
            merged = dict(self._entries)
            for i, array in other._entries.items():
                merged[i] = merged[i] + array if i in merged else array
            return SparseTupleGrad.make(merged, self._like)
        return TensorTuple.make_const(self.cached_data) + other
