"""2-D convolution (NHWC input, (KH, KW, Cin, Cout) kernel) as im2col + one matmul.

The im2col matrix is a strided *view* of the padded input (shape ``(N, H', W', KH, KW, Cin)``,
no Python loop over pixels), compacted once and multiplied by the reshaped kernel. Both
gradients are themselves convolutions (of the dilated output gradient), so they are
differentiable again.

Example:
    >>> import needle as ndl, numpy as np
    >>> x = ndl.Tensor(np.ones((1, 4, 4, 2)), dtype="float32")
    >>> w = ndl.Tensor(np.ones((3, 3, 2, 5)), dtype="float32")
    >>> ndl.conv(x, w, stride=1, padding=1).shape
    (1, 4, 4, 5)
"""
from __future__ import annotations

from .._core.errors import ShapeError
from ..autograd import TensorOp
from ..autograd.tensor import const as _leaf
from . import _array as A
from . import _conv_kernels as K
from .ops_linear import bias_gradient
from .ops_shape import Dilate, Flip, GetItem, Permute, Transpose


def _check(a, b, stride: int, padding: int, given=None) -> None:
    """``a`` is the NHWC input (a view of ``given``, the caller's NCHW input, when set: the
    messages then show the shape the caller passed)."""
    shown, layout = (tuple(a.shape), "NHWC") if given is None else (tuple(given), "NCHW")
    if len(a.shape) != 4 or len(b.shape) != 4:
        raise ShapeError(
            f"conv: expected a 4-D {layout} input and a 4-D (K, K, Cin, Cout) kernel, got "
            f"{shown} and {tuple(b.shape)}")
    if a.shape[3] != b.shape[2]:
        raise ShapeError(
            f"conv: channels differ, expected input channels == kernel Cin, got "
            f"{a.shape[3]} (input {shown}) and {b.shape[2]} (kernel {tuple(b.shape)})")
    if stride < 1 or padding < 0:
        raise ShapeError(
            f"conv: expected stride >= 1 and padding >= 0, got stride={stride}, "
            f"padding={padding}")
    for name, n, k in (("height", a.shape[1], b.shape[0]), ("width", a.shape[2], b.shape[1])):
        if n + 2 * padding < k:
            raise ShapeError(
                f"conv: kernel larger than the padded input, expected padded {name} >= {k}, "
                f"got {n + 2 * padding}")


def _im2col(a, kh: int, kw: int, stride: int, padding: int):
    """The (N·H'·W', KH·KW·Cin) patch matrix of ``a``: one strided view, compacted once."""
    if padding:
        a = A.pad(a, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    n, h, w, cin = a.shape
    ho, wo = (h - kh) // stride + 1, (w - kw) // stride + 1
    sn, sh, sw, sc = A.compact_strides(a.shape)
    cols = A.strided_view(a, (n, ho, wo, kh, kw, cin),
                          (sn, sh * stride, sw * stride, sh, sw, sc))
    return A.reshape(A.compact(cols), (n * ho * wo, kh * kw * cin)), (n, ho, wo)


def _live_taps(size: int, k: int, stride: int, padding: int) -> tuple:
    """Kernel taps ``[lo, hi)`` along one dim that meet the input for some output position.

    Taps outside it only ever multiply padding (ResNet9's 3x3 convolutions of a 1x1 map keep
    1 tap of 9). Returns ``(lo, hi, new_padding)`` when cutting the kernel to ``[lo, hi)``
    keeps the output size with symmetric padding, else ``(0, k, padding)``.
    """
    out = (size + 2 * padding - k) // stride + 1
    lo, hi = max(0, padding - (out - 1) * stride), min(k, size + padding)
    top = padding - lo
    bottom = (out - 1) * stride + (hi - lo) - size - top
    if (lo, hi) == (0, k) or top != bottom or top < 0:
        return 0, k, padding
    return lo, hi, top


_PRUNED: dict = {}  # (x's h, w, kernel's kh, kw, stride, padding) -> _pruned's answer


def _pruned(x_shape, w_shape, stride: int, padding: int):
    """``(rows, cols, padding)`` of the live part of the kernel, or None when all of it is.
    Kept per geometry: a model asks for the same few on every step."""
    key = (x_shape[1], x_shape[2], w_shape[0], w_shape[1], stride, padding)
    try:
        return _PRUNED[key]
    except KeyError:
        pass
    except TypeError:  # unhashable: worked out every time
        return _pruned_taps(x_shape, w_shape, stride, padding)
    cut = _pruned_taps(x_shape, w_shape, stride, padding)
    if len(_PRUNED) >= 1024:
        _PRUNED.clear()
    _PRUNED[key] = cut
    return cut


def _pruned_taps(x_shape, w_shape, stride: int, padding: int):
    r0, r1, pad_h = _live_taps(x_shape[1], w_shape[0], stride, padding)
    c0, c1, pad_w = _live_taps(x_shape[2], w_shape[1], stride, padding)
    if (r0, r1, c0, c1) == (0, w_shape[0], 0, w_shape[1]) or pad_h != pad_w:
        return None
    return slice(r0, r1), slice(c0, c1), pad_h


def _conv_compute(a, b, stride: int, padding: int, bias=None):
    """``conv(a, b)``, plus ``bias`` (Cout values, already checked) on every pixel."""
    cut = _pruned(a.shape, b.shape, stride, padding)
    if cut is not None:
        rows, cols, padding = cut
        b = A.compact(A.slice_view(b, (rows, cols, slice(None), slice(None))))
    out = K.forward(a, b, stride, padding, bias)
    if out is not None:
        return out
    kh, kw, cin, cout = b.shape
    cols, (n, ho, wo) = _im2col(a, kh, kw, stride, padding)
    out = A.reshape(A.matmul(cols, A.reshape(A.compact(b), (kh * kw * cin, cout))),
                    (n, ho, wo, cout))
    return out if bias is None else A.add_row_to_fresh(out, bias)


def _conv_gradient_arrays(g, x, w, stride: int, padding: int, need_x: bool, need_w: bool):
    """Both gradients straight from arrays (no graph), as im2col-style matmuls.

    d kernel = patches(x)ᵀ @ g and d input = col2im(g @ kernelᵀ): the same FLOPs as the
    forward for any stride, where the differentiable form (a convolution of the *dilated*
    gradient) multiplies by stride² zeros.
    """
    cut = _pruned(x.shape, w.shape, stride, padding)
    if cut is not None:  # taps that only see padding: zero kernel gradient, no input gradient
        rows, cols, pad = cut
        live = A.compact(A.slice_view(w, (rows, cols, slice(None), slice(None))))
        grad_x, grad_live = _conv_gradient_arrays(g, x, live, stride, pad, need_x, need_w)
        grad_w = None
        if need_w:
            grad_w = A.zeros(w.shape, w)
            grad_w[rows, cols, :, :] = grad_live
        return grad_x, grad_w
    grad_x = K.input_grad(g, w, x.shape, stride, padding) if need_x else None
    grad_w = K.weight_grad(x, g, w.shape, stride, padding) if need_w else None
    if (grad_x is not None or not need_x) and (grad_w is not None or not need_w):
        return grad_x, grad_w
    n, h, wd, cin = x.shape
    kh, kw, _, cout = w.shape
    _, ho, wo, _ = g.shape
    g2 = A.reshape(A.compact(g), (n * ho * wo, cout))
    if need_w:
        cols, _ = _im2col(x, kh, kw, stride, padding)
        # (gᵀ @ cols)ᵀ, not colsᵀ @ g: the operand that must be transposed (copied) is then
        # g (N·H'·W' × Cout) rather than the KH·KW·Cin times wider patch matrix
        grad_w_t = A.matmul(A.swap_last(g2), cols)
        grad_w = A.reshape(A.compact(A.swap_last(grad_w_t)), (kh, kw, cin, cout))
    if need_x and stride == 1 and kh == kw and padding <= kh - 1:
        # stride 1: the input gradient is the full correlation of g with the flipped kernel,
        # one im2col and one matmul (col2im below would take kh·kw strided passes)
        w_flip = A.compact(A.permute(A.flip(w, (0, 1)), (0, 1, 3, 2)))
        grad_x = _conv_compute(g, w_flip, 1, kh - 1 - padding)
    elif need_x:
        w2 = A.reshape(A.compact(w), (kh * kw * cin, cout))
        cols_g = A.reshape(A.matmul(g2, A.swap_last(w2)), (n, ho, wo, kh, kw, cin))
        padded = A.zeros((n, h + 2 * padding, wd + 2 * padding, cin), g)
        A.col2im_add(padded, cols_g, stride)
        grad_x = padded[:, padding:padding + h, padding:padding + wd, :] if padding else padded
        grad_x = A.compact(grad_x)
    return grad_x, grad_w


def _crop(t, sizes):
    """``t[:, :sizes[0], :sizes[1], :]`` (skipped when nothing to cut)."""
    shape = t.shape
    if shape[1] == sizes[0] and shape[2] == sizes[1]:
        return t
    slices = (slice(0, shape[0], 1), slice(0, sizes[0], 1), slice(0, sizes[1], 1),
              slice(0, shape[3], 1))
    return GetItem(slices, (shape[0], sizes[0], sizes[1], shape[3]))(t)


_NHWC_OF_NCHW, _NCHW_OF_NHWC = (0, 2, 3, 1), (0, 3, 1, 2)


class Conv(TensorOp):
    """Convolution of NHWC ``a`` with kernel ``b`` of shape (KH, KW, Cin, Cout), plus an
    optional ``bias`` of Cout values (a third input).

    Output height ``(H + 2·padding − KH) // stride + 1`` (likewise width). The bias is added
    into the convolution's own output buffer from its row (``nn.Conv``'s bias: one node and
    no output-sized buffer more, where composed it took a reshape, a broadcast and a sum).

    ``layout="NCHW"`` takes an NCHW ``a`` and gives an NCHW result (``nn.Conv``): the
    transposes are views inside the node (the kernels read the NHWC view of ``a`` in place
    and the result is an NCHW view of their NHWC output), where two permute nodes each way
    cost ~10 µs a layer per direction in Python.
    """

    save_inputs = (0, 1)  # the bias's value is not needed for any gradient

    def __init__(self, stride: int = 1, padding: int = 0, layout: str = "NHWC"):
        if layout not in ("NHWC", "NCHW"):
            raise ValueError(f"conv: expected layout 'NHWC' or 'NCHW', got {layout!r}")
        self.stride, self.padding, self.layout = int(stride), int(padding), layout

    def compute(self, a, b, bias=None):
        given = None
        if self.layout == "NCHW":
            if len(a.shape) != 4:
                raise ShapeError(f"conv: expected a 4-D NCHW input, got {tuple(a.shape)}")
            given, a = a.shape, A.permute(a, _NHWC_OF_NCHW)
        _check(a, b, self.stride, self.padding, given)
        if bias is not None:
            A.check_row("conv", "output channel", bias.shape, b.shape[3], 4)
        out = _conv_compute(a, b, self.stride, self.padding, bias)
        return A.permute(out, _NCHW_OF_NHWC) if self.layout == "NCHW" else out

    def gradient(self, out_grad, node):
        x, w = node.saved_tensors
        if self.layout == "NCHW":  # the NHWC graph between permutes
            nhwc = Conv(self.stride, self.padding)
            x, out_grad = Permute(_NHWC_OF_NCHW)(x), Permute(_NHWC_OF_NCHW)(out_grad)
            grads = nhwc._graph_gradient(out_grad, x, w, node.inputs)
            return (Permute(_NCHW_OF_NHWC)(grads[0]),) + tuple(grads[1:])
        return self._graph_gradient(out_grad, x, w, node.inputs)

    def _graph_gradient(self, out_grad, x, w, inputs):
        s, p = self.stride, self.padding
        _, h, wd, _ = x.shape
        kh, kw = w.shape[0], w.shape[1]
        g = Dilate((1, 2), s - 1)(out_grad) if s > 1 else out_grad
        # d input: full correlation of the dilated gradient with the flipped kernel, then
        # drop the padding rows/columns (positions beyond the last window get zero)
        w_flip = Transpose((2, 3))(Flip((0, 1))(w))
        if kh == kw:
            full = Conv(1, kh - 1)(g, w_flip)
        else:
            full = Conv(1, 0)(_pad_hw(g, kh - 1, kw - 1), w_flip)
        grad_x = _window(full, p, p, h, wd)
        # d kernel: correlate the padded input (channels as batch) with the dilated gradient
        _, ho, wo, _ = out_grad.shape
        g_trim = _crop(g, ((ho - 1) * s + 1, (wo - 1) * s + 1))
        x_t = Permute((3, 1, 2, 0))(x)
        g_t = Permute((1, 2, 0, 3))(g_trim)
        grad_w = _crop(Conv(1, p)(x_t, g_t), (kh, kw))
        if len(inputs) == 3:
            return (grad_x, Permute((1, 2, 0, 3))(grad_w),
                    bias_gradient(out_grad, inputs[2].shape))
        return grad_x, Permute((1, 2, 0, 3))(grad_w)

    def plain_gradient(self, out_grad, node):
        # plain backward: the fast array form, no graph
        x, w = node.saved_tensors
        s, p = self.stride, self.padding
        inputs = node.inputs
        need_x, need_w = inputs[0].requires_grad, inputs[1].requires_grad
        g, xa = out_grad.cached_data, x.cached_data
        if self.layout == "NCHW":
            g, xa = A.permute(g, _NHWC_OF_NCHW), A.permute(xa, _NHWC_OF_NCHW)
        gx, gw = _conv_gradient_arrays(g, xa, w.cached_data, s, p, need_x, need_w)
        if gx is not None and self.layout == "NCHW":
            gx = A.permute(gx, _NCHW_OF_NHWC)
        grads = (_leaf(gx) if need_x else None, _leaf(gw) if need_w else None)
        if len(inputs) == 2:
            return grads
        bias = inputs[2]
        return grads + ((_leaf(A.row_gradient(g, bias.shape)) if bias.requires_grad else None),)


def _pad_hw(t, ph: int, pw: int):
    """Zero-pad height by ``ph`` and width by ``pw`` on both sides, as a differentiable op."""
    if not ph and not pw:
        return t
    from .ops_shape import SliceScatter

    n, h, w, c = t.shape
    shape = (n, h + 2 * ph, w + 2 * pw, c)
    slices = (slice(0, n, 1), slice(ph, ph + h, 1), slice(pw, pw + w, 1), slice(0, c, 1))
    return SliceScatter(slices, shape)(t)


def _window(t, top: int, left: int, h: int, w: int):
    shape = t.shape
    if (top, left, h, w) == (0, 0, shape[1], shape[2]):
        return t
    slices = (slice(0, shape[0], 1), slice(top, top + h, 1), slice(left, left + w, 1),
              slice(0, shape[3], 1))
    return GetItem(slices, (shape[0], h, w, shape[3]))(t)


def conv(a, b, stride=1, padding=1, bias=None, layout="NHWC"):
    """Convolution (note the course's function default ``padding=1``), plus ``bias`` (Cout
    values) when given; ``layout="NCHW"`` for an NCHW input and result (see :class:`Conv`).

    Example:
        >>> import numpy as np
        >>> import needle as ndl
        >>> x, w = ndl.Tensor(np.ones((1, 3, 3, 2))), ndl.Tensor(np.ones((3, 3, 2, 1)))
        >>> conv(x, w, padding=0, bias=ndl.Tensor([0.5])).numpy().reshape(-1).tolist()
        [18.5]
    """
    if bias is None:
        return Conv(stride, padding, layout)(a, b)
    return Conv(stride, padding, layout)(a, b, bias)
