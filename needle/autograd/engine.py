"""The backward engine: dependency counting over the graph, hooks, freeing as it goes.

Nodes follow a small protocol (the engine never imports Tensor): ``op``, ``inputs``,
``requires_grad``, ``cached_data``, ``grad``, ``_seq`` (creation order), ``_freed``,
``_is_tuple``, ``_hooks``, ``_post_hooks``, ``_retains_grad`` and ``_saved`` (what
``Value._free_graph`` resets; the loop inlines it).

Order. Each node waits until every consumer inside this backward has handed it a partial
gradient (a dependency count per node). Among ready nodes the one created last runs first,
so gradients become ready in the reverse of the forward order. Leaves have nothing to run:
they are finished the moment they are ready, so a parameter's post-accumulate hook fires as
soon as its last consumer's backward step is done, before earlier layers run.

Freeing. Without ``retain_graph`` a node's links to its inputs are cut right after its own
backward step, and the engine keeps no list of all nodes: an activation that nobody else
references is released as soon as its last backward use is over.
"""
from __future__ import annotations

import heapq

from .._core.errors import DeviceError, DTypeError, GraphError, ShapeError
from ..backend_ndarray import NDArray as _NDArray
from ..memory import observers as _mem_observers
from .grad_mode import STATE

# The memory observer (needle.memory trace/record) or None; tested once per backward.
_OBSERVER = None


def _set_observer(observer) -> None:
    global _OBSERVER
    _OBSERVER = observer


_mem_observers.bind(_set_observer)


def describe(node) -> str:
    """A short human name for a node, used in error messages and hook notes."""
    op = type(node.op).__name__ if node.op is not None else "leaf"
    data = node.cached_data
    if node._is_tuple:
        return f"TensorTuple(len={len(data)}, op={op})"
    return f"Tensor(shape={tuple(data.shape)}, dtype={data.dtype}, op={op})"


def _count_dependencies(root) -> dict:
    """Number of consumers of every node reachable from ``root`` through requires-grad edges."""
    deps: dict[int, int] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node._freed:
            raise GraphError(
                f"backward: graph already freed at {type(node.op).__name__}, expected a graph "
                f"kept by retain_graph=True on the earlier backward, got a freed node")
        for inp in node.inputs:
            if inp.requires_grad:
                key = id(inp)
                if key in deps:
                    deps[key] += 1
                else:
                    deps[key] = 1
                    stack.append(inp)
    return deps


def _sum(parts):
    grad = parts[0]
    if not STATE.grad_enabled and not grad._is_tuple and len(parts) > 1:
        # plain backward: add the arrays and wrap once, instead of one recorded-op dispatch
        # per partial gradient (a parameter used n times has n of them)
        data = grad.cached_data
        for part in parts[1:]:
            data = data + part.cached_data
        return type(grad).make_const(data)
    for part in parts[1:]:
        grad = grad + part
    return grad


def _run_tensor_hooks(node, grad):
    for fn in list(node._hooks.values()):
        try:
            new = fn(grad)
        except Exception as exc:
            exc.add_note(f"in a hook registered on {describe(node)}")
            raise
        if new is not None:
            grad = new
    return grad


def _finish_leaf(leaf, grad, accumulate: bool) -> None:
    if leaf._hooks:
        grad = _run_tensor_hooks(leaf, grad)
    if accumulate and leaf.grad is not None:
        leaf.grad = leaf.grad + grad
    else:
        leaf.grad = grad
    if leaf._post_hooks:
        for fn in list(leaf._post_hooks.values()):
            try:
                fn(leaf)
            except Exception as exc:
                exc.add_note(f"in a post-accumulate-grad hook on {describe(leaf)}")
                raise


def check_gradients(node, grads, strict: bool) -> None:
    """Raise naming the op when ``grads`` do not match ``node.inputs`` (count, shape, dtype,
    device; dtype and device only when ``strict``). ``None`` is accepted for an input that
    does not require grad."""
    inputs = node.inputs
    if len(grads) != len(inputs):
        raise GraphError(
            f"{type(node.op).__name__}.gradient: wrong number of gradients, expected "
            f"{len(inputs)} (one per input), got {len(grads)}")
    for i, (inp, grad) in enumerate(zip(inputs, grads, strict=False)):
        if not inp.requires_grad:
            continue
        if grad is None or inp._is_tuple or getattr(grad, "_is_tuple", True):
            _check_unusual(node, i, inp, grad)
            continue
        have, want = grad.cached_data, inp.cached_data
        if strict and type(have) is _NDArray and type(want) is _NDArray:
            # the common nd case, read from the fields: this runs for every edge of a backward
            if (have._shape != want._shape or have._device is not want._device
                    or have._handle.dtype != want._handle.dtype):
                _check_arrays(node, i, have, want, strict)
            continue
        _check_arrays(node, i, have, want, strict)


def _check_arrays(node, i, have, want, strict: bool) -> None:
    if have.shape != want.shape:
        _mismatch(ShapeError, node, i, "shape", tuple(want.shape), tuple(have.shape))
    if strict:
        if have.dtype != want.dtype:
            _mismatch(DTypeError, node, i, "dtype", want.dtype, have.dtype)
        if have.device != want.device:
            _mismatch(DeviceError, node, i, "device", want.device, have.device)


def _mismatch(error, node, i, what, expected, got):
    raise error(f"{type(node.op).__name__}.gradient: wrong gradient {what} for input {i}, "
                f"expected {expected}, got {got}")


def _check_unusual(node, i, inp, grad) -> None:
    """Checks for tuple-valued inputs and for missing or non-Value gradients."""
    kind = getattr(grad, "_is_tuple", None)
    if kind is not inp._is_tuple:
        _mismatch(GraphError, node, i, "type", type(inp).__name__, type(grad).__name__)
    # len(grad), not len(grad.cached_data): a sparse tuple gradient stays unmaterialised
    if inp._is_tuple and len(grad) != len(inp.cached_data):
        _mismatch(ShapeError, node, i, "tuple length", len(inp.cached_data), len(grad))


def run_backward(root, grad, *, retain_graph: bool, create_graph: bool, accumulate: bool,
                 grad_all_nodes: bool, strict: bool) -> None:
    """Propagate ``grad`` (d root) to every requires-grad node reachable from ``root``.

    ``accumulate``: add into a leaf's existing ``.grad`` (PyTorch) instead of assigning it.
    ``grad_all_nodes``: set ``.grad`` on non-leaf nodes too (the course's contract).
    ``strict``: also check gradient dtypes and devices.
    """
    prev = STATE.grad_enabled
    STATE.grad_enabled = create_graph
    observer = _OBSERVER
    if observer is not None:
        observer.backward_begin()
    try:
        if root.op is None:
            _finish_leaf(root, grad, accumulate)
            return
        _propagate(root, grad, retain_graph, accumulate, grad_all_nodes, strict, observer)
    finally:
        STATE.grad_enabled = prev
        if observer is not None:
            observer.backward_end()


def _propagate(root, grad, retain_graph, accumulate, grad_all_nodes, strict,
               observer=None) -> None:
    # One flat loop on purpose: this runs once per node of every backward, and small models
    # are dispatch-bound (PERF_NOTES), so checks and delivery are inlined here.
    deps = _count_dependencies(root)
    pending = {id(root): [grad]}
    heap = [(-root._seq, root)]
    del grad
    heappop, heappush = heapq.heappop, heapq.heappush
    while heap:
        node = heappop(heap)[1]
        if observer is not None:
            token = observer.node_begin(node)  # must not keep ``node`` alive
        parts = pending.pop(id(node))
        grad = parts[0] if len(parts) == 1 else _sum(parts)
        if node._hooks:
            grad = _run_tensor_hooks(node, grad)
        if grad_all_nodes or node._retains_grad:
            node.grad = grad
        grads = node.op.gradient(grad, node)
        if type(grads) is not tuple:
            grads = tuple(grads) if isinstance(grads, list) else (grads,)
        check_gradients(node, grads, strict)
        inputs = node.inputs
        if not retain_graph:
            # cut the links now: inputs nobody else holds are released as soon as they are
            # processed themselves, so backward memory falls as it proceeds
            node.inputs = ()
            node._saved = None
            node._freed = True
        del node, grad, parts
        for inp, part in zip(inputs, grads, strict=False):
            if not inp.requires_grad:
                continue
            key = id(inp)
            parts = pending.get(key)
            if parts is None:
                pending[key] = [part]
            else:
                parts.append(part)
            left = deps[key] - 1
            deps[key] = left
            if left == 0:
                if inp.op is None:
                    _finish_leaf(inp, _sum(pending.pop(key)), accumulate)
                else:
                    heappush(heap, (-inp._seq, inp))
        inputs = grads = inp = part = parts = None
        if observer is not None:
            observer.node_end(token)
