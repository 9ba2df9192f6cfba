"""embedding (row gather): forward vs NumPy indexing, scatter-add gradient, errors."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle._core.errors import IndexOutOfRange
from needle.autograd import Tensor, gradcheck
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd-mode test")


def _setup(device, dtype="float64"):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 3))
    ids = np.array([[1, 4, 1], [6, 0, 1]], dtype=np.float32)  # id 1 three times
    return w, ids, Tensor(w, device=device, dtype=dtype), Tensor(ids, device=device,
                                                                  requires_grad=False)


def test_forward_is_numpy_indexing(device):
    w, ids, tw, tids = _setup(device)
    out = ndl.ops.embedding(tw, tids)
    assert out.shape == (2, 3, 3)
    np.testing.assert_array_equal(out.numpy(), w[ids.astype(int)])


def test_gradient_scatter_adds_repeated_ids(device):
    w, ids, tw, tids = _setup(device)
    g = np.random.default_rng(1).standard_normal((2, 3, 3))
    ndl.ops.embedding(tw, tids).backward(Tensor(g, device=device, dtype="float64"))
    want = np.zeros_like(w)
    for pos, row in enumerate(ids.astype(int).reshape(-1)):
        want[row] += g.reshape(-1, 3)[pos]
    np.testing.assert_allclose(tw.grad.numpy(), want, rtol=1e-12)
    assert tids.grad is None


def test_graph_gradient_matches_plain_gradient(device):
    _, _, tw, tids = _setup(device)
    (ndl.ops.embedding(tw, tids) ** 2).sum().backward(create_graph=True)
    graph = tw.grad.numpy()
    _, _, tw2, tids2 = _setup(device)
    (ndl.ops.embedding(tw2, tids2) ** 2).sum().backward()
    np.testing.assert_allclose(graph, tw2.grad.numpy(), rtol=1e-12)


def test_gradcheck(device):
    _, _, tw, tids = _setup(device)
    assert gradcheck(lambda w: ndl.ops.embedding(w, tids), tw, atol=1e-6, rtol=1e-4)


def test_id_out_of_range_names_op(device):
    _, _, tw, _ = _setup(device)
    # at the call, or (cuda(): the check waits for the device) at the next copy to the host
    with pytest.raises(IndexOutOfRange, match=r"embedding: id out of range.*\[0, 7\).*got 9"):
        ndl.ops.embedding(tw, Tensor([[9.0]], device=device, requires_grad=False)).numpy()


@pytest.mark.parametrize("bad", [-1.0, 2.5, float("nan")])
def test_non_integer_and_negative_ids_are_refused_not_truncated(device, bad):
    _, _, tw, _ = _setup(device)
    with pytest.raises(IndexOutOfRange, match=r"embedding: id out of range"):
        ndl.ops.embedding(tw, Tensor([[1.0, bad]], device=device, requires_grad=False)).numpy()


def test_an_id_checked_in_backward_too(device):
    """The backward kernel checks the ids it scatters by, not only the forward."""
    mod = device.mod
    if not hasattr(mod, "embedding_backward"):
        pytest.skip(f"{device} reads ids on the host (no embedding kernels)")
    g, ids, out = mod.Array(6, "float32"), mod.Array(2, "float32"), mod.Array(9, "float32")
    mod.from_numpy(np.array([0.0, 3.0], np.float32), ids)
    with pytest.raises(IndexError, match="position 1"):
        mod.embedding_backward(g, ids, out, 3, 3, 2)
        mod.to_numpy(out, (9,), (1,), 0)  # cuda(): the check runs where the host waits


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_cpp_kernels_equal_the_numpy_reference_bitwise(dtype):
    """Gather is exact; the scatter adds repeated ids in position order, as numpy.add.at."""
    from needle.backend_ndarray import cpu, cpu_numpy

    if not cpu().enabled():
        pytest.skip("the C++ backend is not built")
    rng = np.random.default_rng(3)
    num, dim, n = 11, 5, 40
    table = rng.standard_normal((num, dim)).astype(dtype)
    ids = rng.integers(0, num, n).astype(dtype)  # many repeats
    g = rng.standard_normal((n, dim)).astype(dtype)
    results = []
    for dev in (cpu(), cpu_numpy()):
        mod = dev.mod
        t, i, gg = (mod.Array(a.size, dtype) for a in (table, ids, g))
        for src, dst in ((table, t), (ids, i), (g, gg)):
            mod.from_numpy(src.reshape(-1), dst)
        rows, dt = mod.Array(n * dim, dtype), mod.Array(num * dim, dtype)
        mod.embedding_forward(t, i, rows, num, dim, n)
        mod.embedding_backward(gg, i, dt, num, dim, n)
        results.append([mod.to_numpy(rows, (n, dim), (dim, 1), 0),
                        mod.to_numpy(dt, (num, dim), (dim, 1), 0)])
    want = np.zeros((num, dim), dtype)
    np.add.at(want, ids.astype(int), g)
    for got in results:
        np.testing.assert_array_equal(got[0], table[ids.astype(int)])
        np.testing.assert_array_equal(got[1], want)


@pytest.mark.parametrize("bad", [-1.0, 2.5, 7.0])
def test_the_array_op_path_refuses_ids_as_the_kernels_do(bad):
    """float16 weights have no embedding kernel: ids are checked on the host there, with the
    kernels' rule and message (a 2.5 was truncated to 2 before)."""
    w = Tensor(np.ones((7, 3)), device=ndl.cpu_numpy(), dtype="float16")
    ids = Tensor([[1.0, bad]], device=ndl.cpu_numpy(), requires_grad=False)
    with pytest.raises(IndexOutOfRange, match=r"embedding: id out of range at position 1, "
                                              r"expected an integer in \[0, 7\)"):
        ndl.ops.embedding(w, ids)
    assert ndl.ops.embedding(w, Tensor([[6.0]], device=ndl.cpu_numpy(),
                                       requires_grad=False)).shape == (1, 1, 3)
