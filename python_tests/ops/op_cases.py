"""Op test cases shared by the nd-mode tests and the np-mode subprocess run.

Each case: a needle function of Tensors, an independent NumPy re-derivation of the forward,
and input makers (``rng -> ndarray`` in float64). The NumPy side never calls needle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

import needle as ndl
import needle.ops as ops


@dataclass
class Case:
    name: str
    fn: Callable  # needle Tensors -> Tensor or TensorTuple
    ref: Callable  # numpy arrays -> array or tuple of arrays
    inputs: tuple  # shapes, or callables rng -> array


def _pos(*shape):
    return lambda rng: np.abs(rng.standard_normal(shape)) + 0.5


def _conv_ref(x, w, stride, padding):
    """Direct convolution: sum over kernel offsets of strided input windows times W[i, j]."""
    x = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    kh, kw = w.shape[:2]
    ho = (x.shape[1] - kh) // stride + 1
    wo = (x.shape[2] - kw) // stride + 1
    out = np.zeros((x.shape[0], ho, wo, w.shape[3]))
    for i in range(kh):
        for j in range(kw):
            window = x[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride]
            out += window @ w[i, j]
    return out


def _dilate_ref(x, axes, d):
    shape = [n * (d + 1) if i in axes else n for i, n in enumerate(x.shape)]
    out = np.zeros(shape)
    index = tuple(slice(None, None, d + 1) if i in axes else slice(None)
                  for i in range(x.ndim))
    out[index] = x
    return out


def _lse_ref(x, axes):
    m = np.max(x, axis=axes, keepdims=True)
    return np.squeeze(np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m, axis=axes)


def _sigmoid_ref(x):
    return 1 / (1 + np.exp(-x))


# the labels of the softmax_xent_mean case (a constant: no gradient flows into them)
_LABELS = np.array([5.0, 0.0, 2.0, 2.0])


def _const_like(values, like):
    return ndl.Tensor(values, device=like.device, dtype=like.dtype, requires_grad=False)


CASES = [
    Case("add", ops.add, np.add, ((3, 4), (3, 4))),
    Case("add_broadcast", ops.add, np.add, ((3, 1, 4), (2, 1))),
    Case("add_scalar", lambda a: ops.add_scalar(a, 1.5), lambda a: a + 1.5, ((3, 4),)),
    Case("multiply", ops.multiply, np.multiply, ((3, 4), (3, 4))),
    Case("mul_scalar", lambda a: ops.mul_scalar(a, -2.5), lambda a: a * -2.5, ((5,),)),
    Case("divide", ops.divide, np.divide, ((3, 4), _pos(3, 4))),
    Case("divide_scalar", lambda a: ops.divide_scalar(a, 3.0), lambda a: a / 3.0, ((2, 3),)),
    Case("masked_divide", lambda a, m: ops.masked_divide(a, m, 0.7), lambda a, m: a * m / 0.7,
         ((3, 4), lambda rng: (rng.random((3, 4)) < 0.6).astype(np.float64))),
    Case("power", ops.power, np.power, (_pos(3, 4), (3, 4))),
    Case("power_scalar", lambda a: ops.power_scalar(a, -1.5), lambda a: a ** -1.5,
         (_pos(3, 4),)),
    Case("power_scalar_int", lambda a: ops.power_scalar(a, 3), lambda a: a ** 3, ((3, 4),)),
    Case("negate", ops.negate, np.negative, ((3, 4),)),
    Case("log", ops.log, np.log, (_pos(3, 4),)),
    Case("exp", ops.exp, np.exp, ((3, 4),)),
    Case("relu", ops.relu, lambda a: np.maximum(a, 0), ((4, 5),)),
    Case("tanh", ops.tanh, np.tanh, ((3, 4),)),
    Case("sqrt", ops.sqrt, np.sqrt, (_pos(3, 4),)),
    Case("sigmoid", ops.sigmoid, _sigmoid_ref, ((3, 4),)),
    Case("maximum", ops.maximum, np.maximum, ((3, 4), (3, 4))),
    Case("transpose_default", ops.transpose, lambda a: np.swapaxes(a, -1, -2), ((2, 3, 4),)),
    Case("transpose_axes", lambda a: ops.transpose(a, (0, 2)),
         lambda a: np.swapaxes(a, 0, 2), ((2, 3, 4),)),
    Case("permute", lambda a: ops.permute(a, (2, 0, 1)),
         lambda a: np.transpose(a, (2, 0, 1)), ((2, 3, 4),)),
    Case("reshape", lambda a: ops.reshape(a, (4, 3)), lambda a: a.reshape(4, 3), ((3, 4),)),
    Case("reshape_minus1", lambda a: ops.reshape(a, (2, -1)), lambda a: a.reshape(2, -1),
         ((3, 4),)),
    Case("broadcast_to", lambda a: ops.broadcast_to(a, (3, 2, 4)),
         lambda a: np.broadcast_to(a, (3, 2, 4)), ((2, 1),)),
    Case("broadcast_to_0d", lambda a: ops.broadcast_to(a, (2, 3)),
         lambda a: np.broadcast_to(a, (2, 3)), ((1,),)),
    Case("summation_all", ops.summation, np.sum, ((3, 4),)),
    Case("summation_axis", lambda a: ops.summation(a, 1), lambda a: a.sum(axis=1),
         ((3, 4, 2),)),
    Case("summation_axes", lambda a: ops.summation(a, (0, 2)), lambda a: a.sum(axis=(0, 2)),
         ((3, 4, 2),)),
    Case("mean", lambda a: ops.mean(a, 1), lambda a: a.mean(axis=1), ((3, 4),)),
    Case("max_axis", lambda a: ops.max(a, 1), lambda a: a.max(axis=1), ((3, 5),)),
    Case("max_all", ops.max, np.max, ((3, 5),)),
    Case("matmul", ops.matmul, np.matmul, ((3, 4), (4, 5))),
    Case("matmul_batched", ops.matmul, np.matmul, ((2, 3, 4, 5), (5, 3))),
    Case("matmul_broadcast", ops.matmul, np.matmul, ((5, 4), (2, 3, 4, 3))),
    Case("matmul_batch_bcast", ops.matmul, np.matmul, ((2, 1, 3, 4), (1, 3, 4, 2))),
    Case("linear", ops.linear, lambda x, w, b: x @ w + b, ((3, 4), (4, 5), (1, 5))),
    Case("linear_flat_bias", ops.linear, lambda x, w, b: x @ w + b, ((3, 4), (4, 5), (5,))),
    Case("linear_batched", ops.linear, lambda x, w, b: x @ w + b,
         ((2, 3, 4), (4, 5), (1, 5))),
    Case("linear_no_bias", ops.linear, np.matmul, ((3, 4), (4, 2))),
    Case("softmax_xent_mean",
         lambda z: ops.softmax_cross_entropy(z, _const_like(_LABELS, z), reduction="mean"),
         lambda z: np.mean(_lse_ref(z, 1) - z[np.arange(4), _LABELS.astype(int)]), ((4, 6),)),
    Case("logsoftmax", ops.logsoftmax, lambda a: a - _lse_ref(a, 1)[:, None], ((4, 6),)),
    Case("logsumexp_all", ops.logsumexp, lambda a: _lse_ref(a, None), ((3, 4),)),
    Case("logsumexp_axes", lambda a: ops.logsumexp(a, (0, 2)), lambda a: _lse_ref(a, (0, 2)),
         ((3, 4, 2),)),
    Case("stack", lambda a, b, c: ops.stack([a, b, c], 1),
         lambda a, b, c: np.stack([a, b, c], 1), ((3, 4), (3, 4), (3, 4))),
    Case("split", lambda a: ops.split(a, 1),
         lambda a: tuple(a[:, i] for i in range(a.shape[1])), ((3, 4),)),
    Case("flip", lambda a: ops.flip(a, (0, 2)), lambda a: np.flip(a, (0, 2)), ((2, 3, 4),)),
    Case("dilate", lambda a: ops.dilate(a, (0, 1), 2), lambda a: _dilate_ref(a, (0, 1), 2),
         ((2, 3),)),
    Case("undilate", lambda a: ops.undilate(a, (1,), 1), lambda a: a[:, ::2], ((3, 6),)),
    Case("getitem", lambda a: a[1:3, ::2, 1], lambda a: a[1:3, ::2, 1], ((4, 5, 3),)),
    Case("getitem_ellipsis", lambda a: a[..., -1], lambda a: a[..., -1], ((2, 3, 4),)),
    Case("fused_add_scalars", lambda a: ops.fused_add_scalars(a, 1.0, -2.0),
         lambda a: (a + 1.0, a - 2.0), ((3,),)),
    Case("conv", lambda a, b: ops.conv(a, b, stride=1, padding=1),
         lambda a, b: _conv_ref(a, b, 1, 1), ((2, 5, 5, 3), (3, 3, 3, 4))),
    Case("conv_stride2", lambda a, b: ops.conv(a, b, stride=2, padding=1),
         lambda a, b: _conv_ref(a, b, 2, 1), ((2, 7, 6, 3), (3, 3, 3, 2))),
    Case("conv_k5_nopad", lambda a, b: ops.conv(a, b, stride=1, padding=0),
         lambda a, b: _conv_ref(a, b, 1, 0), ((1, 7, 7, 2), (5, 5, 2, 3))),
    Case("conv_k1", lambda a, b: ops.conv(a, b, stride=2, padding=0),
         lambda a, b: _conv_ref(a, b, 2, 0), ((2, 4, 4, 3), (1, 1, 3, 2))),
    Case("conv_bias", lambda a, b, c: ops.conv(a, b, stride=2, padding=1, bias=c),
         lambda a, b, c: _conv_ref(a, b, 2, 1) + c, ((2, 5, 6, 3), (3, 3, 3, 4), (4,))),
    # nn.Conv's form: NCHW in and out, the transposes views inside the node
    Case("conv_nchw_bias",
         lambda a, b, c: ops.conv(a, b, stride=2, padding=1, bias=c, layout="NCHW"),
         lambda a, b, c: (_conv_ref(a.transpose(0, 2, 3, 1), b, 2, 1) + c).transpose(0, 3, 1, 2),
         ((2, 3, 5, 6), (3, 3, 3, 4), (4,))),
    Case("conv_nchw_stride1",
         lambda a, b: ops.conv(a, b, stride=1, padding=1, layout="NCHW"),
         lambda a, b: _conv_ref(a.transpose(0, 2, 3, 1), b, 1, 1).transpose(0, 3, 1, 2),
         ((2, 4, 5, 5), (3, 3, 4, 3))),
]


def make_inputs(case: Case, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [spec(rng) if callable(spec) else rng.standard_normal(spec) for spec in case.inputs]


def as_list(value) -> list:
    """Tensor or TensorTuple (needle) / array or tuple (numpy) -> list of numpy arrays."""
    if isinstance(value, tuple):
        return [np.asarray(v) for v in value]
    if getattr(value, "_is_tuple", False):
        return [value[i].numpy() for i in range(len(value))]
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        return [value.numpy()]
    return [np.asarray(value)]
