"""Core tensor edge cases that used to give a wrong or unclear answer: each is now either
computed as NumPy computes it or refused with a NeedleError naming the op and the value."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle._core.errors import AxisError, DTypeError, IndexOutOfRange, ShapeError


@pytest.mark.parametrize("axes", [1.5, "1", (0, 1.0), True])
def test_summation_refuses_axes_that_are_not_ints(device, axes):
    a = ndl.Tensor(np.ones((2, 3), np.float32), device=device)
    with pytest.raises(AxisError, match="summation: ax"):
        ndl.summation(a, axes=axes)


def test_summation_still_takes_ints_tuples_and_lists(device):
    a = ndl.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=device)
    assert ndl.summation(a, axes=1).numpy().tolist() == [3.0, 12.0]
    assert ndl.summation(a, axes=[0, 1]).numpy().tolist() == 15.0
    assert ndl.summation(a, axes=np.int64(0)).numpy().tolist() == [3.0, 5.0, 7.0]


@pytest.mark.parametrize("key", [True, False, (0, True)])
def test_a_bool_index_is_refused_not_read_as_an_int(device, key):
    a = ndl.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=device)
    with pytest.raises(IndexOutOfRange, match="unsupported index.*got bool"):
        a[key]
    with pytest.raises(IndexOutOfRange, match="unsupported index.*got bool"):
        a.realize_cached_data()[key]


def test_integers_float32_cannot_hold_are_refused(device):
    with pytest.raises(DTypeError, match=r"integer 16777217 cannot be held exactly in float32.*"
                                         r"got 16777217 -> 16777216"):
        ndl.Tensor(np.array([1, 16777217]), device=device)
    with pytest.raises(DTypeError, match="integer -16777217"):
        ndl.Tensor([-16777217], device=device)


def test_integers_are_computed_exactly_where_the_dtype_holds_them(device):
    labels = ndl.Tensor(np.array([0, 3, 9, 16777216, 16777218]), device=device)
    assert labels.dtype == "float32"  # the course's coercion of ints, unchanged
    assert labels.numpy().tolist() == [0, 3, 9, 16777216, 16777218]
    wide = ndl.Tensor(np.array([16777217]), device=device, dtype="float64")
    assert int(wide.numpy()[0]) == 16777217


def test_none_is_refused_not_nan(device):
    with pytest.raises(DTypeError, match="expected numbers, a list or an array, got None"):
        ndl.Tensor(None, device=device)
    with pytest.raises(DTypeError, match="got None inside the data"):
        ndl.Tensor([1.0, None], device=device)


def test_logsumexp_of_infinities_follows_numpy(device):
    z = np.array([[-np.inf, -np.inf], [np.inf, 1.0], [-np.inf, 0.0], [1.0, 2.0]], np.float32)
    with np.errstate(divide="ignore"):  # the NumPy backend's log(0) = -inf
        out = ndl.logsumexp(ndl.Tensor(z, device=device), axes=(1,)).numpy()
    assert out[0] == -np.inf and out[1] == np.inf and out[2] == 0.0
    np.testing.assert_allclose(out[3], np.log(np.exp(1.0) + np.exp(2.0)), rtol=1e-6)
    assert not np.isnan(out).any()


def test_a_write_through_a_stride_0_view_is_refused(device):
    base = nd.array(np.arange(3, dtype=np.float32), device=device)
    view = base.broadcast_to((4, 3))
    with pytest.raises(ShapeError, match=r"setitem: the array repeats elements \(stride 0\).*"
                                         r"shape \(4, 3\) and strides \(0, 1\)"):
        view[0:1, 0:3] = 5.0
    with pytest.raises(ShapeError, match="repeats elements"):
        view[0:2, 0:3] = nd.array(np.ones((2, 3), np.float32), device=device)
    assert base.numpy().tolist() == [0.0, 1.0, 2.0]
    base[0:1] = 7.0  # the array it was broadcast from takes writes
    assert view.numpy()[3].tolist() == [7.0, 1.0, 2.0]
