"""Fused ops: one LSTM step (``lstm_cell``) as a single graph node with one gate kernel, and
one LSTM layer over a whole sequence (``lstm_layer``, what ``nn.LSTM`` runs) as one node.

The unfused cell (two matmuls, bias adds, a split, three sigmoids, two tanhs, three products
and a sum) records ~15 nodes per step and runs ~20 kernels; ``lstm_cell`` records one node
and runs the two matmuls plus one kernel that computes all four gates, the new cell state and
the output (the C++ backend's ``lstm_cell_forward``). Its plain backward is one kernel for
the gate gradients plus the matmuls of the weight and input gradients. Devices without the
kernel (CUDA), float16 and NumPy mode compute the same formulas with array ops. With
``create_graph`` the gradient is built from differentiable ops, so gradients of gradients
work as for the unfused cell. ``lstm_layer`` runs the same gate kernels step by step but
multiplies by ``W_ih`` once for all steps, and its backward forms the weight, bias and input
gradients as single products over all steps (see :class:`FusedLSTMLayer`).

Gate order is i, f, g, o (the course's and PyTorch's): ``z = x W_ih + h W_hh + b_ih + b_hh``
split into four blocks of H columns; ``c' = σ(f)·c + σ(i)·tanh(g)``, ``h' = σ(o)·tanh(c')``.

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import ops
    >>> x, h, c = (ndl.Tensor(np.zeros((2, n))) for n in (3, 4, 4))
    >>> w_ih, w_hh = ndl.Tensor(np.zeros((3, 16))), ndl.Tensor(np.zeros((4, 16)))
    >>> h2, c2 = ops.lstm_cell(x, h, c, w_ih, w_hh)
    >>> h2.shape, float(c2.numpy().sum())
    ((2, 4), 0.0)
"""
from __future__ import annotations

from .._core.errors import ShapeError
from ..autograd import TensorTupleOp
from ..autograd.tensor import const as _leaf
from ..backend_ndarray.ndarray import NDArray
from ..backend_selection import BACKEND
from . import _array as A
from .ops_mathematic import matmul, sigmoid, tanh
from .ops_shape import broadcast_to, reshape, summation, transpose
from .ops_tuple import split, stack

__all__ = ["FusedLSTMCell", "lstm_cell", "FusedLSTMLayer", "lstm_layer"]

_ND = BACKEND == "nd"


def _check(x_shape, h, c, w_ih, w_hh, biases, op: str = "lstm_cell") -> int:
    """Validates the operand shapes (``x_shape``: one step's input, (B, I)); returns the
    hidden size H."""
    if len(x_shape) != 2 or len(w_ih.shape) != 2 or len(w_hh.shape) != 2:
        raise ShapeError(f"{op}: expected 2-D x, W_ih, W_hh, got shapes {tuple(x_shape)}, "
                         f"{tuple(w_ih.shape)}, {tuple(w_hh.shape)}")
    batch, hidden = x_shape[0], w_hh.shape[0]
    expected = {"W_ih": (x_shape[1], 4 * hidden), "W_hh": (hidden, 4 * hidden),
                "h": (batch, hidden), "c": (batch, hidden)}
    for name, arr in (("W_ih", w_ih), ("W_hh", w_hh), ("h", h), ("c", c)):
        if tuple(arr.shape) != expected[name]:
            raise ShapeError(f"{op}: {name} has the wrong shape, expected "
                             f"{expected[name]}, got {tuple(arr.shape)}")
    for b in biases:
        if A.size_of(b.shape) != 4 * hidden:
            raise ShapeError(f"{op}: bias has the wrong size, expected {4 * hidden} "
                             f"elements, got shape {tuple(b.shape)}")
    return hidden


def _bias_sum(biases):
    """The biases added into one flat (4H,) array, or None."""
    bias = None
    for b in biases:
        flat = A.reshape(A.compact(b), (A.size_of(b.shape),))
        bias = flat if bias is None else bias + flat
    return bias


def _kernel_module(*arrays):
    """The backend module when it has the fused gate kernels for these arrays, else None."""
    if not _ND:
        return None
    first = arrays[0]
    mod = getattr(first.device, "mod", None)
    if mod is None or not hasattr(mod, "lstm_cell_forward"):
        return None
    if first.dtype not in ("float32", "float64"):
        return None
    return mod


def _gates_forward(z, bias, c, z_add=None):
    """(h', c', gates, tanh(c')) from the preactivation z (B, 4H) without bias. ``z_add``
    (kernel devices only): ``(rows, offset)``, a compact array whose elements from ``offset``
    on are added before z (a step's input projection, read in place)."""
    batch, width = z.shape
    hidden = width // 4
    mod = _kernel_module(z)
    if mod is not None:
        z, c = z.compact(), c.compact()
        add, offset = (None, 0) if z_add is None else (z_add[0]._handle, z_add[1])
        make = NDArray.make
        dev, dt = z.device, z.dtype
        h2, c2 = make((batch, hidden), device=dev, dtype=dt), make((batch, hidden), device=dev,
                                                                    dtype=dt)
        gates, tc = make((batch, width), device=dev, dtype=dt), make((batch, hidden), device=dev,
                                                                      dtype=dt)
        mod.lstm_cell_forward(z._handle, None if bias is None else bias.compact()._handle,
                              c._handle, h2._handle, c2._handle, gates._handle, tc._handle,
                              batch, hidden, add, offset)
        return h2, c2, gates, tc
    assert z_add is None, "z_add is for the gate kernel"
    pre = z if bias is None else z + A.broadcast_to(A.reshape(bias, (1, width)), z.shape)
    blocks = [A.compact(A.slice_view(pre, (slice(0, batch), slice(q * hidden, (q + 1) * hidden))))
              for q in range(4)]
    i, f, o = A.sigmoid(blocks[0]), A.sigmoid(blocks[1]), A.sigmoid(blocks[3])
    g = A.tanh(blocks[2])
    c2 = f * A.compact(c) + i * g
    tc = A.tanh(c2)
    gates = A.compact(A.reshape(A.stack([i, f, g, o], 1), (batch, width)))
    return o * tc, c2, gates, tc


def _gates_backward(gates, tc, c, dh, dc, dh_add=None):
    """(dz (B, 4H), dc_prev (B, H)) from the saved gates, tanh(c') and c and dh', dc'.
    ``dh_add`` (kernel devices only): ``(rows, offset)`` added to dh' as ``z_add`` is to z
    in :func:`_gates_forward`."""
    batch, width = gates.shape
    hidden = width // 4
    mod = _kernel_module(gates)
    if mod is not None:
        add, offset = (None, 0) if dh_add is None else (dh_add[0]._handle, dh_add[1])
        dz = NDArray.make((batch, width), device=gates.device, dtype=gates.dtype)
        dc_prev = NDArray.make((batch, hidden), device=gates.device, dtype=gates.dtype)
        mod.lstm_cell_backward(gates._handle, tc._handle, A.compact(c)._handle,
                               A.compact(dh)._handle, A.compact(dc)._handle, dz._handle,
                               dc_prev._handle, batch, hidden, add, offset)
        return dz, dc_prev
    assert dh_add is None, "dh_add is for the gate kernel"
    i, f, g, o = (A.compact(A.slice_view(gates, (slice(0, batch),
                                                 slice(q * hidden, (q + 1) * hidden))))
                  for q in range(4))
    dct = dc + dh * o * (1 - tc * tc)
    parts = [dct * g * i * (1 - i), dct * A.compact(c) * f * (1 - f), dct * i * (1 - g * g),
             dh * tc * o * (1 - o)]
    return A.compact(A.reshape(A.stack(parts, 1), (batch, width))), dct * f


class FusedLSTMCell(TensorTupleOp):
    """``(h', c')`` of one LSTM step from ``x, h, c, W_ih, W_hh`` and 0-2 bias tensors.

    Besides its inputs (x, h, c and the weights, for the matmul gradients) the node keeps the
    four gate activations and ``tanh(c')`` on the op, computed by the forward kernel, so the
    plain backward runs no activation function again. They are not saved tensors:
    ``saved_tensors_hooks`` (offloading) do not see them.
    """

    save_inputs = (0, 1, 2, 3, 4)

    def __init__(self):
        self.gates = self.tanh_c = None

    def held_arrays(self) -> tuple:
        return tuple(a for a in (self.gates, self.tanh_c) if a is not None)

    def release_held(self) -> None:
        self.gates = self.tanh_c = None

    def compute(self, x, h, c, w_ih, w_hh, *biases):
        _check(x.shape, h, c, w_ih, w_hh, biases)
        z = A.matmul(x, w_ih) + A.matmul(h, w_hh)
        h2, c2, self.gates, self.tanh_c = _gates_forward(z, _bias_sum(biases), c)
        return h2, c2

    def gradient(self, out_grad, node):
        # create_graph: a differentiable composition of Tensor ops
        return _composed_gradient(out_grad, node)

    def plain_gradient(self, out_grad, node):
        # a backward that records no graph: one gate kernel on the kept activations
        x, h, c, w_ih, w_hh = node.saved_tensors
        dh, dc = out_grad.cached_data[0], out_grad.cached_data[1]
        dz, dc_prev = _gates_backward(self.gates, self.tanh_c, c.cached_data, dh, dc)
        need = [t.requires_grad for t in node.inputs]
        grads = [
            _leaf(A.matmul(dz, A.swap_last(w_ih.cached_data))) if need[0] else None,
            _leaf(A.matmul(dz, A.swap_last(w_hh.cached_data))) if need[1] else None,
            _leaf(dc_prev) if need[2] else None,
            _leaf(A.matmul(A.swap_last(x.cached_data), dz)) if need[3] else None,
            _leaf(A.matmul(A.swap_last(h.cached_data), dz)) if need[4] else None,
        ]
        if len(node.inputs) > 5:
            db = A.reduce_sum(dz, (0,))
            for b, wanted in zip(node.inputs[5:], need[5:], strict=True):
                grads.append(_leaf(A.reshape(db, tuple(b.shape))) if wanted else None)
        return tuple(grads)


def _composed_gradient(out_grad, node):
    """The same gradients as Tensor ops (recomputing the gates), so they stay differentiable."""
    x, h, c, w_ih, w_hh = node.inputs[:5]
    biases = node.inputs[5:]
    batch, hidden = h.shape
    z = matmul(x, w_ih) + matmul(h, w_hh)
    for b in biases:
        z = z + broadcast_to(reshape(b, (1, 4 * hidden)), z.shape)
    zi, zf, zg, zo = split(reshape(z, (batch, 4, hidden)), axis=1).tuple()
    i, f, g, o = sigmoid(zi), sigmoid(zf), tanh(zg), sigmoid(zo)
    tc = tanh(f * c + i * g)
    dh, dc = out_grad[0], out_grad[1]
    dct = dc + dh * o * (1 - tc * tc)
    dz = reshape(stack([dct * g * i * (1 - i), dct * c * f * (1 - f), dct * i * (1 - g * g),
                        dh * tc * o * (1 - o)], 1), (batch, 4 * hidden))
    grads = [matmul(dz, transpose(w_ih)), matmul(dz, transpose(w_hh)), dct * f,
             matmul(transpose(x), dz), matmul(transpose(h), dz)]
    db = summation(dz, (0,))
    grads += [reshape(db, tuple(b.shape)) for b in biases]
    return tuple(grads)


def lstm_cell(x, h, c, w_ih, w_hh, *biases):
    """One LSTM step: ``(h', c')`` for input ``x`` (B, I) and state ``h, c`` (B, H).

    ``w_ih`` is (I, 4H), ``w_hh`` (H, 4H), each bias has 4H elements (any shape, e.g. (4H,)
    or (1, 4H)); gate order i, f, g, o.
    """
    out = FusedLSTMCell()(x, h, c, w_ih, w_hh, *biases)
    return out[0], out[1]


class FusedLSTMLayer(TensorTupleOp):
    """``(out, h_T, c_T)`` of one LSTM layer over a whole sequence: ``X`` (T, B, I), the
    initial state ``h0, c0`` (B, H), ``W_ih``, ``W_hh`` and 0-2 biases; ``out`` (T, B, H)
    holds every step's ``h``.

    One graph node for T steps, computed as the per-step cells are: the input projection of
    all steps is one (T·B, I) @ (I, 4H) product, each step adds its ``h @ W_hh`` and runs the
    gate kernel. The plain backward runs the gate kernel and ``dz @ W_hh.T`` per step
    (backwards in time) and then the four gradients that sum over time as single products
    over all T·B rows: ``dX = dZ @ W_ih.T``, ``dW_ih = X.T @ dZ``, ``dW_hh = H_prev.T @ dZ``
    and the bias column sum, instead of T small products and T - 1 additions each. Forward
    values equal the per-step cells' bit for bit; the weight gradients sum over time in
    another order (equal within rounding).
    """

    save_inputs = (0, 1, 2, 3, 4)

    def __init__(self):
        self.gates = self.tanh_c = self.c_prev = self.h_steps = None

    def held_arrays(self) -> tuple:
        return tuple(a for group in (self.gates, self.tanh_c, self.c_prev, self.h_steps)
                     if group is not None for a in group)

    def release_held(self) -> None:
        self.gates = self.tanh_c = self.c_prev = self.h_steps = None

    def compute(self, x, h0, c0, w_ih, w_hh, *biases):
        if len(x.shape) != 3:
            raise ShapeError(f"lstm_layer: expected X of shape (T, B, I), got shape "
                             f"{tuple(x.shape)}")
        steps, batch, width_in = x.shape
        if steps == 0:
            raise ShapeError("lstm_layer: expected a sequence of at least one step, got T = 0")
        hidden = _check((batch, width_in), h0, c0, w_ih, w_hh, biases, "lstm_layer")
        bias = _bias_sum(biases)
        projected = A.compact(A.matmul(A.reshape(A.compact(x), (steps * batch, width_in)),
                                       w_ih))
        in_place = _kernel_module(projected) is not None
        if not in_place:
            parts = A.split(A.reshape(projected, (steps, batch, 4 * hidden)), 0)
        self.gates, self.tanh_c, self.c_prev, self.h_steps = [], [], [], []
        h, c = h0, c0
        for t in range(steps):
            self.c_prev.append(c)
            if in_place:  # the gate kernel adds step t's rows of `projected`: no copy of them
                z_add = (projected, t * batch * 4 * hidden)
                h, c, gates, tanh_c = _gates_forward(A.matmul(h, w_hh), bias, c, z_add)
            else:
                h, c, gates, tanh_c = _gates_forward(parts[t] + A.matmul(h, w_hh), bias, c)
            self.gates.append(gates)
            self.tanh_c.append(tanh_c)
            self.h_steps.append(h)
        return A.stack(self.h_steps, 0), h, c

    def plain_gradient(self, out_grad, node):
        x, h0, c0, w_ih, w_hh = node.saved_tensors
        d_out, dh, dc = (out_grad.cached_data[i] for i in range(3))
        steps, batch, width_in = x.shape
        need = [t.requires_grad for t in node.inputs]
        in_place = _kernel_module(self.gates[0]) is not None
        if in_place:  # the gate kernel adds step t's rows of d_out to dh itself
            d_out = A.compact(d_out)
        else:
            d_steps = A.split(d_out, 0)
        # W_hh.T compacted once for all T products: the kernel reads a compact B in place,
        # a transposed view it would pack (gather) again at every step; same sums, same bits
        w_hh_t = A.compact(A.swap_last(w_hh.cached_data))
        dzs = [None] * steps
        for t in reversed(range(steps)):
            if in_place:
                dz, dc = _gates_backward(self.gates[t], self.tanh_c[t], self.c_prev[t], dh, dc,
                                         (d_out, t * batch * dh.shape[1]))
            else:
                dz, dc = _gates_backward(self.gates[t], self.tanh_c[t], self.c_prev[t],
                                         d_steps[t] + dh, dc)
            dzs[t] = dz
            if t > 0 or need[1]:
                dh = A.matmul(dz, w_hh_t)
        rows = steps * batch
        dz_all = A.reshape(A.stack(dzs, 0), (rows, dz.shape[1]))
        grads = [None] * 5
        if need[0]:
            grads[0] = _leaf(A.reshape(A.matmul(dz_all, A.swap_last(w_ih.cached_data)),
                                       (steps, batch, width_in)))
        if need[1]:
            grads[1] = _leaf(dh)
        if need[2]:
            grads[2] = _leaf(dc)
        if need[3]:
            x_rows = A.reshape(A.compact(x.cached_data), (rows, width_in))
            grads[3] = _leaf(A.matmul(A.swap_last(x_rows), dz_all))
        if need[4]:
            h_prev = A.stack([h0.cached_data] + self.h_steps[:-1], 0)
            h_prev = A.reshape(h_prev, (rows, h0.shape[1]))
            grads[4] = _leaf(A.matmul(A.swap_last(h_prev), dz_all))
        if len(node.inputs) > 5:
            db = A.reduce_sum(dz_all, (0,))
            for b, wanted in zip(node.inputs[5:], need[5:], strict=True):
                grads.append(_leaf(A.reshape(db, tuple(b.shape))) if wanted else None)
        return tuple(grads)

    def gradient(self, out_grad, node):
        # create_graph: the per-step cells' composed gradients, chained backwards in time
        # over recomputed (differentiable) states
        x, h0, c0, w_ih, w_hh = node.inputs[:5]
        biases = node.inputs[5:]
        xs = split(x, axis=0).tuple()
        hs, cs = [h0], [c0]
        for x_t in xs[:-1]:
            h, c = lstm_cell(x_t, hs[-1], cs[-1], w_ih, w_hh, *biases)
            hs.append(h)
            cs.append(c)
        d_steps = split(out_grad[0], axis=0).tuple()
        dh, dc = out_grad[1], out_grad[2]
        dxs = [None] * len(xs)
        sums = [None] * (2 + len(biases))
        for t in reversed(range(len(xs))):
            step = _Step((xs[t], hs[t], cs[t], w_ih, w_hh, *biases))
            grads = _composed_gradient((d_steps[t] + dh, dc), step)
            dxs[t], dh, dc = grads[0], grads[1], grads[2]
            for k, g in enumerate(grads[3:]):
                sums[k] = g if sums[k] is None else sums[k] + g
        return (stack(dxs, 0), dh, dc, *sums)


class _Step:
    """The inputs of one step, as :func:`_composed_gradient` reads them from a node."""

    __slots__ = ("inputs",)

    def __init__(self, inputs):
        self.inputs = inputs


def lstm_layer(x, h0, c0, w_ih, w_hh, *biases):
    """One LSTM layer over a sequence: ``(out, h_T, c_T)`` for ``x`` (T, B, I) from the
    state ``h0, c0`` (B, H); ``out`` (T, B, H) stacks every step's ``h``. Weights and gate
    order as :func:`lstm_cell`.

    Example:
        >>> import numpy as np
        >>> import needle as ndl
        >>> from needle import ops
        >>> x, h, c = ndl.Tensor(np.zeros((5, 2, 3))), *(ndl.Tensor(np.zeros((2, 4))) for _ in "hc")
        >>> w_ih, w_hh = ndl.Tensor(np.zeros((3, 16))), ndl.Tensor(np.zeros((4, 16)))
        >>> out, h_T, c_T = ops.lstm_layer(x, h, c, w_ih, w_hh)
        >>> out.shape, h_T.shape
        ((5, 2, 4), (2, 4))
    """
    out = FusedLSTMLayer()(x, h0, c0, w_ih, w_hh, *biases)
    return out[0], out[1], out[2]
