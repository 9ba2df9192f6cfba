"""Numerical gradient check: backward vs central differences, in float64.

The output (a Tensor or TensorTuple) is reduced to a scalar ``L = Σ w·out`` with fixed random
weights ``w``; ``backward`` gives dL/dx. Small inputs are checked element by element; inputs
with more than ``elementwise_limit`` elements along ``directions`` random unit directions
``v`` (``(L(x+εv) − L(x−εv)) / 2ε`` against ``<dL/dx, v>``), which keeps the cost at a few
forward passes however large the input.

A check fails (``GraphError``) on any difference beyond the tolerance and on any value that is
not finite: an output of ``fn`` at the input, a backward gradient, or a central difference
(the function is NaN or Inf a step away). Comparisons are written so that NaN fails them
(``not diff <= tol``): with ``diff > tol`` a NaN anywhere would pass every check.

Example:
    >>> import needle as ndl
    >>> from needle.autograd import gradcheck
    >>> gradcheck(lambda a: (a * a).sum(), ndl.Tensor([1.0, 2.0]))
    True
"""
from __future__ import annotations

import numpy

from .._core.errors import GraphError
from .grad_mode import enable_grad, no_grad
from .tensor import Tensor


def _outputs(out) -> list:
    if getattr(out, "_is_tuple", False):
        return [out[i] for i in range(len(out))]
    return [out]


def _device_of(x, tensor_cls):
    return x.device if isinstance(x, tensor_cls) else None


def _as_float64(x, tensor_cls):
    data = x.numpy() if isinstance(x, tensor_cls) else numpy.asarray(x)
    return numpy.array(data, dtype=numpy.float64)


def gradcheck(fn, *inputs, eps=1e-6, atol=1e-5, rtol=1e-3, directions=3, seed=0,
              elementwise_limit=64) -> bool:
    """Check ``fn``'s gradients with respect to every input numerically, in float64.

    Args:
        fn: maps Tensors to a Tensor or TensorTuple.
        inputs: Tensors or array-likes; converted to float64 leaf copies on their device.
        eps: finite-difference step. atol, rtol: tolerance ``|num − ana| <= atol + rtol·|num|``.
        directions: random directions per input larger than ``elementwise_limit`` elements.
        seed: seed of the private generator for weights and directions (global RNG untouched).

    Returns:
        True when every check passes.

    Raises:
        GraphError: naming the input, the expected (numerical) and actual (backward) values;
            also when an output, a gradient or a central difference is NaN or Inf.
    """
    rng = numpy.random.default_rng(seed)
    devices = [_device_of(x, Tensor) for x in inputs]
    bases = [_as_float64(x, Tensor) for x in inputs]

    def make(arrays, requires_grad):
        return [Tensor(a, device=d, dtype="float64", requires_grad=requires_grad)
                for a, d in zip(arrays, devices, strict=True)]

    leaves = make(bases, True)
    with enable_grad():
        outs = _outputs(fn(*leaves))
    for k, o in enumerate(outs):
        _require_finite(f"output {k} of fn at the input", o.numpy())
    weights = [rng.standard_normal(o.shape) for o in outs]

    def loss(arrays) -> float:
        with no_grad():
            values = _outputs(fn(*make(arrays, False)))
        return float(sum((v.numpy().astype(numpy.float64) * w).sum()
                         for v, w in zip(values, weights, strict=True)))

    with enable_grad():
        total = None
        for o, w in zip(outs, weights, strict=True):
            term = (o * Tensor(w, device=o.device, dtype="float64", requires_grad=False)).sum()
            total = term if total is None else total + term
        total.backward()
    for i, leaf in enumerate(leaves):
        grad = numpy.zeros_like(bases[i]) if leaf.grad is None else leaf.grad.numpy()
        _require_finite(f"backward gradient of input {i}", grad)
        _check_input(i, grad, bases, loss, eps, atol, rtol, directions, rng, elementwise_limit)
    return True


def _require_finite(what: str, values) -> None:
    values = numpy.asarray(values)
    finite = numpy.isfinite(values)
    if not finite.all():
        nans, infs = int(numpy.isnan(values).sum()), int(numpy.isinf(values).sum())
        raise GraphError(
            f"gradcheck: {what} is not finite, expected finite values, got {nans} NaN and "
            f"{infs} Inf of {values.size} elements (first at index "
            f"{numpy.unravel_index(int(numpy.argmin(finite)), values.shape)})")


def _check_input(i, grad, bases, loss, eps, atol, rtol, directions, rng, limit) -> None:
    base = bases[i]
    if base.size <= limit:
        probes = [numpy.eye(1, base.size, k).reshape(base.shape) for k in range(base.size)]
    else:
        probes = []
        for _ in range(directions):
            v = rng.standard_normal(base.shape)
            probes.append(v / numpy.linalg.norm(v))
    for v in probes:
        arrays = list(bases)
        arrays[i] = base + eps * v
        plus = loss(arrays)
        arrays[i] = base - eps * v
        minus = loss(arrays)
        numeric = (plus - minus) / (2 * eps)
        analytic = float((grad * v).sum())
        where = (f"element {numpy.unravel_index(int(numpy.argmax(v)), base.shape)}"
                 if base.size <= limit else "a random direction")
        if not numpy.isfinite(numeric):
            raise GraphError(
                f"gradcheck: central difference of input {i} (shape {base.shape}) along "
                f"{where} is not finite, expected fn finite within eps={eps} of the input, "
                f"got L(x+eps·v)={plus:.8g}, L(x-eps·v)={minus:.8g}")
        # ``not <=``: a NaN fails the comparison instead of passing it
        if not abs(numeric - analytic) <= atol + rtol * abs(numeric):
            raise GraphError(
                f"gradcheck: gradient of input {i} (shape {base.shape}) wrong along {where}, "
                f"expected {numeric:.8g} (central difference), got {analytic:.8g} (backward)")
