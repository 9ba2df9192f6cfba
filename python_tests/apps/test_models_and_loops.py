"""apps/: ResNet9, LanguageModel, MLPResNet and the simple_ml training loops."""
from __future__ import annotations

import math
import os

import mlp_resnet  # noqa: E402
import models  # noqa: E402
import numpy as np
import pytest
import simple_ml  # noqa: E402

import needle.backend_ndarray as nd
from needle import nn, optim
from needle.autograd import Tensor
from needle.data import DataLoader, NDArrayDataset

MNIST_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "mnist")


def _count(model):
    return int(sum(math.prod(p.shape) for p in model.parameters()))


def test_resnet9_parameters_and_forward():
    np.random.seed(0)
    model = models.ResNet9(device=nd.cpu_numpy())
    assert _count(model) == 431946
    np.random.seed(0)
    again = models.ResNet9(device=nd.cpu_numpy())
    for a, b in zip(model.parameters(), again.parameters(), strict=False):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x = Tensor(np.random.rand(2, 3, 32, 32), device=nd.cpu_numpy())
    assert model(x).shape == (2, 10)


def test_resnet9_is_importable_as_apps_models():
    from apps.models import ResNet9  # the course's test_conv import
    assert ResNet9 is not None


@pytest.mark.parametrize("seq_model", ["rnn", "lstm"])
def test_language_model_shapes_and_grads(device, seq_model):
    np.random.seed(1)
    lm = models.LanguageModel(6, 11, 5, num_layers=2, seq_model=seq_model, device=device)
    x = Tensor(np.random.randint(0, 11, size=(4, 3)), device=device)
    out, h = lm(x)
    assert out.shape == (12, 11)
    if seq_model == "lstm":
        assert h[0].shape == (2, 3, 5) and h[1].shape == (2, 3, 5)
    else:
        assert h.shape == (2, 3, 5) and h.device == device
    out.sum().backward()
    assert all(p.grad is not None for p in lm.parameters())


def test_mlp_resnet_structure_and_epoch():
    np.random.seed(2)
    model = mlp_resnet.MLPResNet(10, hidden_dim=8, num_blocks=2, num_classes=3)
    # Linear(10,8) + 2 × [Linear(8,4), BN(4), Linear(4,8), BN(8)] + Linear(8,3)
    expected = (10 * 8 + 8) + 2 * ((8 * 4 + 4) + 8 + (4 * 8 + 8) + 16) + (8 * 3 + 3)
    assert _count(model) == expected
    X = np.random.randn(50, 10).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.uint8) + (X[:, 1] > 1).astype(np.uint8)
    loader = DataLoader(NDArrayDataset(X, y), batch_size=16, shuffle=True)
    opt = optim.Adam(model.parameters(), lr=0.01)
    first = mlp_resnet.epoch(loader, model, opt)
    for _ in range(8):
        last = mlp_resnet.epoch(loader, model, opt)
    err, loss = mlp_resnet.epoch(DataLoader(NDArrayDataset(X, y), batch_size=50), model)
    assert 0.0 <= err <= 1.0 and last[1] < first[1]
    # Eval returns the batch-weighted loss: recompute it directly.
    model.eval()
    logits = model(Tensor(X))
    ref_loss = nn.SoftmaxLoss()(logits, Tensor(y)).numpy()
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    assert err == pytest.approx(np.mean(logits.numpy().argmax(1) != y))


def test_mlp_resnet_keeps_the_course_parameter_order_and_state_names():
    """Checkpoints and seeded runs depend on this order: stem, then per block Linear, norm,
    Linear, norm, then the head; BatchNorm's running statistics are state, not parameters."""
    model = mlp_resnet.MLPResNet(64, 32, num_blocks=2, num_classes=10)
    block = [(32, 16), (1, 16), (16,), (16,), (16, 32), (1, 32), (32,), (32,)]
    assert [p.shape for p in model.parameters()] == [(64, 32), (1, 32), *block, *block,
                                                     (32, 10), (1, 10)]
    names = list(model.state_dict())
    assert names[:2] == ["modules.0.weight", "modules.0.bias"]
    assert names[2:8] == [f"modules.2.modules.0.fn.modules.{i}.{k}" for i, k in
                          [(0, "weight"), (0, "bias"), (1, "weight"), (1, "bias"),
                           (1, "running_mean"), (1, "running_var")]]
    assert names[-2:] == ["modules.4.weight", "modules.4.bias"] and len(names) == 28


@pytest.mark.parametrize("dtype", [None, "float64"])
def test_every_mlp_resnet_caller_builds_the_same_model(dtype):
    """apps/training (``--model mlp_resnet``) and apps/memory_report.py build through
    mlp_resnet.MLPResNet: the same seed gives the same parameters, in order, on the device."""
    import memory_report
    from training.models import build_model

    dev = nd.cpu_numpy()

    def params(build):
        np.random.seed(7)
        return [(p.shape, str(p.device), p.dtype, p.numpy()) for p in build().parameters()]

    ours = params(lambda: mlp_resnet.MLPResNet(30, 20, 3, 4, drop_prob=0.1, device=dev,
                                               dtype=dtype))
    assert {d for _, d, _, _ in ours} == {str(dev)}
    assert {t for _, _, t, _ in ours} == {dtype or "float32"}
    if dtype is None:  # the callers build in float32
        for other in (params(lambda: build_model("mlp_resnet", 30, 4, 20, dev)),
                      params(lambda: memory_report._mlp_resnet(30, 20, 3, 4, dev))):
            assert len(other) == len(ours) == 28
            for (s1, d1, t1, v1), (s2, d2, t2, v2) in zip(ours, other, strict=True):
                assert (s1, d1, t1) == (s2, d2, t2)
                np.testing.assert_array_equal(v1, v2)


def test_softmax_loss_and_nn_epoch_against_numpy():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((20, 5)).astype(np.float32)
    y = rng.integers(0, 3, 20).astype(np.uint8)
    W1 = rng.standard_normal((5, 4)).astype(np.float32) / 2
    W2 = rng.standard_normal((4, 3)).astype(np.float32) / 2
    Z = X @ W1
    Y = np.eye(3, dtype=np.float32)[y]
    ref = np.mean(np.log(np.exp(Z[:, :3]).sum(1)) - (Z[:, :3] * Y).sum(1))
    got = simple_ml.softmax_loss(Tensor(Z[:, :3]), Tensor(Y)).numpy()
    assert float(got) == pytest.approx(float(ref), rel=1e-5)

    w1, w2 = W1.astype(np.float64), W2.astype(np.float64)
    for s in range(0, 20, 10):  # hand-derived backprop, batch 10
        xb, yb = X[s:s + 10], Y[s:s + 10]
        h = np.maximum(xb @ w1, 0)
        z = h @ w2
        p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        dz = (p - yb) / 10
        g2, g1 = h.T @ dz, xb.T @ ((dz @ w2.T) * (h > 0))
        w1, w2 = w1 - 0.2 * g1, w2 - 0.2 * g2
    n1, n2 = simple_ml.nn_epoch(X, y, Tensor(W1), Tensor(W2), lr=0.2, batch=10)
    np.testing.assert_allclose(n1.numpy(), w1, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(n2.numpy(), w2, rtol=1e-4, atol=1e-5)
    loss, err = simple_ml.loss_err(Tensor(X @ W1[:, :3]), y)
    assert err == pytest.approx(np.mean((X @ W1[:, :3]).argmax(1) != y))


@pytest.mark.skipif(not os.path.exists(os.path.join(MNIST_DIR, "t10k-images-idx3-ubyte.gz")),
                    reason="MNIST t10k files absent")
def test_parse_mnist_t10k():
    X, y = simple_ml.parse_mnist(os.path.join(MNIST_DIR, "t10k-images-idx3-ubyte.gz"),
                                 os.path.join(MNIST_DIR, "t10k-labels-idx1-ubyte.gz"))
    assert X.shape == (10000, 784) and X.dtype == np.float32 and y.dtype == np.uint8
    assert X.min() == 0.0 and X.max() == 1.0


def test_cifar10_and_ptb_loops_on_synthetic_data(tmp_path):
    np.random.seed(0)
    X = np.random.rand(12, 3, 32, 32).astype(np.float32)
    y = np.random.randint(0, 10, 12).astype(np.uint8)
    loader = DataLoader(NDArrayDataset(X, y), batch_size=6, shuffle=True)
    model = models.ResNet9()  # the loader's default device
    acc, loss = simple_ml.train_cifar10(model, loader, n_epochs=1)
    assert 0.0 <= acc <= 1.0 and np.isfinite(loss)
    acc_e, loss_e = simple_ml.evaluate_cifar10(model, loader)
    assert 0.0 <= acc_e <= 1.0 and np.isfinite(loss_e)

    (tmp_path / "train.txt").write_text("a b c d a b c d a b\n" * 6)
    (tmp_path / "test.txt").write_text("a b c d\n" * 3)
    from needle.data import Corpus, batchify

    corpus = Corpus(str(tmp_path))
    train = batchify(corpus.train, 4, device=None, dtype="float32")
    lm = models.LanguageModel(5, len(corpus.dictionary), 8, seq_model="lstm")
    before = simple_ml.evaluate_ptb(lm, train, seq_len=4)[1]
    for _ in range(5):
        acc, loss = simple_ml.train_ptb(lm, train, seq_len=4, lr=0.05, optimizer=optim.Adam,
                                        clip=1.0)
    after = simple_ml.evaluate_ptb(lm, train, seq_len=4)[1]
    assert after < before and 0.0 <= acc <= 1.0
