"""2-D convolution layer over NCHW inputs ("same" padding K//2).

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import nn
    >>> np.random.seed(0); conv = nn.Conv(3, 8, 3, stride=2)
    >>> conv(ndl.Tensor(np.ones((2, 3, 8, 8)))).shape
    (2, 8, 4, 4)
"""
from __future__ import annotations

import math

from .. import init, ops
from .._core.errors import ShapeError
from ..autograd import Tensor
from .nn_module import Module, Parameter

__all__ = ["Conv"]


def _first(value) -> int:
    return int(value[0]) if isinstance(value, (tuple, list)) else int(value)


class Conv(Module):
    """Conv2d: ``weight`` (K, K, Cin, Cout) Kaiming-uniform with fan_in Cin·K², then ``bias``
    (Cout,) uniform in ±1/√(Cin·K²). Tuple kernel sizes/strides use their first element.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, bias=True,
                 device=None, dtype="float32"):
        super().__init__()
        k = _first(kernel_size)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = k
        self.stride = _first(stride)
        self.padding = k // 2
        fan_in, fan_out = in_channels * k * k, out_channels * k * k
        self.weight = Parameter(init.kaiming_uniform(
            fan_in, fan_out, shape=(k, k, in_channels, out_channels), device=device,
            dtype=dtype), requires_grad=True)
        self.bias = None
        if bias:
            bound = 1.0 / math.sqrt(fan_in)
            self.bias = Parameter(init.rand(out_channels, low=-bound, high=bound,
                                            device=device, dtype=dtype), requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ShapeError(f"Conv: expected an NCHW input with {self.in_channels} channels, "
                             f"got shape {x.shape}")
        # one node: NCHW in and out as views of the NHWC kernels' operands (the kernels read
        # the input in place, no copy), the bias added into the output buffer
        return ops.conv(x, self.weight, stride=self.stride, padding=self.padding,
                        bias=self.bias, layout="NCHW")
