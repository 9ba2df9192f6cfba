"""The main job: train a model end to end and report held-out accuracy and throughput.

With no arguments it trains an MLP-ResNet on scikit-learn's 8×8 handwritten digits (1,797
real images shipped with scikit-learn, 20% held out) and writes ``runs/summary.json`` and
``runs/training.png``. Run ``python apps/train.py --help`` for the options.

Example:
    $ python apps/train.py --epochs 5 --out runs/quick
    $ python apps/train.py --data mnist --data-dir data --model cnn --device cpu

Data parallelism: ``--nproc N`` re-runs this command on N ranks through needle's launcher
(MPI by default, ``NEEDLE_DIST_BACKEND=tcp`` for ZeroMQ). Every rank draws the same shuffled
order and keeps its slice of each batch; ``DistributedDataParallel`` all-reduces gradients in
buckets during backward, weighting each rank by its number of examples so the update equals the
single-process one on the whole batch. Rank 0 alone prints and writes the outputs.

    $ python apps/train.py --nproc 2 --epochs 5
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "python")):  # run from this repo or a course root
    if os.path.isdir(os.path.join(_p, "needle")) and _p not in sys.path:
        sys.path.append(_p)

import numpy as np  # noqa: E402

MODELS = ("mlp_resnet", "mlp", "cnn")
DATASETS = ("digits", "mnist")
OPTIMIZERS = ("adam", "sgd")
DEVICES = ("cpu", "cpu_numpy", "cuda")


class UsageError(Exception):
    """A bad command line or missing input: reported in one line, exit status 2."""


@dataclass
class Config:
    data: str = "digits"
    data_dir: str | None = None
    model: str = "mlp_resnet"
    epochs: int = 20
    batch_size: int = 64
    optimizer: str = "adam"
    lr: float = 0.003
    weight_decay: float = 1e-4
    hidden: int = 100
    device: str | None = None
    out: str = "runs"
    seed: int = 0
    progress: bool = True
    nproc: int = 1


@dataclass
class History:
    epoch: list = field(default_factory=list)
    train_loss: list = field(default_factory=list)
    train_acc: list = field(default_factory=list)
    test_loss: list = field(default_factory=list)
    test_acc: list = field(default_factory=list)
    examples_per_s: list = field(default_factory=list)


# ---- command line ---------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block, no traceback
        raise UsageError(message)


def parse_args(argv=None) -> Config:
    """Command line → :class:`Config` (raises :class:`UsageError` on bad values)."""
    d = Config()
    p = _Parser(prog="train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=d.data, help=f"one of {DATASETS}")
    p.add_argument("--data-dir", default=None, help="folder with the MNIST IDX .gz files")
    p.add_argument("--model", default=d.model, help=f"one of {MODELS}")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--optimizer", default=d.optimizer, help=f"one of {OPTIMIZERS}")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden width of MLP models")
    p.add_argument("--device", default=None, help=f"one of {DEVICES} (default: cpu if built)")
    p.add_argument("--out", default=d.out, help="output folder for summary.json and the plot")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--nproc", type=int, default=d.nproc,
                   help="data-parallel ranks started through needle.distributed.launch")
    cfg = Config(**vars(p.parse_args(argv)))
    _validate(cfg)
    return cfg


def _choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise UsageError(f"unknown {name} {value!r}, expected one of {', '.join(allowed)}")


def _validate(cfg: Config) -> None:
    _choice("--data", cfg.data, DATASETS)
    _choice("--model", cfg.model, MODELS)
    _choice("--optimizer", cfg.optimizer, OPTIMIZERS)
    if cfg.device is not None:
        _choice("--device", cfg.device, DEVICES)
    for name in ("epochs", "batch_size", "hidden", "nproc"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got "
                             f"{getattr(cfg, name)}")
    if cfg.lr <= 0:
        raise UsageError(f"--lr must be positive, got {cfg.lr}")
    if cfg.data == "mnist":
        if cfg.data_dir is None:
            raise UsageError("--data mnist needs --data-dir DIR holding the IDX .gz files")
        if not os.path.isdir(cfg.data_dir):
            raise UsageError(f"data directory not found: {cfg.data_dir}")


# ---- data -----------------------------------------------------------------------------------
def _holdout(X, y, fraction: float, seed: int):
    order = np.random.RandomState(seed).permutation(X.shape[0])  # own stream: leaves init alone
    n_test = int(round(X.shape[0] * fraction))
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]


def load_digits_split(seed: int = 0, fraction: float = 0.2):
    """scikit-learn's digits as float32 in [0, 1] (64 features) with a seeded hold-out."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    return _holdout(X, digits.target.astype(np.uint8), fraction, seed)


def load_mnist_split(data_dir: str, seed: int = 0):
    """MNIST train/t10k from ``data_dir``; with only the t10k files, 20% of t10k is held out."""
    from needle.data import parse_mnist

    path = {(part, kind): os.path.join(data_dir, f"{part}-{kind}-idx{n}-ubyte.gz")
            for part in ("train", "t10k") for kind, n in (("images", 3), ("labels", 1))}
    have = {part: all(os.path.exists(path[(part, k)]) for k in ("images", "labels"))
            for part in ("train", "t10k")}
    if have["train"] and have["t10k"]:
        X, y = parse_mnist(path[("train", "images")], path[("train", "labels")])
        Xt, yt = parse_mnist(path[("t10k", "images")], path[("t10k", "labels")])
        return X, y, Xt, yt
    if have["t10k"]:
        X, y = parse_mnist(path[("t10k", "images")], path[("t10k", "labels")])
        return _holdout(X, y, 0.2, seed)
    raise UsageError(f"no MNIST files in {data_dir}: expected t10k-images-idx3-ubyte.gz and "
                     f"t10k-labels-idx1-ubyte.gz (and the train-* pair)")


def load_data(cfg: Config):
    if cfg.data == "digits":
        return load_digits_split(cfg.seed)
    return load_mnist_split(cfg.data_dir, cfg.seed)


# ---- models ---------------------------------------------------------------------------------
def _device(name: str | None):
    import needle.backend_ndarray as nd

    if name is None:
        return nd.default_device()
    device = nd.device_by_name(name)
    if not device.enabled():
        raise UsageError(f"device {name}() is not available here, expected one of "
                         f"{[str(d) for d in nd.all_devices()]}")
    return device


class SmallCNN:
    """Factory for a 2-conv network over square single-channel images (kept in apps)."""

    @staticmethod
    def build(side: int, classes: int, device, dtype="float32"):
        from needle import nn

        kw = {"device": device, "dtype": dtype}
        flat = 32 * math.ceil(side / 2) ** 2
        return nn.Sequential(
            _ImageView(side),
            nn.Conv(1, 16, 3, **kw), nn.BatchNorm2d(16, **kw), nn.ReLU(),
            nn.Conv(16, 32, 3, stride=2, **kw), nn.BatchNorm2d(32, **kw), nn.ReLU(),
            nn.Flatten(), nn.Linear(flat, 64, **kw), nn.ReLU(), nn.Linear(64, classes, **kw))


def _ImageView(side: int):  # noqa: N802 - a module factory
    from needle import nn, ops

    class ImageView(nn.Module):
        """(B, side·side) → (B, 1, side, side)."""

        def forward(self, x):
            return ops.reshape(x, (x.shape[0], 1, side, side))

    return ImageView()


def _residual_block(dim: int, device):
    """The hw2 ResidualBlock (dim → dim//2 → dim, BatchNorm, Dropout 0.1), on ``device``."""
    from needle import nn

    inner = nn.Sequential(
        nn.Linear(dim, dim // 2, device=device), nn.BatchNorm1d(dim // 2, device=device),
        nn.ReLU(), nn.Dropout(0.1), nn.Linear(dim // 2, dim, device=device),
        nn.BatchNorm1d(dim, device=device))
    return nn.Sequential(nn.Residual(inner), nn.ReLU())


def build_model(name: str, in_features: int, classes: int, hidden: int, device):
    """One of :data:`MODELS` on ``device``."""
    from needle import nn

    if name == "mlp_resnet":
        return nn.Sequential(
            nn.Linear(in_features, hidden, device=device), nn.ReLU(),
            *[_residual_block(hidden, device) for _ in range(3)],
            nn.Linear(hidden, classes, device=device))
    if name == "mlp":
        return nn.Sequential(nn.Linear(in_features, hidden, device=device), nn.ReLU(),
                             nn.Linear(hidden, classes, device=device))
    side = int(round(math.sqrt(in_features)))
    if side * side != in_features:
        raise UsageError(f"--model cnn needs square images, got {in_features} features")
    return SmallCNN.build(side, classes, device)


def build_optimizer(name: str, params, lr: float, weight_decay: float):
    from needle import optim

    if name == "adam":
        return optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


# ---- training -------------------------------------------------------------------------------
def _batches(X, y, batch_size: int, shuffle: bool, device, shard=(0, 1)):
    """DataLoader over (X, y); with a shard, each batch is cut to this rank's slice."""
    from needle.data import DataLoader, NDArrayDataset

    rank, world = shard
    loader = DataLoader(NDArrayDataset(X, y), batch_size, shuffle, device=device)
    if world == 1:
        return loader
    return _sharded(loader, rank, world)


def _sharded(loader, rank: int, world: int):
    # Every rank draws the same permutation (same seed); each keeps its slice of each batch.
    from needle.autograd import Tensor

    iter(loader)
    for indices in loader.ordering:
        if len(indices) < world:  # a last batch too short to give every rank an example
            break
        part = indices[len(indices) * rank // world:len(indices) * (rank + 1) // world]
        yield tuple(Tensor(a, device=loader.device, requires_grad=False)
                    for a in loader.dataset[part])


def evaluate(model, X, y, batch_size: int, device) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` in eval mode over (X, y)."""
    from needle import nn
    from needle.autograd import no_grad

    model.eval()
    loss_fn = nn.SoftmaxLoss()
    total_loss, correct = 0.0, 0
    with no_grad():
        for Xb, yb in _batches(X, y, max(batch_size, 256), False, device):
            logits = model(Xb)
            labels = yb.numpy().astype(np.int64)
            total_loss += float(loss_fn(logits, yb).numpy()) * labels.shape[0]
            correct += int((logits.numpy().argmax(axis=1) == labels).sum())
    return total_loss / X.shape[0], correct / X.shape[0]


def train_epoch(model, opt, X, y, cfg: Config, device, bar_desc: str,
                shard=(0, 1), ddp=None) -> tuple[float, float, float]:
    """One shuffled pass; returns (mean loss, accuracy, examples per second).

    With ``ddp`` (a DistributedDataParallel around ``model``) each rank trains on its shard
    and gradients are synchronised before every optimizer step.
    """
    from tqdm import tqdm

    from needle import nn

    model.train()
    loss_fn = nn.SoftmaxLoss()
    total_loss, correct, seen = 0.0, 0, 0
    steps = -(-X.shape[0] // cfg.batch_size)
    bar = tqdm(total=steps, desc=bar_desc, disable=not cfg.progress or shard[0] != 0,
               leave=False, dynamic_ncols=True)
    forward = model if ddp is None else ddp
    start = time.perf_counter()
    for Xb, yb in _batches(X, y, cfg.batch_size, True, device, shard):
        if ddp is not None:  # weight this rank by its examples: the global-batch mean
            ddp.set_num_examples(Xb.shape[0])
        logits = forward(Xb)
        loss = loss_fn(logits, yb)
        opt.reset_grad()
        loss.backward()
        if ddp is not None:
            ddp.finish_gradient_sync()
        opt.step()
        labels = yb.numpy().astype(np.int64)
        total_loss += float(loss.numpy()) * labels.shape[0]
        correct += int((logits.numpy().argmax(axis=1) == labels).sum())
        seen += labels.shape[0]
        rate = seen * shard[1] / max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(loss=f"{total_loss / seen:.4f}", ex_s=f"{rate:,.0f}")
        bar.update(1)
    bar.close()
    # throughput of the whole job: every rank processes about as many examples as this one
    return (total_loss / seen, correct / seen,
            seen * shard[1] / max(time.perf_counter() - start, 1e-9))


def train(cfg: Config, *, shard=(0, 1)) -> dict:
    """Train as ``cfg`` says and return the summary (also what ``summary.json`` holds).

    ``shard`` is (rank, world size) of an initialised process group when data-parallel.
    """
    device = _device(cfg.device)
    np.random.seed(cfg.seed)
    X, y, Xt, yt = load_data(cfg)
    classes = int(max(y.max(), yt.max())) + 1
    model = build_model(cfg.model, X.shape[1], classes, cfg.hidden, device)
    opt = build_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.weight_decay)
    ddp = None
    if shard[1] > 1:
        import needle.distributed as dist

        ddp = dist.DistributedDataParallel(model)  # also broadcasts rank 0's parameters
    history = History()
    started = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        loss, acc, rate = train_epoch(model, opt, X, y, cfg, device,
                                      f"epoch {epoch}/{cfg.epochs}", shard, ddp)
        test_loss, test_acc = evaluate(model, Xt, yt, cfg.batch_size, device)
        for key, value in (("epoch", epoch), ("train_loss", loss), ("train_acc", acc),
                           ("test_loss", test_loss), ("test_acc", test_acc),
                           ("examples_per_s", rate)):
            getattr(history, key).append(value)
        if cfg.progress and shard[0] == 0:
            print(f"epoch {epoch:3d}  loss {loss:.4f}  train acc {acc:.4f}  "
                  f"held-out acc {test_acc:.4f}  {rate:,.0f} examples/s", flush=True)
    elapsed = time.perf_counter() - started
    n_params = int(sum(math.prod(p.shape) for p in model.parameters()))
    return {"config": asdict(cfg), "device": str(device), "world_size": shard[1],
            "train_examples": int(X.shape[0]),
            "test_examples": int(Xt.shape[0]), "parameters": n_params,
            "final_test_accuracy": history.test_acc[-1], "final_test_loss": history.test_loss[-1],
            "final_train_loss": history.train_loss[-1],
            "examples_per_second": float(np.median(history.examples_per_s)),
            "train_seconds": elapsed, "history": asdict(history)}


def write_outputs(summary: dict, out_dir: str) -> tuple[str, str]:
    """Write ``summary.json`` and ``training.png`` (loss and accuracy per epoch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "summary.json")
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=2)
    h = summary["history"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(h["epoch"], h["train_loss"], label="train")
    ax_loss.plot(h["epoch"], h["test_loss"], label="held-out")
    ax_loss.set(xlabel="epoch", ylabel="softmax loss", title="loss")
    ax_acc.plot(h["epoch"], h["train_acc"], label="train")
    ax_acc.plot(h["epoch"], h["test_acc"], label="held-out")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.legend()
        ax.grid(alpha=0.3)
    cfg = summary["config"]
    fig.suptitle(f"{cfg['model']} on {cfg['data']} ({summary['device']})")
    fig.tight_layout()
    png_path = os.path.join(out_dir, "training.png")
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return json_path, png_path


def _start_data_parallel(cfg: Config) -> tuple[int, int]:
    """With ``--nproc N``: in the user's process, run this command on N ranks and exit with
    the job's status; inside a rank, join the process group and return (rank, world size)."""
    if cfg.nproc == 1:
        return 0, 1
    from needle.distributed.launch import relaunch

    relaunch(cfg.nproc)  # returns only inside a rank
    import needle.distributed as dist

    dist.init_process_group(timeout=300)
    if dist.get_world_size() != cfg.nproc:
        raise UsageError(f"--nproc {cfg.nproc} but the process group has "
                         f"{dist.get_world_size()} ranks")
    return dist.get_rank(), dist.get_world_size()


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        shard = _start_data_parallel(cfg)
        summary = train(cfg, shard=shard)
    except UsageError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - needle's own input errors: one line, no trace
        from needle._core.errors import NeedleError

        if not isinstance(exc, NeedleError):
            raise
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    if shard[0] != 0:
        return 0
    json_path, png_path = write_outputs(summary, cfg.out)
    print(f"held-out accuracy {summary['final_test_accuracy']:.4f} "
          f"({summary['test_examples']} examples), "
          f"{summary['examples_per_second']:,.0f} examples/second on {summary['device']}"
          + (f" x {shard[1]} ranks" if shard[1] > 1 else ""))
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
