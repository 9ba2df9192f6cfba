"""The main job's model zoo and optimizers, built through needle's public API only."""
from __future__ import annotations

import math

from .config import UsageError


def device_by_name(name: str | None):
    """``cpu()``, ``cpu_numpy()`` or ``cuda()`` by name (default: needle's default device)."""
    import needle.backend_ndarray as nd

    if name is None:
        return nd.default_device()
    device = nd.device_by_name(name)
    if not device.enabled():
        raise UsageError(f"device {name}() is not available here, expected one of "
                         f"{[str(d) for d in nd.all_devices()]}")
    return device


class SmallCNN:
    """Factory for a 2-conv network over square single-channel images."""

    @staticmethod
    def build(side: int, classes: int, device, dtype="float32"):
        from needle import nn

        kw = {"device": device, "dtype": dtype}
        flat = 32 * math.ceil(side / 2) ** 2
        return nn.Sequential(
            _image_view(side),
            nn.Conv(1, 16, 3, **kw), nn.BatchNorm2d(16, **kw), nn.ReLU(),
            nn.Conv(16, 32, 3, stride=2, **kw), nn.BatchNorm2d(32, **kw), nn.ReLU(),
            nn.Flatten(), nn.Linear(flat, 64, **kw), nn.ReLU(), nn.Linear(64, classes, **kw))


def _image_view(side: int):
    from needle import nn, ops

    class ImageView(nn.Module):
        """(B, side·side) → (B, 1, side, side)."""

        def forward(self, x):
            return ops.reshape(x, (x.shape[0], 1, side, side))

    return ImageView()


def _mlp_resnet_builder():
    """``MLPResNet`` of apps/mlp_resnet.py, the repository's one MLP-ResNet builder, whether
    apps/ (``import training``) or the repository root (``import apps.training``) is on the
    path."""
    try:
        import mlp_resnet
    except ImportError:
        from apps import mlp_resnet
    return mlp_resnet.MLPResNet


def build_model(name: str, in_features: int, classes: int, hidden: int, device):
    """One of ``mlp_resnet``, ``mlp``, ``cnn`` on ``device`` (a ``Sequential``)."""
    from needle import nn

    if name == "mlp_resnet":  # the course's: 3 blocks of hidden → hidden//2 → hidden, Dropout 0.1
        return _mlp_resnet_builder()(in_features, hidden, num_blocks=3, num_classes=classes,
                                     drop_prob=0.1, device=device)
    if name == "mlp":
        return nn.Sequential(nn.Linear(in_features, hidden, device=device), nn.ReLU(),
                             nn.Linear(hidden, classes, device=device))
    side = int(round(math.sqrt(in_features)))
    if side * side != in_features:
        raise UsageError(f"--model cnn needs square images, got {in_features} features")
    return SmallCNN.build(side, classes, device)


def build_optimizer(name: str, params, lr: float, weight_decay: float):
    """Adam, or SGD with momentum 0.9, over ``params``."""
    from needle import optim

    if name == "adam":
        return optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
