"""The NumPy reference of the fused kernels (convolution, LSTM cell, batch normalisation,
softmax cross-entropy, embedding rows, fused elementwise programs): docs/backend_protocol.md.

Straight formulas on flat buffers, the oracle the C++ backend's ``conv2d_*``,
``lstm_cell_*``, ``batch_norm_*`` and ``softmax_xent_*`` kernels are tested against.
Re-exported by ``ndarray_backend_numpy``.

Example:
    >>> import numpy as np
    >>> from needle.backend_ndarray import ndarray_backend_numpy as B
    >>> z, c = B.Array(4), B.Array(1)
    >>> B.from_numpy(np.zeros(4), z); B.from_numpy(np.ones(1), c)
    >>> outs = [B.Array(1), B.Array(1), B.Array(4), B.Array(1)]
    >>> B.lstm_cell_forward(z, None, c, *outs, 1, 1)
    >>> round(float(outs[1].array[0]), 4)  # c' = sigmoid(0) * 1 + sigmoid(0) * tanh(0)
    0.5
"""
from __future__ import annotations

import math

import numpy as np

from .ewise_codes import (
    BINARY,
    LOAD,
    MAX_REGISTERS,
    RSCALAR,
    SCALAR,
    STORE,
    check_in_place,
    check_program,
)
from .ndarray_checks import check_class_ids

__all__ = ["conv2d_forward", "conv2d_forward_bias", "conv2d_weight_grad", "conv2d_input_grad",
           "conv2d_takes_views", "lstm_cell_forward", "lstm_cell_backward", "batch_norm_forward",
           "batch_norm_backward",
           "softmax_xent_forward", "softmax_xent_backward", "embedding_forward",
           "embedding_backward", "ewise_program", "mt19937_uniform"]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))  # no overflow for either sign
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


def _out_size(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


def _patches(x: np.ndarray, kh: int, kw: int, stride: int, pad: int) -> np.ndarray:
    """(N, HO, WO, KH, KW, C) view of the zero-padded NHWC input."""
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    n, h, w, c = xp.shape
    ho, wo = (h - kh) // stride + 1, (w - kw) // stride + 1
    sn, sh, sw, sc = xp.strides
    return np.lib.stride_tricks.as_strided(
        xp, (n, ho, wo, kh, kw, c), (sn, sh * stride, sw * stride, sh, sw, sc), writeable=False)


def _nhwc(a, dims: tuple, view) -> np.ndarray:
    """Operand ``a`` as an (N, H, W, C) array: its compact prefix, or ``view`` = (offset,
    four element strides) of its buffer (the CPU backend's x_view / dy_view)."""
    if view is None:
        return a.array[:math.prod(dims)].reshape(dims)
    if not isinstance(view, (tuple, list)) or len(view) != 5:
        raise ValueError(f"conv2d: a view must be (offset, and four strides), got {view!r}")
    offset, *strides = (int(v) for v in view)
    last = offset + sum((d - 1) * s for d, s in zip(dims, strides, strict=True))
    if min(offset, *strides) < 0 or last >= a.array.size:
        raise ValueError(f"conv2d: view {tuple(view)} of dims {dims} does not lie inside a "
                         f"buffer of {a.array.size} elements")
    item = a.array.itemsize
    return np.lib.stride_tricks.as_strided(a.array[offset:], dims,
                                           tuple(s * item for s in strides), writeable=False)


# x_view / dy_view: as in the CPU backend, which this module is the oracle of
conv2d_takes_views = True


def conv2d_forward(x, w, out, n, h, wd, c, kh, kw, cout, stride, pad, *, x_view=None) -> None:
    xs = _nhwc(x, (n, h, wd, c), x_view)
    ws = w.array[:kh * kw * c * cout].reshape(kh * kw * c, cout)
    cols = _patches(xs, kh, kw, stride, pad)
    ho, wo = cols.shape[1], cols.shape[2]
    out.array[:n * ho * wo * cout] = (cols.reshape(-1, kh * kw * c) @ ws).reshape(-1)


def conv2d_forward_bias(x, w, bias, out, n, h, wd, c, kh, kw, cout, stride, pad, *,
                        x_view=None) -> None:
    """``conv2d_forward`` plus ``bias`` (Cout values) on every output pixel."""
    conv2d_forward(x, w, out, n, h, wd, c, kh, kw, cout, stride, pad, x_view=x_view)
    size = n * _out_size(h, kh, stride, pad) * _out_size(wd, kw, stride, pad) * cout
    rows = out.array[:size].reshape(-1, cout)
    rows += bias.array[:cout]


def conv2d_weight_grad(x, dy, dw, n, h, wd, c, kh, kw, cout, stride, pad, *, x_view=None,
                       dy_view=None) -> None:
    xs = _nhwc(x, (n, h, wd, c), x_view)
    cols = _patches(xs, kh, kw, stride, pad).reshape(-1, kh * kw * c)
    ho, wo = _out_size(h, kh, stride, pad), _out_size(wd, kw, stride, pad)
    g = _nhwc(dy, (n, ho, wo, cout), dy_view).reshape(-1, cout)
    dw.array[:kh * kw * c * cout] = (cols.T @ g).reshape(-1)


def conv2d_input_grad(dy, w, dx, n, h, wd, c, kh, kw, cout, stride, pad, *,
                      dy_view=None) -> None:
    ho, wo = _out_size(h, kh, stride, pad), _out_size(wd, kw, stride, pad)
    g = _nhwc(dy, (n, ho, wo, cout), dy_view).reshape(n * ho * wo, cout)
    ws = w.array[:kh * kw * c * cout].reshape(kh * kw * c, cout)
    cols = (g @ ws.T).reshape(n, ho, wo, kh, kw, c)
    padded = np.zeros((n, h + 2 * pad, wd + 2 * pad, c), dtype=dx.array.dtype)
    for i in range(kh):
        for j in range(kw):
            padded[:, i:i + stride * (ho - 1) + 1:stride,
                   j:j + stride * (wo - 1) + 1:stride, :] += cols[:, :, :, i, j, :]
    dx.array[:n * h * wd * c] = padded[:, pad:pad + h, pad:pad + wd, :].reshape(-1)


def _rows(op: str, what: str, a, offset: int, need: int):
    """Elements ``[offset, offset + need)`` of the optional operand ``a`` (None if absent)."""
    if a is None:
        return None
    if offset < 0 or offset + need > a.array.size:
        raise ValueError(f"{op}: {what} too small, expected {need} elements from offset "
                         f"{offset}, got a buffer of {a.array.size}")
    return a.array[offset:offset + need]


def lstm_cell_forward(z, bias, c, h_out, c_out, gates_out, tanh_c_out, batch, hidden,
                      z_add=None, z_add_offset=0) -> None:
    pre = z.array[:batch * 4 * hidden].reshape(batch, 4, hidden)
    add = _rows("lstm_cell_forward", "z_add", z_add, z_add_offset, batch * 4 * hidden)
    if add is not None:  # a step's rows of the whole sequence's input projection, then z
        pre = add.reshape(batch, 4, hidden) + pre
    if bias is not None:
        pre = pre + bias.array[:4 * hidden].reshape(1, 4, hidden)
    gates = np.empty_like(pre)
    gates[:, 0], gates[:, 1] = _sigmoid(pre[:, 0]), _sigmoid(pre[:, 1])
    gates[:, 2], gates[:, 3] = np.tanh(pre[:, 2]), _sigmoid(pre[:, 3])
    c_new = gates[:, 1] * c.array[:batch * hidden].reshape(batch, hidden) \
        + gates[:, 0] * gates[:, 2]
    tanh_c = np.tanh(c_new)
    gates_out.array[:batch * 4 * hidden] = gates.reshape(-1)
    c_out.array[:batch * hidden] = c_new.reshape(-1)
    tanh_c_out.array[:batch * hidden] = tanh_c.reshape(-1)
    h_out.array[:batch * hidden] = (gates[:, 3] * tanh_c).reshape(-1)


def lstm_cell_backward(gates, tanh_c, c, dh, dc, dz_out, dc_prev_out, batch, hidden,
                       dh_add=None, dh_add_offset=0) -> None:
    g = gates.array[:batch * 4 * hidden].reshape(batch, 4, hidden)
    i, f, gg, o = g[:, 0], g[:, 1], g[:, 2], g[:, 3]
    t = tanh_c.array[:batch * hidden].reshape(batch, hidden)
    c_prev = c.array[:batch * hidden].reshape(batch, hidden)
    dh_ = dh.array[:batch * hidden].reshape(batch, hidden)
    add = _rows("lstm_cell_backward", "dh_add", dh_add, dh_add_offset, batch * hidden)
    if add is not None:
        dh_ = add.reshape(batch, hidden) + dh_
    dct = dc.array[:batch * hidden].reshape(batch, hidden) + dh_ * o * (1 - t * t)
    dz = np.stack([dct * gg * i * (1 - i), dct * c_prev * f * (1 - f), dct * i * (1 - gg * gg),
                   dh_ * t * o * (1 - o)], axis=1)
    dz_out.array[:batch * 4 * hidden] = dz.reshape(-1)
    dc_prev_out.array[:batch * hidden] = (dct * f).reshape(-1)


def batch_norm_forward(x, w, b, y, mean, var, invstd, n, c, s, eps) -> None:
    """Training-mode batch norm of ``x`` viewed as (N, C, S): per-channel batch statistics
    (biased variance) and ``y = w (x - mean) / sqrt(var + eps) + b``."""
    if n * c * s == 0:
        return
    xs = x.array[:n * c * s].reshape(n, c, s)
    acc = np.float64
    m = xs.mean(axis=(0, 2), dtype=acc)
    v = ((xs.astype(acc) - m[None, :, None]) ** 2).mean(axis=(0, 2))
    inv = 1.0 / np.sqrt(v + eps)
    dt = xs.dtype
    mean.array[:c], var.array[:c], invstd.array[:c] = m.astype(dt), v.astype(dt), inv.astype(dt)
    scale = (w.array[:c].astype(acc) * inv).astype(dt)
    out = (xs - m.astype(dt)[None, :, None]) * scale[None, :, None] + b.array[:c][None, :, None]
    y.array[:n * c * s] = out.reshape(-1)


def batch_norm_backward(dy, x, w, mean, invstd, dx, dw, db, n, c, s) -> None:
    """``dx, dw, db`` of :func:`batch_norm_forward` from ``dy`` and the saved statistics."""
    if n * c * s == 0:
        return
    acc = np.float64
    g = dy.array[:n * c * s].reshape(n, c, s).astype(acc)
    xs = x.array[:n * c * s].reshape(n, c, s).astype(acc)
    m, inv = mean.array[:c].astype(acc), invstd.array[:c].astype(acc)
    count = n * s
    xhat = (xs - m[None, :, None]) * inv[None, :, None]
    sum_dy = g.sum(axis=(0, 2))
    sum_dy_xhat = (g * xhat).sum(axis=(0, 2))
    dt = dx.array.dtype
    db.array[:c], dw.array[:c] = sum_dy.astype(dt), sum_dy_xhat.astype(dt)
    k1 = w.array[:c].astype(acc) * inv
    grad = k1[None, :, None] * (g - sum_dy[None, :, None] / count
                                - xhat * sum_dy_xhat[None, :, None] / count)
    dx.array[:n * c * s] = grad.astype(dt).reshape(-1)


def _class_ids(values, n: int, k: int, what: str) -> np.ndarray:
    """The first ``n`` values as int64 (see :func:`check_class_ids`)."""
    return check_class_ids(values.array[:n], k, what)


def _labels(op: str, labels, n: int, k: int) -> np.ndarray:
    return _class_ids(labels, n, k, f"{op}: class label out of range at row")


def softmax_xent_forward(z, labels, loss, lse, n, k) -> None:
    """Per row of ``z`` (n, k): ``lse = logsumexp(z)`` and ``loss = lse - z[label]``."""
    y = _labels("softmax_xent_forward", labels, n, k)
    if n == 0:
        return
    zs = z.array[:n * k].reshape(n, k).astype(np.float64)
    m = zs.max(axis=1)
    out = m + np.log(np.exp(zs - m[:, None]).sum(axis=1))
    dt = loss.array.dtype
    lse.array[:n] = out.astype(dt)
    loss.array[:n] = (out - zs[np.arange(n), y]).astype(dt)


def softmax_xent_backward(z, labels, lse, g, dz, n, k) -> None:
    """``dz = g (softmax(z) - onehot(label))`` per row, from the saved ``lse``."""
    y = _labels("softmax_xent_backward", labels, n, k)
    if n == 0:
        return
    zs = z.array[:n * k].reshape(n, k).astype(np.float64)
    grad = np.exp(zs - lse.array[:n].astype(np.float64)[:, None])
    grad[np.arange(n), y] -= 1.0
    grad *= g.array[:n].astype(np.float64)[:, None]
    dz.array[:n * k] = grad.astype(dz.array.dtype).reshape(-1)


def _ids(ids, n: int, num: int) -> np.ndarray:
    return _class_ids(ids, n, num, "embedding: id out of range at position")


def embedding_forward(table, ids, out, num, dim, n) -> None:
    """``out[i] = table[ids[i]]``: rows of the (num, dim) ``table`` picked by ``n`` ids."""
    rows = _ids(ids, n, num)
    out.array[:n * dim] = table.array[:num * dim].reshape(num, dim)[rows].reshape(-1)


def embedding_backward(g, ids, dtable, num, dim, n) -> None:
    """``dtable = zeros; dtable[ids[i]] += g[i]`` in position order (repeated ids add up)."""
    rows = _ids(ids, n, num)
    total = np.zeros((num, dim), dtype=dtable.array.dtype)
    np.add.at(total, rows, g.array[:n * dim].reshape(n, dim))
    dtable.array[:num * dim] = total.reshape(-1)


# ---- ewise_program: a chain of elementwise kernels in one call ------------------------------


class _Buffer:
    """Stands in for an Array around a plain NumPy array (no allocation through needle's
    allocator: a fused call inside a planned run must not request buffers)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


def kernel_tables(B=None) -> tuple:
    """``(binary, scalar, rscalar, unary)``: backend ``B``'s separate kernels (the NumPy
    reference unless given) for each op number of an elementwise program; ``scalar`` and
    ``rscalar`` map op numbers to kernels (tanh_grad / relu_grad have none: they run the
    binary kernel on a filled array). A program runs bitwise as these run one by one."""
    if B is None:
        from . import ndarray_backend_numpy as B

    binary = [B.ewise_add, B.ewise_sub, B.ewise_mul, B.ewise_div, B.ewise_maximum,
              B.ewise_minimum, B.ewise_power, B.ewise_eq, B.ewise_ge, B.ewise_tanh_grad,
              B.ewise_relu_grad]
    scalar = {0: B.scalar_add, 1: B.scalar_sub, 2: B.scalar_mul, 3: B.scalar_div,
              4: B.scalar_maximum, 5: B.scalar_minimum, 6: B.scalar_power, 7: B.scalar_eq,
              8: B.scalar_ge}
    rscalar = {0: B.scalar_add, 1: B.scalar_rsub, 2: B.scalar_mul, 3: B.scalar_rdiv,
               4: B.scalar_maximum, 5: B.scalar_minimum, 6: B.scalar_rpower, 7: B.scalar_eq,
               8: B.scalar_le}
    unary = [B.ewise_neg, B.ewise_log, B.ewise_exp, B.ewise_tanh, B.ewise_sqrt, B.ewise_abs,
             B.ewise_sign, B.ewise_sigmoid]
    return binary, scalar, rscalar, unary


def ewise_program(ins, outs, code, scalars, n) -> None:
    """Run a chain of elementwise ops over ``n`` elements (instruction format in
    src/ewise_program_impl.h) with this backend's own kernels, op by op on whole arrays: the
    oracle of the C++ backend's block-by-block ``ewise_program``."""
    n = int(n)
    if n < 0:
        raise ValueError(f"ewise_program: expected n >= 0, got {n}")
    if not outs:
        raise ValueError("ewise_program: expected at least one output")
    dtype = outs[0].array.dtype
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"ewise_program: expected float32 or float64, got {dtype.name}")
    for arr in (*ins, *outs):
        if arr.array.dtype != dtype or arr.array.size < n:
            raise ValueError(f"ewise_program: every input and output must be {dtype} with at "
                             f"least {n} elements")
    check_program(code, len(ins), len(outs), len(scalars))
    for j, o in enumerate(outs):
        for i, a in enumerate(ins):
            if a.array is o.array:
                check_in_place(code, i, j)  # the whole buffer: allowed where reads come first
            elif np.shares_memory(o.array, a.array):
                raise ValueError("ewise_program: an output shares its buffer with an input")
        if any(np.shares_memory(o.array, p.array) for p in outs[:j]):
            raise ValueError("ewise_program: two outputs share a buffer")
    binary, scalar, rscalar, unary = kernel_tables()
    regs: list = [None] * MAX_REGISTERS
    for k in range(0, len(code), 5):
        kind, op, dst, a, b = code[k:k + 5]
        if kind == LOAD:
            regs[dst] = ins[a].array[:n]
            continue
        if kind == STORE:
            outs[dst].array[:n] = regs[a]
            continue
        result = _Buffer(np.empty(n, dtype))
        if kind == BINARY:
            binary[op](_Buffer(regs[a]), _Buffer(regs[b]), result)
        elif kind in (SCALAR, RSCALAR):
            table = scalar if kind == SCALAR else rscalar
            if op in table:
                table[op](_Buffer(regs[a]), scalars[b], result)
            else:  # tanh_grad / relu_grad with a scalar: through the binary kernel
                full = _Buffer(np.full(n, scalars[b], dtype))
                pair = (_Buffer(regs[a]), full) if kind == SCALAR else (full, _Buffer(regs[a]))
                binary[op](*pair, result)
        else:
            unary[op](_Buffer(regs[a]), result)
        regs[dst] = result.array


def mt19937_uniform(bit_generator, out, n, p=None) -> None:
    """``out[:n]`` = the next ``n`` draws of ``np.random.rand`` from ``bit_generator`` (NumPy's
    MT19937, advanced in place), cast to out's dtype; with ``p``: 1 where that value <= p
    (compared in out's dtype), else 0. The oracle of the C++ backend's kernel."""
    if type(bit_generator) is not np.random.MT19937:
        raise TypeError(f"mt19937_uniform: expected a numpy.random.MT19937, got "
                        f"{type(bit_generator).__name__}")
    if out.array.dtype not in (np.float32, np.float64):
        raise TypeError(f"mt19937_uniform: expected a float32 or float64 out, got "
                        f"{out.array.dtype.name}")
    if not 0 <= n <= out.array.size:
        raise ValueError(f"mt19937_uniform: expected 0 <= n <= out.size ({out.array.size}), "
                         f"got {n}")
    # A RandomState over the same bit generator shares its state: its draws advance it.
    values = np.random.RandomState(bit_generator).random_sample(n).astype(out.array.dtype)
    out.array[:n] = values if p is None else values <= out.array.dtype.type(p)
