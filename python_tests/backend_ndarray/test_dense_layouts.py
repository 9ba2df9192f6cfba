"""Elementwise ops and reductions on dense permuted layouts (``NDArray.is_dense``): the values
equal NumPy's, the result keeps the operand's layout, and no compact copy of it is made.

Such views are what a convolution hands on (an NCHW view of its NHWC output); copying them
into row-major order before every elementwise op and reduction cost ResNet9 a sixth of a
training step.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from needle.backend_ndarray import NDArray, cpu, cpu_numpy

DEVICES = [d for d in (cpu(), cpu_numpy()) if d.enabled()]


@st.composite
def dense_views(draw):
    """(base values, permutation): ``NDArray(base).permute(perm)`` is dense, non-compact
    unless the permutation is the identity."""
    ndim = draw(st.integers(2, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    perm = tuple(draw(st.permutations(range(ndim))))
    seed = draw(st.integers(0, 2**16))
    base = np.random.default_rng(seed).standard_normal(shape)
    return base, perm


class CompactCounter:
    """Counts the backend's compact-copy kernel calls while installed on a device."""

    def __init__(self, device):
        self.device, self.calls = device, []

    def __enter__(self):
        original = self.device.mod.compact
        # (source buffer, shape, strides) of each copy
        self.device.__dict__["compact"] = lambda *a: (self.calls.append((a[0],) + a[2:4]),
                                                      original(*a))[1]
        return self

    def __exit__(self, *exc):
        self.device.__dict__.pop("compact", None)


def test_is_dense_cases():
    d = cpu_numpy()
    a = NDArray(np.arange(24.0).reshape(2, 3, 4), device=d)
    assert a.is_dense() and a.permute((2, 0, 1)).is_dense()
    assert not a[:, 1:, :].is_dense()  # a slice skips elements
    assert not a[1:, :, :].is_dense()  # an offset
    assert not NDArray(np.ones(4), device=d).reshape((1, 4)).broadcast_to((3, 4)).is_dense()
    b = NDArray(np.arange(6.0), device=d).reshape((6, 1)).permute((1, 0))  # size-1 dims
    assert b.is_dense()


@pytest.mark.parametrize("device", DEVICES, ids=str)
@settings(max_examples=60, deadline=None)
@given(case=dense_views(), op=st.sampled_from(["exp", "tanh", "neg", "abs", "scalar_mul",
                                                "scalar_rsub"]))
def test_unary_and_scalar_ops_keep_the_layout(device, case, op):
    base, perm = case
    view = NDArray(base, device=device).permute(perm)
    want_in = base.transpose(perm)
    fns = {"exp": (lambda a: a.exp(), np.exp), "tanh": (lambda a: a.tanh(), np.tanh),
           "neg": (lambda a: -a, np.negative), "abs": (lambda a: a.abs(), np.abs),
           "scalar_mul": (lambda a: a * 2.5, lambda a: a * 2.5),
           "scalar_rsub": (lambda a: 1 - a, lambda a: 1 - a)}
    ours, theirs = fns[op]
    with CompactCounter(device) as copies:
        out = ours(view)
    np.testing.assert_allclose(out.numpy(), theirs(want_in), rtol=1e-5, atol=1e-5)
    assert copies.calls == []
    assert out.strides == view.strides or out.is_compact()


@pytest.mark.parametrize("device", DEVICES, ids=str)
@settings(max_examples=60, deadline=None)
@given(case=dense_views(), other_kind=st.sampled_from(["same", "compact", "broadcast",
                                                       "sliced"]),
       op=st.sampled_from(["add", "mul", "sub", "div", "maximum"]), swap=st.booleans())
def test_binary_ops_on_dense_views(device, case, other_kind, op, swap):
    base, perm = case
    view = NDArray(base, device=device).permute(perm)
    x = base.transpose(perm)
    rng = np.random.default_rng(1)
    y = rng.standard_normal(x.shape) + 3.0  # away from 0 for div
    if other_kind == "same":
        other = NDArray(y.transpose(np.argsort(perm)), device=device).permute(perm)
    elif other_kind == "compact":
        other = NDArray(y, device=device)
    elif other_kind == "broadcast":
        y = np.broadcast_to(y[..., :1], x.shape)
        other = NDArray(np.ascontiguousarray(y[..., :1]), device=device).broadcast_to(x.shape)
    else:
        wide = np.concatenate([y, y[..., :1]], axis=-1)
        other = NDArray(wide, device=device)[tuple(slice(0, n) for n in x.shape)]
    a, b, xa, ya = (other, view, y, x) if swap else (view, other, x, y)
    fns = {"add": (lambda p, q: p + q, np.add), "mul": (lambda p, q: p * q, np.multiply),
           "sub": (lambda p, q: p - q, np.subtract), "div": (lambda p, q: p / q, np.divide),
           "maximum": (lambda p, q: p.maximum(q), np.maximum)}
    ours, theirs = fns[op]
    with CompactCounter(device) as copies:
        out = ours(a, b)
    np.testing.assert_allclose(out.numpy(), theirs(xa, ya), rtol=1e-5, atol=1e-5)
    if other_kind == "same":  # both share the layout: no copy, the layout kept
        assert copies.calls == []
        assert out.strides == view.strides or out.is_compact()
    if not view.is_compact() and (not swap or not other.is_compact()):
        # the dense view is not copied (with a compact left operand one of the two must be:
        # the result then follows the left one's row-major layout)
        assert all(source is not view._handle for source, _, _ in copies.calls)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@settings(max_examples=60, deadline=None)
@given(case=dense_views(), data=st.data(), keepdims=st.booleans(),
       op=st.sampled_from(["sum", "max"]))
def test_reductions_of_dense_views(device, case, data, keepdims, op):
    base, perm = case
    view = NDArray(base, device=device).permute(perm)
    x = base.transpose(perm)
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, x.ndim - 1), min_size=1))))
    out = getattr(view, op)(axis=axes, keepdims=keepdims)
    want = getattr(np, op)(x, axis=axes, keepdims=keepdims)
    assert out.shape == want.shape
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_nchw_view_of_nhwc_summed_over_channels_axes_without_copy(device):
    """The bias gradient of a convolution: sum of an NCHW view of NHWC data over N, H, W."""
    rng = np.random.default_rng(2)
    nhwc = rng.standard_normal((3, 4, 5, 6))
    view = NDArray(nhwc, device=device).permute((0, 3, 1, 2))
    with CompactCounter(device) as copies:
        out = view.sum(axis=(0, 2, 3))
        full = view.sum()
    np.testing.assert_allclose(out.numpy(), nhwc.sum(axis=(0, 1, 2)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full.numpy(), nhwc.sum(), rtol=1e-6, atol=1e-5)
    assert copies.calls == []


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("keepdims", [False, True])
def test_nhwc_view_of_nchw_reduced_in_steps_without_copy(device, op, keepdims):
    """nn.Conv's bias gradient: an NHWC view of an NCHW gradient summed over N, H, W, in two
    passes over compact buffers (no copy of the gradient): a sum over N first (a column
    sum), then H·W per channel; max and min with H·W >= 256 the planes first, then over N
    (shorter planes are copied for them: see NDArray._reduce_in_steps)."""
    rng = np.random.default_rng(3)
    nchw = rng.standard_normal((3, 5, 16, 17))
    view = NDArray(nchw, device=device).permute((0, 2, 3, 1))
    x = nchw.transpose(0, 2, 3, 1)
    for axes in [(0, 1, 2), (1, 2), (0, 1, 2, 3)]:
        with CompactCounter(device) as copies:
            out = getattr(view, op)(axis=axes, keepdims=keepdims)
        want = getattr(np, op)(x, axis=axes, keepdims=keepdims)
        assert out.shape == want.shape
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
        assert all(source is not view._handle for source, _, _ in copies.calls)
    small = NDArray(nchw[:, :, :4, :4].copy(), device=device).permute((0, 2, 3, 1))
    with CompactCounter(device) as copies:
        out = getattr(small, op)(axis=(0, 1, 2))
    np.testing.assert_allclose(out.numpy(), getattr(np, op)(
        nchw[:, :, :4, :4].transpose(0, 2, 3, 1), axis=(0, 1, 2)), rtol=1e-5, atol=1e-5)
    # sums never copy; max / min below the threshold make one transposing copy
    assert len(copies.calls) == (0 if op == "sum" else 1)
