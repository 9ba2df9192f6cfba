"""The backend's fused convolution kernels, where a device has them (array level, no graph).

``ops_conv`` asks these first and falls back to im2col + matmul when they return ``None``:
NumPy mode, devices without the kernels and float16. The C++ backend's kernels
(``conv2d_forward`` and ``conv2d_forward_bias``, ``conv2d_weight_grad``, ``conv2d_input_grad``)
build im2col rows chunk
by chunk in cache instead of materialising the whole patch matrix (``src/conv_impl.h``); the
CUDA backend's build the patch matrix in one kernel and hand the products to cuBLAS
(``cuda_kernels/conv.cu``). The NumPy reference device ``cpu_numpy()`` has the same kernels
(``ndarray_backend_numpy_fused.py``), the oracle the others are tested against.

Example:
    >>> import numpy as np
    >>> from needle.backend_ndarray import NDArray, cpu_numpy
    >>> x = NDArray(np.ones((1, 4, 4, 2)), device=cpu_numpy())
    >>> w = NDArray(np.ones((3, 3, 2, 5)), device=cpu_numpy())
    >>> y = forward(x, w, 1, 1)  # stride 1, padding 1: an interior output sums 3·3·2 ones
    >>> y.shape, float(y.numpy()[0, 1, 1, 0]), float(y.numpy()[0, 0, 0, 0])
    ((1, 4, 4, 5), 18.0, 8.0)
    >>> forward(x.astype("float16"), w.astype("float16"), 1, 1) is None  # no float16 kernel
    True
"""
from __future__ import annotations

from ..backend_ndarray.ndarray import NDArray
from ..backend_selection import BACKEND

_ND = BACKEND == "nd"
_DTYPES = ("float32", "float64")


def _module(*arrays):
    """The backend module when every array can use the fused kernels, else None."""
    if not _ND:
        return None
    first = arrays[0]
    mod = getattr(first.device, "mod", None)
    if mod is None or not hasattr(mod, "conv2d_forward") or first.dtype not in _DTYPES:
        return None
    for a in arrays[1:]:
        if a.device != first.device or a.dtype != first.dtype:
            return None
    return mod


def _geometry(x, w, stride: int, padding: int) -> tuple:
    n, h, wd, c = x.shape
    kh, kw, _, cout = w.shape
    return (n, h, wd, c, kh, kw, cout, stride, padding)


def _workspace(mod, like, geom: tuple) -> tuple:
    """``(handle,)`` of a fresh workspace when the backend asks for one (the CUDA backend's
    patch matrix), else ``()``. Allocated here, as an array of the graph, the buffer is
    planned and measured by needle.memory and recorded by needle.compile like any other."""
    size_of = getattr(mod, "conv2d_workspace", None)
    size = size_of(*geom) if size_of is not None else 0
    if not size:
        return ()
    return (NDArray.make((size,), device=like.device, dtype=like.dtype)._handle,)


def _operand(mod, a, name: str) -> tuple:
    """``(array, kwargs)``: ``a`` itself with ``{name_view: (offset, *strides)}`` when the
    backend reads strided operands (``conv2d_takes_views``: nn.Conv's NHWC view of an NCHW
    tensor needs no compact copy then), else a compact ``a`` and no kwargs."""
    if a.is_compact():
        return a, {}
    if getattr(mod, "conv2d_takes_views", False) and min(a.strides) >= 0:
        return a, {name + "_view": (a._offset, *a.strides)}
    return a.compact(), {}


def forward(x, w, stride: int, padding: int, bias=None):
    """``conv(x, w)`` (NHWC, kernel (KH, KW, Cin, Cout)) through the fused kernel, plus
    ``bias`` (an array of Cout values, checked by the caller) on every pixel when given; None
    when there is no kernel for these arrays."""
    mod = _module(x, w)
    if mod is None:
        return None
    n, h, wd, _, kh, kw, cout, _, _ = geom = _geometry(x, w, stride, padding)
    ho, wo = (h + 2 * padding - kh) // stride + 1, (wd + 2 * padding - kw) // stride + 1
    (x, views), w = _operand(mod, x, "x"), w.compact()
    out = NDArray.make((n, ho, wo, cout), device=x.device, dtype=x.dtype)
    with_bias = None
    if bias is not None and bias.device == x.device and bias.dtype == x.dtype:
        with_bias = getattr(mod, "conv2d_forward_bias", None)
    if with_bias is not None:  # added as the kernel stores its output
        with_bias(x._handle, w._handle, bias.compact()._handle, out._handle, *geom, **views)
        return out
    mod.conv2d_forward(x._handle, w._handle, out._handle, *geom, *_workspace(mod, x, geom),
                       **views)
    if bias is not None:
        out._add_row_in_place(bias)
    return out


def weight_grad(x, dy, kernel_shape: tuple, stride: int, padding: int):
    """The kernel gradient (KH, KW, Cin, Cout) of ``conv(x, ·)`` for output gradient ``dy``."""
    mod = _module(x, dy)
    if mod is None:
        return None
    (x, x_views), (dy, dy_views) = _operand(mod, x, "x"), _operand(mod, dy, "dy")
    n, h, wd, c = x.shape
    kh, kw, _, cout = kernel_shape
    dw = NDArray.make(tuple(kernel_shape), device=x.device, dtype=x.dtype)
    geom = (n, h, wd, c, kh, kw, cout, stride, padding)
    mod.conv2d_weight_grad(x._handle, dy._handle, dw._handle, *geom, *_workspace(mod, x, geom),
                           **x_views, **dy_views)
    return dw


def input_grad(dy, w, input_shape: tuple, stride: int, padding: int):
    """The input gradient (N, H, W, Cin) of ``conv(·, w)`` for output gradient ``dy``."""
    mod = _module(dy, w)
    if mod is None:
        return None
    (dy, views), w = _operand(mod, dy, "dy"), w.compact()
    n, h, wd, c = input_shape
    kh, kw, _, cout = w.shape
    dx = NDArray.make(tuple(input_shape), device=dy.device, dtype=dy.dtype)
    geom = (n, h, wd, c, kh, kw, cout, stride, padding)
    mod.conv2d_input_grad(dy._handle, w._handle, dx._handle, *geom, *_workspace(mod, dy, geom),
                          **views)
    return dx
