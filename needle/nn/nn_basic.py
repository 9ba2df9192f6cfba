"""Basic layers of the course: Linear, activations, containers, losses, norms, dropout.

Creation order of parameters is the order of random draws (weight before bias, each one
NumPy global-RNG draw of the full shape): the course's golden values depend on it, keep it.

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import nn
    >>> np.random.seed(0); layer = nn.Linear(3, 2)
    >>> layer.weight.shape, layer.bias.shape
    ((3, 2), (1, 2))
"""
from __future__ import annotations

import contextlib
import functools
import math
from sys import getrefcount as _getrefcount

from .. import init, ops
from .._core.errors import ShapeError
from ..autograd import Tensor, is_grad_enabled
from ..autograd.grad_mode import STATE, compiling
from ..autograd.tensor import replace_data
from ..autograd.versions import note_replaced
from ..backend_ndarray import NDArray
from ..backend_ndarray import ewise_program as _program
from ..memory import framework_category
from .nn_module import Module, Parameter

__all__ = ["Parameter", "Module", "Identity", "Linear", "Flatten", "ReLU", "Tanh", "Sigmoid",
           "Sequential", "SoftmaxLoss", "BatchNorm1d", "BatchNorm2d", "LayerNorm1d",
           "Dropout", "Residual"]


class Identity(Module):
    """y = x."""

    def forward(self, x: Tensor) -> Tensor:
        return x


def _bias_for(bias: Tensor, out_shape: tuple) -> Tensor:
    """Bias of shape (1, n) or (n,) broadcast to ``out_shape`` (..., n)."""
    if bias.ndim != len(out_shape):
        bias = ops.reshape(bias, (1,) * (len(out_shape) - 1) + (out_shape[-1],))
    return ops.broadcast_to(bias, out_shape)


class Linear(Module):
    """y = x @ W + b; ``weight`` (in, out) and ``bias`` (1, out) are Kaiming-uniform.

    ``x`` may have any number of leading dimensions.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype="float32"):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(init.kaiming_uniform(
            in_features, out_features, device=device, dtype=dtype, requires_grad=True))
        self.bias = None
        if bias:
            b = init.kaiming_uniform(out_features, 1, device=device, dtype=dtype)
            self.bias = Parameter(ops.reshape(b, (1, out_features)).detach(),
                                  requires_grad=True)

    def forward(self, X: Tensor) -> Tensor:
        if X.shape[-1] != self.in_features:
            raise ShapeError(
                f"Linear: input features differ, expected last dimension {self.in_features}, "
                f"got shape {X.shape}")
        if self.bias is not None and STATE.cast_policy is None and isinstance(X, Tensor) \
                and X.ndim >= 2:
            # one graph node (ops.linear) for the product, the bias broadcast and the sum:
            # bitwise the composed layer's forward and gradients
            return ops.linear(X, self.weight, self.bias)
        # under autocast the product runs in the low dtype and the bias add promotes (a
        # float32 bias gives a float32 output), as the composed ops' own rules say
        y = X @ self.weight
        if self.bias is not None:
            y = y + _bias_for(self.bias, y.shape)
        return y


class Flatten(Module):
    """(B, d1, d2, ...) → (B, d1·d2·...)."""

    def forward(self, X: Tensor) -> Tensor:
        return ops.reshape(X, (X.shape[0], math.prod(X.shape[1:])))


class ReLU(Module):
    """max(x, 0)."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.relu(x)


class Tanh(Module):
    """tanh(x)."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.tanh(x)


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)), through the fused op when the ops layer has one."""
    fused = getattr(ops, "sigmoid", None)
    if fused is not None:
        return fused(x)
    return (ops.exp(-x) + 1) ** -1


class Sigmoid(Module):
    """1 / (1 + exp(-x))."""

    def forward(self, x: Tensor) -> Tensor:
        return sigmoid(x)


class Sequential(Module):
    """Apply ``modules`` in order (kept as ``self.modules``)."""

    def __init__(self, *modules):
        super().__init__()
        self.modules = modules

    def forward(self, x: Tensor) -> Tensor:
        modules = self.modules
        last = len(modules) - 1
        i = 0
        while i <= last:
            module = modules[i]
            if i < last and _fuses_with_relu(module, modules[i + 1]):
                # BatchNorm then ReLU: one node, the same values (BatchNorm1d.forward_relu)
                x = module.forward_relu(x)
                i += 2
            else:
                x = module(x)
                i += 1
        return x


def _fuses_with_relu(module, after) -> bool:
    """``module`` is a plain BatchNorm1d/2d and ``after`` a plain ReLU: no subclass and no
    per-instance ``forward`` that could see or change the value between them."""
    return (type(after) is ReLU and type(module) in _RELU_FUSERS
            and "forward" not in module.__dict__ and "forward" not in after.__dict__)


def _kept_for(x: Tensor):
    """Memory category scope for a constant an op will save for backward together with ``x``
    (a dropout mask, one-hot targets): it is ``activation`` memory like the op's other saved
    input, not ``other`` (it is made outside any op). No scope when nothing is recorded."""
    if is_grad_enabled() and x.requires_grad:
        return framework_category("activation")
    return contextlib.nullcontext()


class SoftmaxLoss(Module):
    """Mean over the batch of ``logsumexp(z) - z[y]``; ``y`` holds class indices."""

    def forward(self, logits: Tensor, y: Tensor) -> Tensor:
        if logits.ndim != 2:
            raise ShapeError(f"SoftmaxLoss: logits must be (batch, classes), expected 2 "
                             f"dimensions, got shape {logits.shape}")
        n, k = logits.shape
        if ops.softmax_xent_has_kernel(logits) and y.shape == (n,):
            # one node, the mean included, no one-hot targets (ops.softmax_cross_entropy)
            return ops.softmax_cross_entropy(logits, y, reduction="mean")
        with _kept_for(logits):
            y_one_hot = init.one_hot(k, y, device=logits.device, dtype=logits.dtype)
        lse = ops.logsumexp(logits, axes=(1,))
        picked = ops.summation(logits * y_one_hot)
        return (ops.summation(lse) - picked) / n


def _sole_owner(tensor) -> bool:
    """True when ``tensor``'s data is an NDArray whose buffer nothing else references: no
    other Tensor, array, view or saved graph data can see a write into it, so it may be
    updated in place (a state dict or a user holding the array keeps its values instead)."""
    return type(tensor.cached_data) is NDArray and _reference_counts(tensor) == _SOLE_COUNTS


def _reference_counts(holder) -> tuple:
    """CPython reference counts of ``holder.cached_data`` and of its ``_handle``."""
    data = holder.cached_data
    return _getrefcount(data), _getrefcount(data._handle)


class _Probe:
    __slots__ = ("cached_data", "_handle")


def _calibrate() -> tuple:
    # the counts _reference_counts sees when the holder and the array are the only holders
    # (measured, not assumed: the interpreter's own references differ between versions)
    holder, array = _Probe(), _Probe()
    holder.cached_data, array._handle = array, _Probe()
    del array
    return _reference_counts(holder)


_SOLE_COUNTS = _calibrate()


@functools.lru_cache(maxsize=None)
def _running_averages_program() -> _program.Program:
    """``(old_mean * s0 + mean * s1, old_var * s0 + var * s1)`` over inputs (old_mean, mean,
    old_var, var): both running averages in one kernel, each the composed update's three
    kernels bit for bit."""
    prog = _program.Program(4)
    for old, now in ((0, 1), (2, 3)):
        prog.store(prog.binary("add", prog.scalar("mul", old, 0), prog.scalar("mul", now, 1)))
    return prog


class BatchNorm1d(Module):
    """Normalise each feature over the batch; running statistics for eval mode.

    ``weight``/``bias`` are Parameters (ones/zeros); ``running_mean``/``running_var`` are
    plain Tensors updated as ``(1 - momentum) * running + momentum * batch`` (biased var).
    """

    def __init__(self, dim, eps=1e-5, momentum=0.1, device=None, dtype="float32"):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.momentum = momentum
        self.weight = Parameter(init.ones(dim, device=device, dtype=dtype), requires_grad=True)
        self.bias = Parameter(init.zeros(dim, device=device, dtype=dtype), requires_grad=True)
        self.running_mean = init.zeros(dim, device=device, dtype=dtype)
        self.running_var = init.ones(dim, device=device, dtype=dtype)

    def _update_running(self, mean, var) -> None:
        """The running averages from the batch's ``mean`` and ``var`` (arrays)."""
        m = self.momentum
        # On the arrays, in the stats' own dtype (np mode lets float64 batches reach a float32
        # layer): no graph is kept alive across steps, the Tensors keep their identity, and no
        # op is dispatched through autograd (six per layer and step as Tensor arithmetic).
        # Where the backend runs elementwise programs, both updates are one kernel instead of
        # six, bitwise the same (a compiled step fuses the composed ones itself).
        # Eager, with both statistics reachable only through their Tensors, the kernel
        # writes them in place (it reads each element before it stores it): no new buffers
        # per layer and step. A compiled step keeps the new buffers its plan was traced with.
        in_place = _sole_owner(self.running_mean) and _sole_owner(self.running_var)
        arrays = (self.running_mean.realize_cached_data(), mean,
                  self.running_var.realize_cached_data(), var)
        if not compiling() and _program.available(arrays):
            if in_place:
                _program.run(_running_averages_program(), arrays, [1 - m, m],
                             [arrays[0], arrays[2]])
                note_replaced(self.running_mean)  # the data versions count updates as before
                note_replaced(self.running_var)
                return
            news = _program.run(_running_averages_program(), arrays, [1 - m, m])
        else:
            news = [old * (1 - m) + now * m for old, now in (arrays[:2], arrays[2:])]
        replace_data(self.running_mean, news[0])
        replace_data(self.running_var, news[1])

    def forward(self, x: Tensor) -> Tensor:
        return self._forward(x, False)

    def forward_relu(self, x: Tensor) -> Tensor:
        """``relu(self(x))``, the same values; in training mode on a device with the fused
        kernels one graph node (``ops.batch_norm(..., relu=True)``), where the two modules
        make two. ``nn.Sequential`` calls it for a BatchNorm followed by a ReLU.

        Example:
            >>> import numpy as np
            >>> import needle as ndl
            >>> from needle import nn
            >>> bn, x = nn.BatchNorm1d(2), ndl.Tensor(np.array([[1.0, 4.0], [3.0, 2.0]]))
            >>> bn.forward_relu(x).numpy().round(3).tolist()
            [[0.0, 1.0], [1.0, 0.0]]
        """
        return self._forward(x, True)

    def _forward(self, x: Tensor, relu: bool) -> Tensor:
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ShapeError(f"BatchNorm1d: expected input (batch, {self.dim}), got shape "
                             f"{x.shape}")
        n, d = x.shape
        if self.training and ops.batch_norm_has_kernel(x):
            return self._fused(x, relu)
        y = self._composed(x, n, d)
        return ops.relu(y) if relu else y

    def _composed(self, x: Tensor, n: int, d: int) -> Tensor:
        if self.training:
            mean = ops.summation(x, axes=(0,)) / n
            xc = x - ops.broadcast_to(ops.reshape(mean, (1, d)), x.shape)
            var = ops.summation(xc * xc, axes=(0,)) / n
            self._update_running(mean.realize_cached_data(), var.realize_cached_data())
        else:
            mean, var = self.running_mean, self.running_var
            xc = x - ops.broadcast_to(ops.reshape(mean, (1, d)), x.shape)
        std = ops.broadcast_to(ops.reshape((var + self.eps) ** 0.5, (1, d)), x.shape)
        w = ops.broadcast_to(ops.reshape(self.weight, (1, d)), x.shape)
        b = ops.broadcast_to(ops.reshape(self.bias, (1, d)), x.shape)
        return w * (xc / std) + b

    def _fused(self, x: Tensor, relu: bool = False) -> Tensor:
        # one graph node and two kernels (ops.batch_norm) instead of ~12 nodes and ~30 kernels;
        # the same statistics and running-average update as the composed path above
        y, mean, var = ops.batch_norm_arrays(x, self.weight, self.bias, self.eps, relu)
        self._update_running(mean, var)
        return y


class BatchNorm2d(BatchNorm1d):
    """BatchNorm over channels of an NCHW input (N·H·W rows of C features)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

    def _forward(self, x: Tensor, relu: bool) -> Tensor:
        if x.ndim != 4:
            raise ShapeError(f"BatchNorm2d: expected an NCHW input, got shape {x.shape}")
        if x.shape[1] != self.dim:  # before the composed path would name BatchNorm1d's rows
            raise ShapeError(f"BatchNorm2d: expected {self.dim} channels (axis 1), got "
                             f"shape {x.shape}")
        if self.training and ops.batch_norm_has_kernel(x):
            # statistics over N, H, W straight from NCHW: no transposes
            return self._fused(x, relu)
        s = x.shape
        rows = ops.transpose(ops.transpose(x, (1, 2)), (2, 3))  # N, H, W, C
        y = super()._forward(ops.reshape(rows, (s[0] * s[2] * s[3], s[1])), False)
        y = ops.reshape(y, (s[0], s[2], s[3], s[1]))
        y = ops.transpose(ops.transpose(y, (2, 3)), (1, 2))
        return ops.relu(y) if relu else y


_RELU_FUSERS = (BatchNorm1d, BatchNorm2d)  # exact types: see _fuses_with_relu


class LayerNorm1d(Module):
    """Normalise each row over its last axis (biased variance), then scale and shift.

    Accepts any number of leading dimensions.
    """

    def __init__(self, dim, eps=1e-5, device=None, dtype="float32"):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = Parameter(init.ones(dim, device=device, dtype=dtype), requires_grad=True)
        self.bias = Parameter(init.zeros(dim, device=device, dtype=dtype), requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        if shape[-1] != self.dim:
            raise ShapeError(f"LayerNorm1d: last dimension differs, expected {self.dim}, got "
                             f"shape {shape}")
        axis, keep = len(shape) - 1, shape[:-1] + (1,)
        mean = ops.reshape(ops.summation(x, axes=(axis,)) / self.dim, keep)
        xc = x - ops.broadcast_to(mean, shape)
        var = ops.reshape(ops.summation(xc * xc, axes=(axis,)) / self.dim, keep)
        std = ops.broadcast_to((var + self.eps) ** 0.5, shape)
        return _bias_for(self.weight, shape) * (xc / std) + _bias_for(self.bias, shape)


class Dropout(Module):
    """Train mode: zero each entry with probability ``p`` and scale by 1/(1-p); eval: identity.

    One ``rand`` draw of the input's shape per training call, even when ``p`` is 0.
    """

    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        with _kept_for(x):
            mask = init.randb(*x.shape, p=1 - self.p, device=x.device, dtype=x.dtype)
        if self.p >= 1:
            return x * mask
        # (x * mask) / (1 - p) as one node: the same two kernels, one node fewer per call
        return ops.masked_divide(x, mask, 1 - self.p)


class Residual(Module):
    """y = fn(x) + x."""

    def __init__(self, fn: Module):
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x) + x
