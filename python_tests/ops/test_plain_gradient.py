"""Every op's two gradient rules agree: ``gradient`` (Tensor ops, differentiable) and
``plain_gradient`` (what a backward without ``create_graph`` runs; arrays where an op has a
faster form). Each op class defined in needle/ops must be reached by some case below."""
from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest
from op_cases import CASES, make_inputs

import needle as ndl
import needle.ops as ops
from needle.autograd import Op, Tensor, TensorOp, enable_grad, no_grad
from needle.backend_ndarray import cpu, cpu_numpy
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")


def _other_device(device):
    if device != cpu_numpy():
        return cpu_numpy()
    return cpu() if cpu().enabled() else None


def _extra_cases(device):
    """(name, fn, input arrays, which inputs require grad) for ops the shared cases miss."""
    rng = np.random.default_rng(0)
    ids = np.array([[1, 4, 1], [6, 0, 1]], dtype=np.float64)  # id 1 three times
    cases = [
        ("embedding", ops.embedding, [rng.standard_normal((7, 3)), ids], [True, False]),
        ("astype", lambda a: ops.astype(a, "float32"), [rng.standard_normal((3, 4))], [True]),
        ("slice_scatter", lambda a: ops.SliceScatter((slice(1, 3, 1), slice(0, 4, 1)),
                                                     (5, 4))(a),
         [rng.standard_normal((2, 4))], [True]),
        ("tuple_get_item", lambda a: ops.split(a, 0)[1], [rng.standard_normal((3, 2))],
         [True]),
        ("lstm_cell", lambda *t: ops.FusedLSTMCell()(*t),
         [rng.standard_normal(s) for s in ((2, 3), (2, 2), (2, 2), (3, 8), (2, 8), (8,))],
         [True] * 6),
        ("lstm_layer", lambda *t: ops.FusedLSTMLayer()(*t),
         [rng.standard_normal(s) for s in ((3, 2, 3), (2, 2), (2, 2), (3, 8), (2, 8), (8,),
                                           (1, 8))],
         [True] * 7),
        ("batch_norm", lambda *t: ops.FusedBatchNorm(1e-5)(*t),
         [rng.standard_normal(s) for s in ((3, 2, 2, 2), (2,), (2,))], [True] * 3),
        ("softmax_xent", lambda z, y: ops.SoftmaxCrossEntropy()(z, y),
         [rng.standard_normal((4, 5)), np.array([0.0, 4.0, 2.0, 2.0])], [True, False]),
        ("softmax_xent_mean", lambda z, y: ops.SoftmaxCrossEntropy(mean=True)(z, y),
         [rng.standard_normal((4, 5)), np.array([3.0, 1.0, 2.0, 0.0])], [True, False]),
        ("batch_norm_rows", lambda *t: ops.FusedBatchNorm(1e-5)(*t),
         [rng.standard_normal(s) for s in ((5, 3), (3,), (3,))], [True, False, True]),
    ]
    other = _other_device(device)
    if other is not None:
        cases.append(("to_device", lambda a: ops.ToDevice(other)(a),
                      [rng.standard_normal((2, 3))], [True]))
    return cases


def _recorded_nodes(outputs) -> list:
    nodes, seen, stack = [], set(), list(outputs)
    while stack:
        node = stack.pop()
        if id(node) in seen or node.op is None:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(node.inputs)
    return nodes


def _outputs(value) -> list:
    if getattr(value, "_is_tuple", False):
        return [value] + [value[i] for i in range(len(value))]
    return [value]


def _random_grad(node, rng):
    def const(array):
        return Tensor(rng.standard_normal(array.shape), device=node.device
                      if not node._is_tuple else array.device, dtype=str(array.dtype),
                      requires_grad=False)

    data = node.realize_cached_data()
    if node._is_tuple:
        return ops.make_tuple(*[const(a) for a in data])
    return const(data)


def _as_tuple(grads) -> tuple:
    if isinstance(grads, (tuple, list)):
        return tuple(grads)
    return (grads,)


def _arrays(grad) -> list:
    data = grad.realize_cached_data()
    parts = data if grad._is_tuple else (data,)
    return [np.asarray(p.numpy()) for p in parts]


def compare_rules(node, rng) -> None:
    """Run both rules of ``node.op`` on one random output gradient and compare per input."""
    out_grad = _random_grad(node, rng)
    with enable_grad():
        by_tensors = _as_tuple(node.op.gradient(out_grad, node))
    with no_grad():
        plain = _as_tuple(node.op.plain_gradient(out_grad, node))
    name = type(node.op).__name__
    assert len(plain) == len(by_tensors) == len(node.inputs), name
    for i, (inp, want, have) in enumerate(zip(node.inputs, by_tensors, plain, strict=True)):
        if not inp.requires_grad:
            continue
        assert not have.requires_grad, f"{name}: plain gradient {i} carries a graph"
        for w, h in zip(_arrays(want), _arrays(have), strict=True):
            assert h.shape == w.shape and h.dtype == w.dtype, (name, i)
            np.testing.assert_allclose(h, w, rtol=1e-12, atol=1e-12, err_msg=f"{name} {i}")


def _run(fn, arrays, needs, device):
    xs = [Tensor(a, device=device, dtype="float64", requires_grad=need)
          for a, need in zip(arrays, needs, strict=True)]
    with enable_grad():
        out = fn(*xs)
    return xs, _outputs(out)


def _all_cases(device):
    for case in CASES:
        arrays = make_inputs(case)
        yield case.name, case.fn, arrays, [True] * len(arrays)
    yield from _extra_cases(device)


def test_both_rules_agree_for_every_recorded_op(device):
    rng = np.random.default_rng(0)
    reached = set()
    for _, fn, arrays, needs in _all_cases(device):
        xs, outs = _run(fn, arrays, needs, device)
        for node in _recorded_nodes(outs):
            reached.add(type(node.op))
            compare_rules(node, rng)
    missing = {cls.__name__ for cls in _op_classes()} - {cls.__name__ for cls in reached}
    assert not missing, f"ops with no case here (add one): {sorted(missing)}"


def _op_classes() -> set:
    classes = set()
    for info in pkgutil.iter_modules(ops.__path__):
        module = importlib.import_module(f"needle.ops.{info.name}")
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, Op)
                    and value.__module__ == module.__name__):
                classes.add(value)
    return classes


def test_the_comparison_catches_a_wrong_plain_rule(device):
    class Triple(TensorOp):
        save_inputs = ()

        def compute(self, a):
            return a * 3

        def gradient(self, out_grad, node):
            return out_grad * 3

        def plain_gradient(self, out_grad, node):  # planted bug: forgets the factor
            return Tensor.make_const(out_grad.cached_data)

    xs, outs = _run(lambda a: Triple()(a), [np.ones((2, 2))], [True], device)
    with pytest.raises(AssertionError):
        compare_rules(outs[0], np.random.default_rng(0))


def test_backward_runs_plain_rule_unless_create_graph(device):
    calls = []

    class Tagged(TensorOp):
        save_inputs = ()

        def compute(self, a):
            return a * 1

        def gradient(self, out_grad, node):
            calls.append("gradient")
            return out_grad

        def plain_gradient(self, out_grad, node):
            calls.append("plain")
            return out_grad

    x = ndl.Tensor([1.0, 2.0], device=device)
    Tagged()(x).sum().backward()
    Tagged()(x).sum().backward(create_graph=True)
    assert calls == ["plain", "gradient"]
