"""The backward engine: dependency counting over the graph, hooks, freeing as it goes.

Nodes follow a small protocol (the engine never imports Tensor): ``op``, ``inputs``,
``requires_grad``, ``cached_data``, ``grad``, ``_seq`` (creation order), ``_freed``,
``_is_tuple``, ``_hooks``, ``_post_hooks``, ``_retains_grad`` and ``_saved`` (see
``value.py``). The walk is ``Tensor.backward`` -> :func:`backward` -> :func:`run_backward` ->
each node's ``op.gradient`` (``op.plain_gradient`` when no graph is recorded).

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
import threading
from functools import reduce
from operator import add

from .._core.errors import DeviceError, DTypeError, GraphError, ShapeError, add_note
from .._core.versions import LAST as _LAST_CHANGE
from ..backend_ndarray import NDArray as _NDArray
from ..backend_selection import BACKEND
from ..memory import categories as _mem_categories
from ..memory import observers as _mem_observers
from . import release
from .grad_mode import STATE
from .value import _SEQ, describe
from .versions import check_saved

__all__ = ["backward", "compute_gradient_of_variables", "run_backward", "find_topo_sort",
           "topo_sort_dfs", "sum_node_list", "check_gradients", "describe", "graph_mark",
           "recorded_after", "boundary_edges", "edge_gradients", "prepare_backward"]

_ND = BACKEND == "nd"
# The memory observer (needle.memory trace/record) or None; tested once per backward.
_OBSERVER = None


def _set_observer(observer) -> None:
    global _OBSERVER
    _OBSERVER = observer


_mem_observers.bind(_set_observer)


def _count_dependencies(root, stops=None) -> dict:
    """Number of consumers of every node reachable from ``root`` through requires-grad edges
    (``stops``: edges ``(id(consumer), index)`` the walk does not cross)."""
    deps: dict[int, int] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node._freed:
            raise GraphError(
                f"backward: graph already freed at {type(node.op).__name__}, expected a graph "
                f"kept by retain_graph=True on the earlier backward, got a freed node")
        inputs = node.inputs
        if stops is not None:
            inputs = [x for i, x in enumerate(inputs) if (id(node), i) not in stops]
        for inp in inputs:
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


# How many times any tensor or post-accumulate hook ran: needle.compile compares it around
# a recorded step (a hook is Python that a kernel replay would not run).
HOOK_CALLS = [0]


def _run_tensor_hooks(node, grad):
    HOOK_CALLS[0] += 1
    for fn in list(node._hooks.values()):
        try:
            new = fn(grad)
        except Exception as exc:
            add_note(exc, f"in a hook registered on {describe(node)}")
            raise
        if new is not None:
            grad = new
    return grad


# Accumulation into a leaf's ``.grad`` is a read-add-assign: two threads running backward
# into one leaf would lose contributions. Each leaf maps to one of these locks (by identity;
# leaves sharing a lock only wait for each other), so the read-add-assign is atomic per leaf.
_ACCUMULATE_LOCKS = tuple(threading.Lock() for _ in range(64))


def _finish_leaf(leaf, grad, accumulate: bool) -> None:
    if leaf._hooks:
        grad = _run_tensor_hooks(leaf, grad)
    if accumulate:
        with _ACCUMULATE_LOCKS[(id(leaf) >> 4) & 63]:
            old = leaf.grad
            leaf.grad = grad if old is None else old + grad
    else:
        leaf.grad = grad
    if leaf._post_hooks:
        HOOK_CALLS[0] += 1
        for fn in list(leaf._post_hooks.values()):
            try:
                fn(leaf)
            except Exception as exc:
                add_note(exc, f"in a post-accumulate-grad hook on {describe(leaf)}")
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
    for i, (inp, grad) in enumerate(zip(inputs, grads)):  # noqa: B905 - lengths checked above
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


class _Edges:
    """What :func:`check_gradients` reads of a node (its op and inputs), kept once the
    engine has cut the node's links."""

    __slots__ = ("op", "inputs")

    def __init__(self, op, inputs):
        self.op, self.inputs = op, inputs


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
                 grad_all_nodes: bool, strict: bool, capture=None) -> None:
    """Propagate ``grad`` (d root) to every requires-grad node reachable from ``root``.

    ``create_graph``: record the backward itself (ops' ``gradient``); else ops may use their
    ``plain_gradient``. ``accumulate``: add into a leaf's existing ``.grad`` (PyTorch) instead
    of assigning it. ``grad_all_nodes``: set ``.grad`` on non-leaf nodes too (the course's
    contract). ``strict``: also check gradient dtypes and devices. ``capture``: see
    :func:`edge_gradients`.
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
        _propagate(root, grad, retain_graph, create_graph, accumulate, grad_all_nodes, strict,
                   observer, capture)
    finally:
        STATE.grad_enabled = prev
        if observer is not None:
            observer.backward_end()


def _propagate(root, grad, retain_graph, create_graph, accumulate, grad_all_nodes, strict,
               observer=None, capture=None) -> None:
    # One flat loop on purpose: this runs once per node of every backward, and small models
    # are dispatch-bound, so checks and delivery are inlined here.
    deps = _count_dependencies(root, None if capture is None else capture.stops)
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
        if _LAST_CHANGE[0] > node._seq:
            # some data changed since this node was recorded: was it data the op saved?
            check_saved(node)
        if create_graph:
            grads = node.op.gradient(grad, node)
        else:
            grads = node.op.plain_gradient(grad, node)
        if type(grads) is not tuple:
            grads = tuple(grads) if isinstance(grads, list) else (grads,)
        inputs = node.inputs
        op = node.op
        if not strict or len(grads) != len(inputs) or capture is not None:
            check_gradients(node, grads, strict)  # else checked edge by edge below
            if capture is not None and id(node) in capture.consumers:
                inputs = capture.take(node, inputs, grads)
        if not retain_graph:
            # cut the links now: inputs nobody else holds are released as soon as they are
            # processed themselves, so backward memory falls as it proceeds
            node.inputs = ()
            if node._saved is not None:  # (a new key in the node's dict costs more than a read)
                node._saved = None
            if op.release_held is not None:  # arrays a fused op keeps for its backward
                op.release_held()
            node._freed = True
        del node, grad, parts
        # plain zip (lengths already checked equal): strict=False, a keyword argument, sends
        # zip through its slow constructor path, 0.24 µs more per node
        for inp, part in zip(inputs, grads):  # noqa: B905
            if not inp.requires_grad:
                continue
            if strict:
                # check_gradients' common case inlined (this runs for every edge): arrays
                # of the input's shape, device and dtype. Anything else takes the full check,
                # tuples first: reading a sparse tuple gradient's data would build its zeros
                if part is None or inp._is_tuple or getattr(part, "_is_tuple", True):
                    check_gradients(_Edges(op, inputs), grads, strict)
                else:
                    have, want = part.cached_data, inp.cached_data
                    if (type(have) is not _NDArray or type(want) is not _NDArray
                            or have._shape != want._shape or have._device is not want._device
                            or have._handle.dtype != want._handle.dtype):
                        check_gradients(_Edges(op, inputs), grads, strict)
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
                    parts = pending.pop(key)
                    _finish_leaf(inp, parts[0] if len(parts) == 1 else _sum(parts), accumulate)
                else:
                    heappush(heap, (-inp._seq, inp))
        # nothing of this node outlives its step (an op may hold arrays: SoftmaxCrossEntropy)
        inputs = grads = inp = part = parts = have = want = op = None
        if observer is not None:
            observer.node_end(token)


# ----- entry points ---------------------------------------------------------------------------
def prepare_backward() -> None:
    """Before a backward: release what only the graph still holds (the forward's locals are
    gone by now, so this is the last chance; see ``release.py``)."""
    if _ND:
        release.sweep(final=True)


def backward(root, grad, *, retain_graph=None, create_graph=None) -> None:
    """The walk behind ``Tensor.backward`` once the seed ``grad`` is built.

    nd mode (PyTorch's meaning): ``retain_graph`` and ``create_graph`` default to False and
    leaves accumulate into ``.grad``. np mode (the course's): both default to True and every
    node on the way gets ``.grad`` assigned.
    """
    if not _ND:
        retain_graph = True if retain_graph is None else retain_graph
        create_graph = True if create_graph is None else create_graph
        run_backward(root, grad, retain_graph=retain_graph, create_graph=create_graph,
                     accumulate=False, grad_all_nodes=True, strict=False)
        return
    run_backward(root, grad, retain_graph=bool(retain_graph), create_graph=bool(create_graph),
                 accumulate=True, grad_all_nodes=False, strict=True)


def compute_gradient_of_variables(output_tensor, out_grad) -> None:
    """The course's engine contract: ``.grad`` assigned on every node, built with graph.

    Equivalent to ``output_tensor.backward(out_grad, retain_graph=True, create_graph=True)``
    in np mode: gradients are Tensors with their own graph (gradient of gradient works) and
    every node on the way, leaf or not, gets ``.grad`` assigned (not accumulated).
    """
    with _mem_categories.framework_category("gradient"):
        run_backward(output_tensor, out_grad, retain_graph=True, create_graph=True,
                     accumulate=False, grad_all_nodes=True, strict=_ND)


# ----- sub-graphs: what a checkpoint region needs -----------------------------------------------
def graph_mark() -> int:
    """A point in creation order: nodes made after this call are :func:`recorded_after` it.

    Example:
        >>> import needle as ndl
        >>> before = ndl.Tensor([1.0]); mark = graph_mark(); y = before * 2
        >>> recorded_after(y, mark), recorded_after(before, mark)
        (True, False)
    """
    return next(_SEQ)


def recorded_after(node, mark: int) -> bool:
    """True when ``node`` was recorded by an op (or made as a leaf) after :func:`graph_mark`."""
    return node._seq > mark


def boundary_edges(outputs, mark: int) -> list:
    """Edges ``(consumer, input index, input)`` from nodes recorded after ``mark`` to
    requires-grad nodes made before it, found from ``outputs``, in the order the engine hands
    those edges their gradients (later consumers first, then by input index).

    These are the points where a sub-graph recorded after ``mark`` (a checkpoint region) meets
    the rest of the graph.
    """
    edges, seen, stack = [], set(), [o for o in outputs if o._seq > mark]
    while stack:
        node = stack.pop()
        if id(node) in seen or node.op is None or not node.requires_grad:
            continue
        seen.add(id(node))
        for i, inp in enumerate(node.inputs):
            if not inp.requires_grad:
                continue
            if inp._seq <= mark:
                edges.append((node, i, inp))
            else:
                stack.append(inp)
    edges.sort(key=lambda e: (-e[0]._seq, e[1]))
    return edges


class _Capture:
    """Edges whose gradient :func:`edge_gradients` returns instead of passing it on."""

    def __init__(self, edges):
        self.stops = {(id(c), i) for c, i, _ in edges}
        self.consumers: dict[int, list] = {}
        for slot, (consumer, index, _) in enumerate(edges):
            self.consumers.setdefault(id(consumer), []).append((index, slot))
        self.grads: list = [None] * len(edges)

    def take(self, node, inputs, grads):
        # keyed by id: a consumer stays alive until the engine processes it (it is reachable
        # from the pending frontier), so its id cannot be reused before this lookup
        stopped = list(inputs)
        for index, slot in self.consumers.pop(id(node)):
            self.grads[slot] = grads[index]
            stopped[index] = _STOP
        return stopped


class _Stop:
    requires_grad = False


_STOP = _Stop()


def edge_gradients(root, grad, edges, *, create_graph: bool) -> tuple:
    """Backpropagate ``grad`` from ``root`` and return the gradient reaching each edge.

    ``edges`` are ``(consumer, input index, input)`` triples (:func:`boundary_edges`). The walk
    stops at them: their inputs and everything behind are not visited and get no ``.grad``;
    the partial gradient each edge carries is returned, one per edge, in order (None where
    none arrived). The graph below ``root`` is freed as by a plain backward.
    """
    prepare_backward()
    capture = _Capture(edges)
    run_backward(root, grad, retain_graph=False, create_graph=create_graph, accumulate=False,
                 grad_all_nodes=False, strict=_ND, capture=capture)
    return tuple(capture.grads)


# ----- the course's graph helpers -------------------------------------------------------------
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
    return reduce(add, node_list)
