"""Split one backward pass into B (gradients of activations) and W (gradients of weights).

The zero-bubble schedules run B as soon as a stage's adjoint arrives, because the previous
stage waits for it, and delay W to fill time that would otherwise be idle. The engine already
knows which gradient is which: a graph node is *weight-side* when every input it was recorded
with that requires grad is a parameter or weight-side itself (``transpose(W)``,
``broadcast(reshape(bias))``); the other nodes are *activation-side*. An activation-side node
with weight-side inputs (``X @ W``, ``h + broadcast(b)``) is where the two meet.

* B: the weight-side inputs of those meeting nodes are switched to ``requires_grad=False`` and
  the engine runs backward with ``retain_graph=True``. It then neither enters the weight-side
  graph nor asks ops for those gradients: ``MatMul`` computes only ``dX = g W^T``. A hook on
  each meeting node keeps the gradient ``g`` that reached it.
* W: each meeting node's op is asked again for its gradient with ``g``, this time with its
  activation-side inputs switched off (``MatMul`` computes only ``dW = X^T g``); the result
  flows into the weight-side graph through the engine (``backward`` from that input), which
  accumulates ``.grad`` on the parameters.

Ops other than MatMul compute every input's gradient in both passes and the engine keeps the
needed ones: elementwise work, small next to the matmuls. B + W gives the same gradients as
one backward (the tests compare them).

Example:
    >>> import numpy as np, needle as ndl
    >>> W = ndl.Tensor(np.eye(2, dtype=np.float32))
    >>> x = ndl.Tensor(np.ones((1, 2), np.float32))
    >>> s = SplitBackward((x @ W).sum(), params=[W])
    >>> s.input_grad(); (x.grad.numpy().tolist(), W.grad)
    ([[1.0, 1.0]], None)
    >>> s.weight_grad(); W.grad.numpy().tolist()
    [[1.0, 1.0], [1.0, 1.0]]
"""
from __future__ import annotations

from typing import Any, Iterable

from needle.autograd import no_grad
from needle.memory import framework_category


def _walk(root: Any) -> list[Any]:
    """Requires-grad nodes reachable from ``root``, inputs before consumers."""
    order, seen, stack = [], {id(root)}, [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        stack.append((node, True))
        for inp in node.inputs:
            if inp.requires_grad and id(inp) not in seen:
                seen.add(id(inp))
                stack.append((inp, False))
    return order


class SplitBackward:
    """B and W of one backward from ``root`` (seeded with ``out_grad``), for ``params``."""

    def __init__(self, root: Any, params: Iterable[Any], out_grad: Any = None):
        self.root, self.out_grad = root, out_grad
        wanted = {id(p) for p in params}
        weight_side: set[int] = set()
        self.meeting: list[Any] = []  # activation-side nodes with weight-side inputs
        for node in _walk(root):
            grads = [x for x in node.inputs if x.requires_grad]
            if node.op is None:
                if id(node) in wanted:
                    weight_side.add(id(node))
            elif grads and all(id(x) in weight_side for x in grads):
                weight_side.add(id(node))
            elif any(id(x) in weight_side for x in grads):
                self.meeting.append(node)
        self.weight_side = weight_side
        self.root_is_weight_side = id(root) in weight_side
        self._seen: dict[int, Any] = {}
        self._done_b = self._done_w = False

    def input_grad(self) -> None:
        """B: backward through the activation-side graph only (sends adjoints, fills the
        gradients of inputs that are not parameters)."""
        if self._done_b:
            return
        self._done_b = True
        if self.root_is_weight_side:
            return  # nothing but weights behind the root: all of it is W's work
        switched = {id(x): x for n in self.meeting for x in n.inputs
                    if x.requires_grad and id(x) in self.weight_side}
        handles = [n.register_hook(self._keeper(n)) for n in self.meeting]
        for x in switched.values():
            x.requires_grad = False
        try:
            self.root.backward(self.out_grad, retain_graph=True)
        finally:
            for x in switched.values():
                x.requires_grad = True
            for h in handles:
                h.remove()

    def _keeper(self, node: Any):
        def keep(grad: Any) -> None:
            self._seen[id(node)] = grad

        return keep

    def weight_grad(self) -> None:
        """W: the weight gradients (accumulated into the parameters' ``.grad``)."""
        if not self._done_b:
            self.input_grad()
        if self._done_w:
            return
        self._done_w = True
        if self.root_is_weight_side:
            self.root.backward(self.out_grad)
            self._release()
            return
        targets: dict[int, tuple[Any, Any]] = {}
        with no_grad(), framework_category("gradient"):
            for node in self.meeting:
                grad = self._seen.get(id(node))
                if grad is None:
                    continue  # backward never reached this node (its output went unused)
                for i, part in self._weight_parts(node, grad):
                    x = node.inputs[i]
                    old = targets.get(id(x))
                    targets[id(x)] = (x, part if old is None else old[1] + part)
        for x, grad in sorted(targets.values(), key=lambda t: -t[0]._seq):
            x.backward(grad, retain_graph=True)
        self._release()

    def _weight_parts(self, node: Any, grad: Any) -> list[tuple[int, Any]]:
        inputs = node.inputs
        off = [x for x in inputs if x.requires_grad and id(x) not in self.weight_side]
        for x in off:
            x.requires_grad = False
        try:
            # the rule the engine runs in a backward that records no graph
            grads = node.op.plain_gradient(grad, node)
            if not isinstance(grads, tuple):
                grads = tuple(grads) if isinstance(grads, list) else (grads,)
        finally:
            for x in off:
                x.requires_grad = True
        return [(i, g) for i, (x, g) in enumerate(zip(inputs, grads, strict=True))
                if x.requires_grad and id(x) in self.weight_side and g is not None]

    def _release(self) -> None:
        self.root = self.out_grad = None
        self.meeting, self._seen = [], {}
