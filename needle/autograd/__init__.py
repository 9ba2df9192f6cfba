"""The autograd graph (layer L3): ``Value``/``Tensor``/``TensorTuple``, ops and ``backward``.

Ops run eagerly: each call computes its array at once and, when grad mode is on and an input
requires grad, records the op and its inputs so that :meth:`Tensor.backward` can walk back.
The engine (``needle/autograd/engine.py``) counts dependencies, fires hooks as gradients
become ready, and frees the graph as it goes; ``docs/autograd.md`` states the rules per mode.

Example:
    >>> import needle as ndl
    >>> x = ndl.Tensor([1.0, 2.0, 3.0])
    >>> (x * x).sum().backward()
    >>> x.grad.numpy().tolist()
    [2.0, 4.0, 6.0]
"""
from __future__ import annotations

import itertools
import warnings

from .engine import describe, run_backward
from .grad_mode import STATE, enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from .hooks import RemovableHandle, saved_tensors_hooks
from .release import sweep as _sweep_released
from .release import track as _track
from .._core.errors import DTypeError, GraphError, ShapeError
from ..backend_selection import (  # noqa: F401 - re-exported as the course's autograd does
    BACKEND,
    Device,
    NDArray,
    all_devices,
    array_api,
    cpu,
    default_device,
)
from ..memory import categories as _mem_categories
from ..memory import observers as _mem_observers

__all__ = ["Op", "TensorOp", "TensorTupleOp", "Value", "Tensor", "TensorTuple",
           "find_topo_sort", "topo_sort_dfs", "sum_node_list", "compute_gradient_of_variables",
           "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled",
           "saved_tensors_hooks", "RemovableHandle", "gradcheck", "ImplicitGradWarning"]

LAZY_MODE = False
TENSOR_COUNTER = 0
_SEQ = itertools.count()  # creation order; the engine runs later-created nodes first
_SELF = object()  # marks "the saved tensor is the node's own output" (avoids a self-cycle)
_ND = BACKEND == "nd"
# needle.memory (L2) attribution: while a recorded op computes, allocations default to the
# "activation" category (one thread-local field, written twice per recorded op).
_MEM_STATE = _mem_categories.thread_state()
# The memory observer (trace/record), or None: the only per-op cost of observation is this test.
_OBSERVER = None


def _set_observer(observer) -> None:
    global _OBSERVER
    _OBSERVER = observer


_mem_observers.bind(_set_observer)


class ImplicitGradWarning(UserWarning):
    """``backward()`` of a non-scalar without ``out_grad`` (ones are used, as the course does)."""


class Op:
    """An operator: ``compute`` on backend arrays, ``gradient`` on Tensors.

    ``save_inputs`` lists the input indices whose data ``gradient`` reads (None = all);
    ``save_output`` says whether it reads its own output. Both decide what passes through
    :class:`saved_tensors_hooks`; read them in ``gradient`` through ``node.saved_tensors``.
    """

    save_inputs: tuple[int, ...] | None = None
    save_output = False

    def __call__(self, *args):
        raise NotImplementedError()

    def compute(self, *args):
        raise NotImplementedError()

    def gradient(self, out_grad, node):
        raise NotImplementedError()

    def gradient_as_tuple(self, out_grad, node) -> tuple:
        """``gradient`` as a tuple (a TensorTuple counts as one value)."""
        output = self.gradient(out_grad, node)
        if isinstance(output, tuple):
            return output
        if isinstance(output, list):
            return tuple(output)
        return (output,)


class TensorOp(Op):
    """An op whose output is a single Tensor."""

    def __call__(self, *args):
        return _make_from_op(Tensor, self, args)


class TensorTupleOp(Op):
    """An op whose output is a TensorTuple."""

    def __call__(self, *args):
        return _make_from_op(TensorTuple, self, args)


def _make_from_op(cls, op, inputs, _observe=True):
    """Run ``op`` now and record it when grad mode is on and some input requires grad.

    This is the hot path of every op call: keep it short (PERF_NOTES: dispatch-bound models).
    """
    global TENSOR_COUNTER
    if _OBSERVER is not None and _observe:
        return _make_observed(cls, op, inputs)
    node = object.__new__(cls)
    TENSOR_COUNTER += 1
    if LAZY_MODE:
        node.op, node.inputs, node.cached_data = op, inputs, None
        node.requires_grad = any(x.requires_grad for x in inputs)
        node._seq = next(_SEQ)
        return node
    # eager mode: inputs are always realised; the class defaults (op None, inputs (),
    # requires_grad False) already describe an unrecorded result
    state = STATE
    record = False
    if state.grad_enabled:
        for x in inputs:
            if x.requires_grad:
                record = True
                _MEM_STATE.op_category = "activation"
                break
    try:
        if len(inputs) == 1:
            node.cached_data = op.compute(inputs[0].cached_data)
        elif len(inputs) == 2:
            node.cached_data = op.compute(inputs[0].cached_data, inputs[1].cached_data)
        else:
            node.cached_data = op.compute(*[x.cached_data for x in inputs])
    finally:
        if record:
            _MEM_STATE.op_category = None
    if record:
        node.op, node.inputs, node.requires_grad = op, inputs, True
        node._seq = next(_SEQ)
        if state.saved_hooks is not None:
            node._saved = _pack(op, node, state.saved_hooks)
        elif _ND:
            _track(node, op, inputs)  # free what backward won't read (autograd/release.py)
    return node


def _make_observed(cls, op, inputs):
    """:func:`_make_from_op` with the memory observer told before and after the compute."""
    observer = _OBSERVER
    token = observer.op_begin(op, inputs)
    node = None
    try:
        node = _make_from_op(cls, op, inputs, False)
    finally:
        observer.op_end(token, node)
    return node


def _leaf(data):
    """A constant leaf around ``data`` (the fast ``Tensor.make_const`` for op gradients)."""
    global TENSOR_COUNTER
    node = object.__new__(Tensor)
    TENSOR_COUNTER += 1
    node.cached_data = data
    return node


def _pack(op, node, hooks) -> tuple:
    pack, unpack = hooks
    idx = op.save_inputs
    inputs = node.inputs if idx is None else [node.inputs[i] for i in idx]
    packed = [pack(x) for x in inputs]
    if op.save_output:
        out = pack(node)
        packed.append(_SELF if out is node else out)
    return (unpack, packed)


class Value:
    """A node of the graph: the op that made it, its inputs, and its (cached) data."""

    # Class defaults describe a constant leaf, so the hot paths set only what differs.
    op: Op | None = None
    inputs: tuple = ()
    num_outputs = 1
    cached_data: object = None
    requires_grad: bool = False
    grad = None
    _seq = 0  # creation order of recorded nodes; the engine runs later-created ones first
    _saved = None  # packed saved tensors, only while saved_tensors_hooks were active
    _freed = False  # links cut by a backward without retain_graph
    _hooks = None  # {handle id: fn(grad)}
    _post_hooks = None  # {handle id: fn(tensor)}
    _retains_grad = False
    _is_tuple = False
    _tracked = False  # may be released once only the graph holds it (autograd/release.py)
    _links = 0  # consumers recorded with this node as an input, counted while tracked
    _keep = False  # some op saves this node's data for backward

    def realize_cached_data(self):
        """The backend array of this value (computed once from the inputs)."""
        if self.cached_data is None:
            self.cached_data = self.op.compute(*[x.realize_cached_data() for x in self.inputs])
        return self.cached_data

    def is_leaf(self) -> bool:
        return self.op is None

    def __del__(self):
        global TENSOR_COUNTER
        TENSOR_COUNTER -= 1

    def _init(self, op, inputs, *, num_outputs=1, cached_data=None, requires_grad=None):
        global TENSOR_COUNTER
        TENSOR_COUNTER += 1
        if requires_grad is None:
            requires_grad = any(x.requires_grad for x in inputs)
        self._seq = next(_SEQ)
        self.op = op
        self.inputs = inputs
        self.num_outputs = num_outputs
        self.cached_data = cached_data
        self.requires_grad = requires_grad

    @classmethod
    def make_const(cls, data, *, requires_grad=False):
        value = cls.__new__(cls)
        if isinstance(data, Value):
            data = data.realize_cached_data()
        value._init(None, (), cached_data=data, requires_grad=requires_grad)
        return value

    @classmethod
    def make_from_op(cls, op, inputs):
        return _make_from_op(cls, op, tuple(inputs))

    @property
    def saved_tensors(self) -> tuple:
        """What this node's op saved for backward (see :attr:`Op.save_inputs`)."""
        if self._freed:
            raise GraphError(
                f"{type(self.op).__name__}: saved tensors already freed by backward, expected "
                f"retain_graph=True on the first backward, got a freed graph")
        saved = self._saved
        if saved is None:
            op = self.op
            idx = op.save_inputs
            inputs = tuple(self.inputs) if idx is None else tuple(self.inputs[i] for i in idx)
            return inputs + (self,) if op.save_output else inputs
        unpack = saved[0]
        return tuple(self if p is _SELF else unpack(p) for p in saved[1])

    def _free_graph(self) -> None:
        self.inputs = ()
        self._saved = None
        self._freed = True

    def _add_hook(self, attr: str, fn) -> RemovableHandle:
        hooks = getattr(self, attr)
        if hooks is None:
            hooks = {}
            setattr(self, attr, hooks)
        handle = RemovableHandle(hooks)
        hooks[handle.id] = fn
        return handle

    def register_hook(self, fn) -> RemovableHandle:
        """Call ``fn(grad)`` once this value's gradient is complete in a backward.

        ``fn`` may return a replacement gradient (or None to keep it); it runs before the
        gradient flows on to the inputs (or into a leaf's ``.grad``). Several hooks run in
        registration order. Returns a handle with ``remove()``.

        Example:
            >>> import needle as ndl
            >>> x = ndl.Tensor([1.0, 2.0])
            >>> h = x.register_hook(lambda g: g * 10)
            >>> (x * 1).sum().backward(); x.grad.numpy().tolist()
            [10.0, 10.0]
        """
        if not self.requires_grad:
            raise GraphError(
                f"register_hook: tensor does not require grad, expected requires_grad=True, "
                f"got {describe(self)}")
        return self._add_hook("_hooks", fn)

    def register_post_accumulate_grad_hook(self, fn) -> RemovableHandle:
        """On a leaf: call ``fn(tensor)`` right after its ``.grad`` is final for a backward.

        Example:
            >>> import needle as ndl
            >>> p = ndl.Tensor([1.0]); seen = []
            >>> h = p.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy()))
            >>> (p * 3).sum().backward(); seen[0].tolist()
            [3.0]
        """
        if self.op is not None:
            raise GraphError(
                f"register_post_accumulate_grad_hook: expected a leaf tensor, got "
                f"{describe(self)}")
        return self._add_hook("_post_hooks", fn)

    def retain_grad(self) -> None:
        """Keep ``.grad`` on this non-leaf after backward (leaves always keep it)."""
        self._retains_grad = True


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


class SparseTupleGrad(TensorTuple):
    """A gradient for a tuple in which only some entries are non-zero (plain backward only).

    ``split(x)[i]`` used once per ``i`` would otherwise give each ``tuple_get_item`` a full
    tuple of zeros and a sum of those: O(n²) arrays for an n-way split (an unrolled LSTM
    over its time steps). Entries are merged by index when gradients are summed, and the
    dense tuple (zeros where nothing arrived) is built once, when an op reads it.
    """

    @classmethod
    def make(cls, entries: dict, like: tuple) -> "SparseTupleGrad":
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
            zeros = _ops.ops_tuple._zeros_array_like
            self._dense = tuple(self._entries[i] if i in self._entries else zeros(like)
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


def find_topo_sort(node_list) -> list:
    """Nodes reachable from ``node_list`` in post-order DFS (inputs left to right), once each.

    Iterative, so deep graphs do not hit Python's recursion limit; the order is exactly the
    recursive one of the course.
    """
    visited: set = set()
    topo_order: list = []
    for node in node_list:
        topo_sort_dfs(node, visited, topo_order)
    return topo_order


def topo_sort_dfs(node, visited, topo_order) -> None:
    """Post-order DFS from ``node`` appending to ``topo_order``; ``visited`` holds nodes."""
    if node in visited:
        return
    visited.add(node)
    stack = [(node, iter(node.inputs))]
    while stack:
        current, children = stack[-1]
        for child in children:
            if child not in visited:
                visited.add(child)
                stack.append((child, iter(child.inputs)))
                break
        else:
            stack.pop()
            topo_order.append(current)


def sum_node_list(node_list):
    """Sum a list of values with ``+`` (left to right)."""
    from functools import reduce
    from operator import add

    return reduce(add, node_list)


def compute_gradient_of_variables(output_tensor, out_grad) -> None:
    """The course's engine contract: ``.grad`` assigned on every node, built with graph.

    Equivalent to ``output_tensor.backward(out_grad, retain_graph=True, create_graph=True)``
    in np mode: gradients are Tensors with their own graph (gradient of gradient works) and
    every node on the way, leaf or not, gets ``.grad`` assigned (not accumulated).
    """
    with _mem_categories.framework_category("gradient"):
        run_backward(output_tensor, out_grad, retain_graph=True, create_graph=True,
                     accumulate=False, grad_all_nodes=True, strict=_ND)


def backward(tensor, out_grad=None, *, retain_graph=None, create_graph=None) -> None:
    """Implementation of :meth:`Tensor.backward` (see docs/autograd.md for the mode rules)."""
    if not tensor.requires_grad and _ND:
        raise GraphError(
            f"backward: tensor does not require grad, expected a result of ops on tensors with "
            f"requires_grad=True, got {describe(tensor)}")
    if _ND:
        _sweep_released(final=True)  # forward locals are gone now: last chance to release
    # The seed and everything the backward pass allocates count as "gradient" memory.
    with _mem_categories.framework_category("gradient"):
        grad = _root_grad(tensor, out_grad)
        _backward(tensor, grad, retain_graph, create_graph)


def _backward(tensor, grad, retain_graph, create_graph) -> None:
    if not _ND:
        retain_graph = True if retain_graph is None else retain_graph
        create_graph = True if create_graph is None else create_graph
        run_backward(tensor, grad, retain_graph=retain_graph, create_graph=create_graph,
                     accumulate=False, grad_all_nodes=True, strict=False)
        return
    run_backward(tensor, grad, retain_graph=bool(retain_graph),
                 create_graph=bool(create_graph), accumulate=True, grad_all_nodes=False,
                 strict=True)


def _root_grad(tensor, out_grad):
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


def gradcheck(fn, *inputs, eps=1e-6, atol=1e-5, rtol=1e-3, directions=3, seed=0):
    """Compare ``backward`` of ``fn`` with central differences in float64; see
    :func:`needle.autograd.gradcheck.gradcheck`."""
    from .gradcheck import gradcheck as _gradcheck

    return _gradcheck(fn, *inputs, eps=eps, atol=atol, rtol=rtol, directions=directions,
                      seed=seed)


# isort: off
# Order matters: Tensor must exist before needle.ops (which imports it) is loaded.
from .tensor import Tensor  # noqa: E402 - Tensor subclasses Value, defined above
from . import tensor as _tensor_module  # noqa: E402
from .. import ops as _ops  # noqa: E402 - ops import this module; bound late on purpose
# isort: on

_tensor_module._ops = _ops
