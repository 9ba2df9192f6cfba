"""Graph nodes and op dispatch: :class:`Value` (a node), :class:`Op` (what made it) and the
hot path that runs an op and records it.

Ops run eagerly: each call computes its array at once and, when grad mode is on and an input
requires grad, records the op and its inputs so that backward can walk back. This module
knows nothing of Tensor or of the engine; ``tensor.py`` builds on it and ``engine.py`` reads
nodes through the fields defined here.

Example:
    >>> import needle as ndl
    >>> y = ndl.Tensor([1.0, 2.0]) * 3
    >>> type(y.op).__name__, y.is_leaf(), len(y.inputs)
    ('MulScalar', False, 1)
"""
from __future__ import annotations

import gc
from typing import Callable

from .._core.errors import GraphError
from .._core.handles import RemovableHandle
from .._core.versions import CLOCK
from ..backend_selection import BACKEND
from ..memory import categories as _mem_categories
from ..memory import observers as _mem_observers
from .grad_mode import STATE
from .hooks import SAVED_SELF, pack_saved
from .release import CANDIDATES as _CANDIDATES
from .release import sweep as _sweep
from .release import track as _track

__all__ = ["Op", "Value", "describe", "make_from_op", "leaf", "live_count", "set_live_count"]

LAZY_MODE = False  # the course's switch: record without computing (realize_cached_data later)
# The course's leak check reads ``needle.autograd.TENSOR_COUNTER``, the number of live Values
# (see live_count). A write sets this offset, so that the count reads as written from then on.
_COUNTER_OFFSET = 0
# Creation order; the engine runs later-created nodes first. The same clock stamps in-place
# writes and data replacements (needle._core.versions): "changed after this node was
# recorded" is ``stamp > node._seq``.
_SEQ = CLOCK
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


def live_count() -> int:
    """How many Values exist now, plus the offset a write to ``TENSOR_COUNTER`` set.

    ``needle.autograd.TENSOR_COUNTER`` reads this. The course counts +1 when a Value is made
    and -1 in ``Value.__del__``; a Python ``__del__`` on every node cost 2-3% of a small
    op's forward and backward, so the count is taken when asked instead, by walking the
    garbage collector's objects (every Value is one): milliseconds per read, nothing per op.
    Values in uncollected reference cycles count as live, as they did for ``__del__``.

    Example:
        >>> import needle as ndl
        >>> before = live_count(); t = ndl.Tensor([1.0]); live_count() - before
        1
    """
    # type(obj), not isinstance: isinstance falls back to obj.__class__, which runs code on
    # proxies and lazy objects (one warned on every read)
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), Value)) + _COUNTER_OFFSET


def set_live_count(value: int) -> None:
    """Make :func:`live_count` read ``value`` now (a write to ``TENSOR_COUNTER``)."""
    global _COUNTER_OFFSET
    _COUNTER_OFFSET = 0
    _COUNTER_OFFSET = int(value) - live_count()


class Op:
    """An operator: ``compute`` on backend arrays, ``gradient`` on Tensors.

    ``save_inputs`` lists the input indices whose data ``gradient`` reads (None = all);
    ``save_output`` says whether it reads its own output. Both decide what passes through
    ``saved_tensors_hooks`` and what autograd may release; read them in ``gradient`` through
    ``node.saved_tensors``.

    ``plain_gradient`` is the same rule for a backward that records no graph (the default
    ``backward()``): an op may compute it on arrays and return constant Tensors, which skips
    one recorded-op dispatch per step. Its default is ``gradient``. An op that overrides it
    must give the same values as ``gradient`` (python_tests/ops/test_plain_gradient.py runs
    both for every op).

    ``held_arrays()`` names the arrays an op object itself keeps for its backward besides the
    saved tensors (a fused op's intermediates: batch statistics, gate activations), so that
    memory accounting counts them among what the graph saves. An op that holds arrays also
    defines ``release_held()``, which drops them: a backward without ``retain_graph`` calls
    it right after the node's own step, as it drops the node's saved tensors (a loss the
    caller still holds no longer keeps its op's arrays alive).
    """

    save_inputs: tuple[int, ...] | None = None
    save_output = False
    # see the class docstring: a method on ops that hold arrays, None on all others
    release_held: Callable[[], None] | None = None

    def held_arrays(self) -> tuple:
        """Arrays kept on the op for backward beyond ``saved_tensors`` (none by default)."""
        return ()

    def __call__(self, *args):
        raise NotImplementedError()

    def compute(self, *args):
        raise NotImplementedError()

    def gradient(self, out_grad, node):
        raise NotImplementedError()

    def plain_gradient(self, out_grad, node):
        """``gradient`` for a backward without ``create_graph`` (see the class docstring)."""
        return self.gradient(out_grad, node)

    def gradient_as_tuple(self, out_grad, node) -> tuple:
        """``gradient`` as a tuple (a TensorTuple counts as one value)."""
        output = self.gradient(out_grad, node)
        if isinstance(output, tuple):
            return output
        if isinstance(output, list):
            return tuple(output)
        return (output,)


def make_from_op(cls, op, inputs, _observe=True):
    """Run ``op`` now and record it when grad mode is on and some input requires grad.

    This is the hot path of every op call: keep it short (small models are dispatch-bound).
    """
    if _OBSERVER is not None and _observe:
        return _make_observed(cls, op, inputs)
    state = STATE
    if state.cast_policy is not None:  # needle.amp.autocast: the op's dtype rule (docs/amp.md)
        inputs = state.cast_policy(op, inputs)
    node = object.__new__(cls)
    if LAZY_MODE:
        node.op, node.inputs, node.cached_data = op, inputs, None
        node.requires_grad = any(x.requires_grad for x in inputs)
        node._seq = next(_SEQ)
        _watch(inputs)
        return node
    # eager mode: inputs are always realised; the class defaults (op None, inputs (),
    # requires_grad False) already describe an unrecorded result
    record = False
    if state.grad_enabled:
        for x in inputs:
            if x.requires_grad:
                record = True
                _MEM_STATE.op_category = "activation"
                break
        if record and _CANDIDATES and _ND:
            # release what only the graph still reaches before this op allocates: the
            # previous layer's unsaved output goes now, not after this op (release.py)
            _sweep()
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
        for x in inputs:  # _watch(inputs), inlined on the hot path
            if x.op is None:
                x._watched = True
        if state.saved_hooks is not None:
            node._saved = pack_saved(op, node, state.saved_hooks)
        if _ND:
            _track(node, op, inputs)  # free what backward won't read (release.py)
    return node


def _watch(inputs) -> None:
    """Mark the leaves among ``inputs`` as read by a recorded node (``Value._watched``)."""
    for x in inputs:
        if x.op is None:
            x._watched = True


def _make_observed(cls, op, inputs):
    """:func:`make_from_op` with the memory observer told before and after the compute."""
    observer = _OBSERVER
    token = observer.op_begin(op, inputs)
    node = None
    try:
        node = make_from_op(cls, op, inputs, False)
    finally:
        observer.op_end(token, node)
    return node


def leaf(cls, data):
    """A constant leaf of class ``cls`` around ``data`` (the fast ``make_const``)."""
    node = object.__new__(cls)
    node.cached_data = data
    return node


def describe(node) -> str:
    """A short human name for a node, used in error messages and hook notes."""
    op = type(node.op).__name__ if node.op is not None else "leaf"
    data = node.cached_data
    if node._is_tuple:
        return f"TensorTuple(len={len(data)}, op={op})"
    return f"Tensor(shape={tuple(data.shape)}, dtype={data.dtype}, op={op})"


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
    _tracked = False  # may be released once only the graph holds it (release.py)
    _links = 0  # consumers recorded with this node as an input, counted while tracked
    _keep = False  # some op saves this node's data for backward
    _data_log = None  # replacements of this tensor's data (autograd/versions.py)
    # A leaf that some recorded node took as an input (set then): a graph may have saved its
    # data, so replacing it must wake backward's saved-data check. Recorded nodes count as
    # watched through their op. See autograd/versions.py, note_replaced.
    _watched = False

    def realize_cached_data(self):
        """The backend array of this value (computed once from the inputs)."""
        if self.cached_data is None:
            self.cached_data = self.op.compute(*[x.realize_cached_data() for x in self.inputs])
        return self.cached_data

    def is_leaf(self) -> bool:
        return self.op is None

    def _init(self, op, inputs, *, num_outputs=1, cached_data=None, requires_grad=None):
        if requires_grad is None:
            requires_grad = any(x.requires_grad for x in inputs)
        self._seq = next(_SEQ)
        self.op = op
        self.inputs = inputs
        if op is not None:
            _watch(inputs)
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
        return make_from_op(cls, op, tuple(inputs))

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
            if idx is None:
                inputs = tuple(self.inputs)
            elif idx:
                inputs = tuple([self.inputs[i] for i in idx])
            else:  # save_inputs = (): every activation that saves only its output
                return (self,) if op.save_output else ()
            return inputs + (self,) if op.save_output else inputs
        unpack = saved[0]
        return tuple(self if p is SAVED_SELF else unpack(p) for p in saved[1])

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
