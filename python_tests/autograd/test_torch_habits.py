"""PyTorch's reading habits on Tensor: item/float/len/numel/size/dim and sum(dim=, keepdim=).

Each is checked against NumPy on every device; the reductions with ``dim``/``keepdim`` are
also checked by a numerical gradient, and the course's spellings keep their meaning.
"""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle._core.errors import AxisError, ShapeError
from needle.autograd import gradcheck
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode tests")


def _tensor(device, shape=(2, 3, 4), seed=0):
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return data, ndl.Tensor(data, device=device)


def test_item_and_float_read_a_one_element_tensor(device):
    data, t = _tensor(device)
    loss = t.sum()
    assert isinstance(loss.item(), float)
    np.testing.assert_allclose(loss.item(), data.sum(), rtol=1e-5)
    assert float(loss) == loss.item()
    # any shape holding one element reads, as in PyTorch
    assert ndl.Tensor([[2.5]], device=device).item() == 2.5
    assert float(ndl.Tensor([7.0], device=device)) == 7.0


def test_item_refuses_more_than_one_element(device):
    _, t = _tensor(device)
    with pytest.raises(ShapeError, match=r"Tensor.item: expected a tensor with one element, "
                                         r"got shape \(2, 3, 4\)"):
        t.item()
    with pytest.raises(ShapeError):
        float(t)


def test_len_numel_size_dim_match_numpy(device):
    data, t = _tensor(device)
    assert len(t) == len(data) == 2
    assert t.numel() == data.size
    assert t.size() == data.shape and isinstance(t.size(), tuple)
    assert [t.size(d) for d in range(-3, 3)] == [data.shape[d] for d in range(-3, 3)]
    assert t.dim() == data.ndim == 3
    assert ndl.Tensor(np.float32(1.0), device=device).numel() == 1


def test_len_of_a_scalar_and_size_out_of_range_are_refused(device):
    _, t = _tensor(device)
    with pytest.raises(ShapeError, match=r"len\(Tensor\): expected at least one dimension"):
        len(t.sum())
    for bad in (3, -4, 1.0, True):
        with pytest.raises(AxisError, match=r"Tensor.size: dim out of range, expected an int"):
            t.size(bad)


def test_tensors_stay_truthy(device):
    # `if tensor:` meant "is there a tensor" before __len__ existed; it still does
    assert ndl.Tensor(np.zeros((0, 3), np.float32), device=device)
    assert ndl.Tensor(0.0, device=device)


@pytest.mark.parametrize("dim", [0, 1, -1, (0, 2), [1, 2], None])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_dim_and_keepdim_are_axes_and_keepdims(device, op, dim, keepdim):
    data, t = _tensor(device)
    axis = tuple(dim) if isinstance(dim, list) else dim
    expected = getattr(np, op)(data, axis=axis, keepdims=keepdim)
    got = getattr(t, op)(dim=dim, keepdim=keepdim)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)
    # NumPy's keepdims and the course's positional axes give the same
    same = getattr(t, op)(axis, keepdims=keepdim)
    np.testing.assert_array_equal(same.numpy(), got.numpy())


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_dim_keepdim_gradients_are_numerically_right(op):
    x = np.random.default_rng(1).standard_normal((3, 4))
    assert gradcheck(lambda a: getattr(a, op)(dim=1, keepdim=True) * a, x)
    assert gradcheck(lambda a: getattr(a, op)(dim=(0, 1), keepdim=True) * a, x)


def test_both_spellings_at_once_are_refused():
    t = ndl.Tensor(np.ones((2, 2), np.float32))
    with pytest.raises(AxisError, match=r"Tensor.sum: axes given twice"):
        t.sum(0, dim=1)
    with pytest.raises(AxisError, match=r"Tensor.mean: keepdims given twice"):
        t.mean(keepdims=True, keepdim=True)


def test_course_sum_is_unchanged():
    t = ndl.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert t.sum().shape == () and t.sum(axes=(1,)).shape == (2,)
    assert t.sum(1).numpy().tolist() == [3.0, 12.0]


def test_manual_seed_decides_every_draw():
    from needle import nn
    from needle._core.errors import RNGStateError

    def draws():
        layer = nn.Linear(3, 2)
        mask = nn.Dropout(0.5)(ndl.Tensor(np.ones((4, 4), np.float32))).numpy()
        return layer.weight.numpy(), mask, np.random.permutation(5)

    ndl.manual_seed(123)
    first = draws()
    np.random.seed(0)  # anything in between
    ndl.manual_seed(123)
    for a, b in zip(first, draws(), strict=True):
        np.testing.assert_array_equal(a, b)
    ndl.manual_seed(124)
    assert not np.array_equal(first[0], draws()[0])
    for bad in (-1, 2 ** 32, 1.5, "1", True):
        with pytest.raises(RNGStateError, match=r"manual_seed: seed out of range"):
            ndl.manual_seed(bad)
