"""One checkpoint region: a graph node that stands for ``fn(*args)`` and recomputes it in backward.

The region is an ordinary op in the outer graph (no engine special case). Its inputs are one
*slot per graph edge* that leaves the region towards a tensor that requires grad (the region's
tensor arguments and every tensor ``fn`` reads from outside, such as module parameters), in the
order the engine would hand those edges their gradients. Its ``gradient`` recomputes ``fn``,
points each such edge at a fresh leaf (a proxy), runs the engine over the recomputed segment
alone and returns the proxies' gradients. Consequences:

* the outer engine sums the partial gradients of a shared parameter in exactly the order it
  would without checkpointing, so gradients are bitwise equal, and a parameter's hooks fire once
  (when its gradient is final), however many regions read it;
* the first forward records the region's graph only to find those edges: it runs under
  saved-tensor hooks that keep nothing, so autograd's release (``needle/autograd/release.py``)
  drops each array as soon as only the graph reaches it, and the forward keeps no more than a
  ``no_grad`` forward would.

The region talks to the engine only through its public sub-graph entry points
(:func:`~needle.autograd.engine.graph_mark`, ``boundary_edges``, ``edge_gradients``).

Example:
    >>> import numpy as np
    >>> from needle import ops
    >>> from needle.autograd import Tensor
    >>> w = Tensor(np.ones((2, 2), dtype="float32"))
    >>> y = checkpoint(lambda x: ops.relu(x @ w), Tensor(np.ones((1, 2), dtype="float32")))
    >>> y.sum().backward(); w.grad.numpy().tolist()
    [[1.0, 1.0], [1.0, 1.0]]
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import time

import numpy as np

from .. import memory, ops
from .. import random as ndl_random
from .._core.errors import CheckpointError
from ..autograd import Tensor, TensorOp, TensorTuple, TensorTupleOp, Value, saved_tensors_hooks
from ..autograd.engine import boundary_edges, edge_gradients, graph_mark, recorded_after
from ..autograd.grad_mode import STATE, enable_grad
from ..autograd.versions import check_kept
from .state import ModuleState, modules_of

__all__ = ["checkpoint", "is_recomputing", "recompute_seconds"]


class _Local(threading.local):
    recomputing = 0
    seconds = 0.0  # wall time spent recomputing in this thread (outermost regions)


_LOCAL = _Local()


def is_recomputing() -> bool:
    """True while a checkpoint region is being recomputed in backward (in this thread).

    Stateful code that should act once per step (a counter, a statistics update) can test it.

    Example:
        >>> is_recomputing()
        False
    """
    return _LOCAL.recomputing > 0


def recompute_seconds() -> float:
    """Wall time this thread has spent recomputing regions so far (the report's measured
    recompute: differences of this around a backward)."""
    return _LOCAL.seconds


@contextlib.contextmanager
def _recomputing():
    outermost = _LOCAL.recomputing == 0
    start = time.perf_counter() if outermost else 0.0
    _LOCAL.recomputing += 1
    try:
        yield
    finally:
        _LOCAL.recomputing -= 1
        if outermost:
            _LOCAL.seconds += time.perf_counter() - start


def _fingerprint(data) -> tuple:
    array = data.numpy() if hasattr(data, "numpy") else data
    array = np.ascontiguousarray(np.asarray(array))
    return (tuple(array.shape), str(array.dtype), hashlib.blake2b(array.tobytes(),
                                                                   digest_size=16).hexdigest())


def _save_nothing(tensor):
    return None


def _unpack_unavailable(packed):
    raise CheckpointError(
        "checkpoint: backward through the first forward of a checkpoint region, expected "
        "gradients to flow through the region's checkpoint node, got a direct use of its "
        "internal graph")


class _RegionOp(TensorOp):
    """The checkpoint node of a region with one tensor output."""

    save_inputs = ()

    def __init__(self, region: "_Region"):
        self.region = region
        self.output = None

    def compute(self, *arrays):
        out, self.output = self.output, None
        return out

    def gradient(self, out_grad, node):
        arrays = node._saved[1]
        self.region.attach_arrays(arrays)  # the boundary comes back from the node's slot
        check_kept(node, self.region.kept, f"checkpoint region {self.region.name!r}")
        return self.region.backward([out_grad], arrays)


class _RegionTupleOp(TensorTupleOp, _RegionOp):  # TensorTupleOp first: its __call__
    """The checkpoint node of a region with several tensor outputs."""

    def gradient(self, out_grad, node):
        arrays = node._saved[1]
        self.region.attach_arrays(arrays)  # the boundary comes back from the node's slot
        check_kept(node, self.region.kept, f"checkpoint region {self.region.name!r}")
        return self.region.backward([out_grad[i] for i in range(len(node.cached_data))],
                                    arrays)


def _same(packed):
    return packed


class _Region:
    """Everything a region keeps between its forward and its backward."""

    def __init__(self, fn, args: tuple, preserve_rng_state: bool, verify: bool, name: str):
        self.fn, self.preserve, self.verify, self.name = fn, preserve_rng_state, verify, name
        # the arrays of the tensor arguments are the region's boundary: all it keeps
        self.args = [(a.realize_cached_data(), a.requires_grad, a._is_tuple)
                     if isinstance(a, Value) else a for a in args]
        self.is_tensor = [isinstance(a, Value) for a in args]
        self.modules = ModuleState(modules_of(fn, args))
        self.rng_state = None
        self.slots: list = []  # ("arg", j) or ("captured", tensor), one per edge
        self.record = None

    def kept(self) -> list:
        """What the recomputation will read: the arguments' arrays, the captured tensors and
        the module arrays of the snapshot (autograd's version check looks at them first)."""
        out = [(f"argument {j}", a[0]) for j, (a, is_tensor) in
               enumerate(zip(self.args, self.is_tensor, strict=True)) if is_tensor]
        captured = [s[1] for s in self.slots if s[0] == "captured"]
        out += [(f"captured tensor {k}", t) for k, t in enumerate(captured)]
        out += [(f"module attribute {key!r}", data)
                for key, data in self.modules.snapshot_arrays()]
        return out

    # -- shared by forward and recomputation ------------------------------------------------
    def _fresh_args(self) -> list:
        out = []
        for a, is_tensor in zip(self.args, self.is_tensor, strict=True):
            if is_tensor:
                data, requires_grad, is_tuple = a
                cls = TensorTuple if is_tuple else Tensor
                a = cls.make_const(data, requires_grad=requires_grad)
            out.append(a)
        return out

    def _run(self, keep_saved: bool):
        """Run ``fn`` on fresh argument leaves, recording its graph (keeping what its ops save
        only when ``keep_saved``: the first forward needs the graph's structure alone)."""
        leaves = self._fresh_args()
        mark = graph_mark()
        draws = ndl_random.observe_draws() if self.verify else contextlib.nullcontext([])
        saving = (contextlib.nullcontext() if keep_saved
                  else saved_tensors_hooks(_save_nothing, _unpack_unavailable))
        with enable_grad(), saving, draws as seen:
            result = self.fn(*leaves)
        outputs, structure = _flatten(result, self.name)
        return leaves, mark, result, outputs, structure, seen

    def _slot_of(self, tensor, leaves) -> tuple:
        for j, leaf in enumerate(leaves):
            if leaf is tensor:
                return ("arg", j)
        return ("captured", tensor)

    def _signature(self, edges, leaves) -> list:
        return [self._slot_of(ext, leaves) for _, _, ext in edges]

    # -- forward -------------------------------------------------------------------------------
    def forward(self, original_args: tuple):
        if self.preserve:
            self.rng_state = ndl_random.get_state()
        self.modules.capture_before()
        leaves, mark, result, outputs, structure, draws = self._run(keep_saved=False)
        if self.verify:
            self.record = _Record(outputs, draws)
        edges = boundary_edges([o for o in outputs if _is_tensor(o)], mark)
        self.slots = self._signature(edges, leaves)
        slot_tensors = [original_args[s[1]] if s[0] == "arg" else s[1] for s in self.slots]
        return _rebuild(self, outputs, structure, leaves, mark, original_args, slot_tensors)

    # -- where the boundary lives between forward and backward ---------------------------------
    # The argument arrays move to the region's node (its saved slot) once the node exists: a
    # backward without retain_graph frees that slot like any op's saved tensors, so the
    # boundary goes with the graph even while the caller keeps the region's output.
    def detach_arrays(self) -> list:
        arrays = [a[0] if t else None for a, t in zip(self.args, self.is_tensor, strict=True)]
        self.args = [(None, a[1], a[2]) if t else a
                     for a, t in zip(self.args, self.is_tensor, strict=True)]
        return arrays

    def attach_arrays(self, arrays: list) -> None:
        self.args = [(arr, a[1], a[2]) if t else a
                     for arr, a, t in zip(arrays, self.args, self.is_tensor, strict=True)]

    # -- backward ------------------------------------------------------------------------------
    def backward(self, out_grads: list, arrays: list) -> tuple:
        self.attach_arrays(arrays)
        try:
            return self._backward(out_grads)
        finally:
            self.detach_arrays()

    def _backward(self, out_grads: list) -> tuple:
        create_graph = STATE.grad_enabled
        with ndl_random.fork_rng(enabled=self.preserve), self.modules.replay(), _recomputing():
            if self.preserve:
                ndl_random.set_state(self.rng_state)
            with memory.categories.as_forward():  # the categories of the first forward
                leaves, mark, _, outputs, _, draws = self._run(keep_saved=True)
            if self.verify:
                self.record.compare(self.name, outputs, draws)
        edges = boundary_edges([o for o in outputs if _is_tensor(o)], mark)
        signature = self._signature(edges, leaves)
        if not _same_slots(signature, self.slots):
            raise CheckpointError(
                f"checkpoint: region {self.name!r} read different tensors when recomputed, "
                f"expected {len(self.slots)} edges to {_describe_slots(self.slots)}, got "
                f"{len(signature)} edges to {_describe_slots(signature)}")
        roots = [o for o in outputs
                 if _is_tensor(o) and o.requires_grad and recorded_after(o, mark)]
        return _backprop(roots, out_grads, edges, create_graph)


def _is_tensor(value) -> bool:
    return isinstance(value, Value)


def _same_slots(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and x[1] is y[1] if x[0] == "captured"
                                    else x == y for x, y in zip(a, b, strict=True))


def _describe_slots(slots: list) -> str:
    return "[" + ", ".join(f"arg {s[1]}" if s[0] == "arg" else
                           f"captured tensor shape {s[1].shape}" for s in slots) + "]"


def _flatten(result, name: str):
    if isinstance(result, (tuple, list)):
        return list(result), type(result)
    return [result], None


def _rebuild(region, outputs, structure, leaves, mark, original_args, slot_tensors):
    """The values ``checkpoint`` returns: outputs that carry gradient come out of the region's
    node; outputs that were inputs come back as the caller's own objects; the rest detached."""
    grad_positions = [i for i, o in enumerate(outputs)
                      if _is_tensor(o) and o.requires_grad and recorded_after(o, mark)]
    final = []
    for o in outputs:
        if not _is_tensor(o):
            final.append(o)
        elif not recorded_after(o, mark):
            slot = region._slot_of(o, leaves)
            final.append(original_args[slot[1]] if slot[0] == "arg" else o)
        else:
            final.append(type(o).make_const(o.realize_cached_data()))
    if grad_positions and slot_tensors:
        for i, value in zip(grad_positions, _region_node(region, outputs, grad_positions,
                                                         slot_tensors), strict=True):
            final[i] = value
    return final[0] if structure is None else structure(final)


def _region_node(region, outputs, positions, slot_tensors) -> list:
    if len(positions) == 1 and not outputs[positions[0]]._is_tuple:
        op = _RegionOp(region)
        op.output = outputs[positions[0]].realize_cached_data()
        node = op(*slot_tensors)
        node._saved = (_same, region.detach_arrays())
        _keep_boundary(node)
        return [node]
    op = _RegionTupleOp(region)
    op.output = tuple(outputs[i].realize_cached_data() for i in positions)
    node = op(*slot_tensors)
    node._saved = (_same, region.detach_arrays())
    _keep_boundary(node)
    return [node[k] for k in range(len(positions))]


def _keep_boundary(node) -> None:
    # The region's output stays with its node until the node is freed, whatever else holds
    # it. No op saves it, so autograd's release would otherwise free it once only graph links
    # reach it, but only if that happened within its first sweeps (release.py looks at a
    # tensor a bounded number of times), so whether the boundary outlived the next region's
    # forward depended on how many ops that forward recorded. The checkpoint planner's cost
    # model counts it as held while the region's backward recomputes (needle.checkpoint.plan).
    node._keep = True


def _backprop(roots, out_grads, edges, create_graph: bool) -> tuple:
    """Backpropagate through the recomputed segment only; return one gradient per edge."""
    if len(roots) == 1:
        root, grad = roots[0], out_grads[0]
    else:
        with enable_grad():
            root = ops.make_tuple(*roots)
        grad = ops.make_tuple(*out_grads)
    del roots
    grads = edge_gradients(root, grad, edges, create_graph=create_graph)
    if any(g is None for g in grads):
        raise CheckpointError(
            "checkpoint: an edge of the recomputed region received no gradient, expected one "
            "gradient per edge, got None")
    return grads


class _Record:
    """``verify=True``: shape, dtype and hash of every output and every draw of the forward."""

    def __init__(self, outputs, draws):
        self.outputs = [_fingerprint(o.realize_cached_data()) if _is_tensor(o) else None
                        for o in outputs]
        self.draws = [(kind, device, _fingerprint(value)) for kind, device, value in draws]
        self.rng_after = ndl_random.get_state()

    def compare(self, name: str, outputs, draws) -> None:
        if len(draws) != len(self.draws):
            raise CheckpointError(
                f"checkpoint: region {name!r} made a different number of random draws when "
                f"recomputed, expected {len(self.draws)}, got {len(draws)}")
        for k, ((kind, _device, value), want) in enumerate(zip(draws, self.draws, strict=True)):
            _compare(name, f"random draw {k} ({want[0]} on {want[1]})", want[2],
                     _fingerprint(value), kind_have=kind, kind_want=want[0])
        if not _same_state(self.rng_after, ndl_random.get_state()):
            raise CheckpointError(
                f"checkpoint: region {name!r} left the random stream at a different position "
                f"when recomputed, expected the position after the first forward, got another "
                f"(a draw that bypasses needle.random differs in number or size)")
        if len(outputs) != len(self.outputs):
            raise CheckpointError(
                f"checkpoint: region {name!r} returned a different number of outputs when "
                f"recomputed, expected {len(self.outputs)}, got {len(outputs)}")
        for k, (out, want) in enumerate(zip(outputs, self.outputs, strict=True)):
            if want is not None:
                _compare(name, f"output {k}", want, _fingerprint(out.realize_cached_data()))


def _compare(name, what, want, have, kind_have=None, kind_want=None) -> None:
    if kind_have != kind_want:
        raise CheckpointError(f"checkpoint: region {name!r} {what} differs in kind, expected "
                              f"{kind_want}, got {kind_have}")
    for label, i in (("shape", 0), ("dtype", 1), ("values", 2)):
        if want[i] != have[i]:
            detail = (f"hash {want[i]}", f"hash {have[i]}") if i == 2 else (want[i], have[i])
            raise CheckpointError(
                f"checkpoint: region {name!r} {what} differs in {label} when recomputed, "
                f"expected {detail[0]}, got {detail[1]}")


def _same_state(a, b) -> bool:
    if set(a) != set(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple) and isinstance(y, tuple):
            if len(x) != len(y) or not all(np.array_equal(p, q) if isinstance(p, np.ndarray)
                                           else p == q for p, q in zip(x, y, strict=True)):
                return False
        elif x != y:
            return False
    return True


def checkpoint(fn, *args, preserve_rng_state: bool = True, verify: bool = False,
               name: str | None = None):
    """Run ``fn(*args)`` keeping only its inputs; recompute it in backward.

    Args:
        fn: a callable (a Module, a function, a lambda) of tensors and other values; it returns
            a Tensor or a tuple/list of values.
        args: its positional arguments; Tensors among them are the region's saved inputs.
        preserve_rng_state: restore the random state of the first forward before recomputing
            (so dropout masks repeat) and give the outer stream back afterwards.
        verify: record shape, dtype and a hash of every output and every random draw, and
            raise :class:`CheckpointError` if the recomputation differs.
        name: the region's name in error messages (default: ``fn``'s name).

    Returns:
        what ``fn`` returns, with gradient flowing through a single checkpoint node.

    Raises:
        CheckpointError: the recomputation read other tensors, or (``verify``) produced other
            outputs or draws, than the first forward.

    Example:
        >>> import numpy as np
        >>> from needle import nn
        >>> from needle.autograd import Tensor
        >>> np.random.seed(0); layer = nn.Linear(3, 2)
        >>> y = checkpoint(layer, Tensor(np.ones((4, 3), dtype="float32")))
        >>> y.sum().backward(); layer.weight.grad.shape
        (3, 2)
    """
    if not STATE.grad_enabled:
        return fn(*args)
    label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    region = _Region(fn, args, preserve_rng_state, verify, label)
    return region.forward(args)
