"""One training step of a model, the memory ledger's estimate beside the allocator's measurement.

The table reconciles every category: a prediction made without the allocator (ledger bytes per
parameter, rounding from the shapes, what the ops declare they save, the optimizer's update
rule), the measured bytes, the gap split into named terms, and the row's tolerance
(needle/memory/reconcile.py).

Example:
    python apps/memory_report.py --model mlp_resnet --batch-size 128 --optimizer adam \\
        --device cpu_numpy --plot step.png

Models: ``mlp_resnet`` (the course's hw2 MLP-ResNet on MNIST-shaped input: 784 → hidden, blocks
of Linear/BatchNorm/ReLU/Dropout/Linear/BatchNorm with a residual, → 10 classes) and ``mlp``
(``--num-layers`` × Linear+ReLU of width ``--hidden-dim``). Inputs are random, seeded.

To measure your own script instead: ``python -m needle.memory report your_script.py``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import needle as ndl  # noqa: E402
from needle import nn, optim  # noqa: E402
from needle.memory.report import training_step_report  # noqa: E402

MODELS = ("mlp_resnet", "mlp")
OPTIMIZERS = ("adam", "sgd", "sgd_momentum")


def _mlp_resnet(dim, hidden, blocks, classes, device, drop_prob=0.1):
    def block():
        inner = nn.Sequential(
            nn.Linear(hidden, hidden // 2, device=device), nn.BatchNorm1d(hidden // 2,
                                                                          device=device),
            nn.ReLU(), nn.Dropout(drop_prob), nn.Linear(hidden // 2, hidden, device=device),
            nn.BatchNorm1d(hidden, device=device))
        return nn.Sequential(nn.Residual(inner), nn.ReLU())

    return nn.Sequential(nn.Linear(dim, hidden, device=device), nn.ReLU(),
                         *[block() for _ in range(blocks)],
                         nn.Linear(hidden, classes, device=device))


def _mlp(dim, hidden, layers, classes, device):
    mods, width = [], dim
    for _ in range(layers):
        mods += [nn.Linear(width, hidden, device=device), nn.ReLU()]
        width = hidden
    return nn.Sequential(*mods, nn.Linear(width, classes, device=device))


def build(args):
    """(model, loss, optimiser, x, y) for the parsed arguments."""
    device = ndl.backend_ndarray.device_by_name(args.device)
    np.random.seed(args.seed)
    if args.model == "mlp_resnet":
        model = _mlp_resnet(args.input_dim, args.hidden_dim, args.num_blocks, 10, device)
    else:
        model = _mlp(args.input_dim, args.hidden_dim, args.num_layers, 10, device)
    if args.optimizer == "adam":
        opt = optim.Adam(model.parameters(), lr=1e-3)
    else:
        momentum = 0.9 if args.optimizer == "sgd_momentum" else 0.0
        opt = optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    x = ndl.Tensor(np.random.rand(args.batch_size, args.input_dim), device=device,
                   requires_grad=False)
    y = ndl.Tensor(np.random.randint(0, 10, args.batch_size), device=device,
                   requires_grad=False)
    return model, nn.SoftmaxLoss(), opt, x, y


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python apps/memory_report.py",
        description="one training step: the memory estimate beside the measured peaks")
    parser.add_argument("--model", choices=MODELS, default="mlp_resnet")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    parser.add_argument("--device", default="cpu_numpy")
    parser.add_argument("--plot", default=None, help="write the timeline PNG here")
    parser.add_argument("--input-dim", type=int, default=784)
    parser.add_argument("--hidden-dim", type=int, default=100)
    parser.add_argument("--num-blocks", type=int, default=3, help="mlp_resnet blocks")
    parser.add_argument("--num-layers", type=int, default=4, help="mlp hidden layers")
    parser.add_argument("--margin", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        model, loss_fn, opt, x, y = build(args)
        report = training_step_report(model, loss_fn, opt, x, y, optimizer_name=args.optimizer,
                                      device=x.device, margin=args.margin, plot=args.plot)
    except ndl.NeedleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = report.ledger.num_params
    print(f"needle memory report: {args.model}, {n:,} parameters, batch {args.batch_size}, "
          f"{args.optimizer}, device {x.device}, loss {report.loss:.4f}")
    print(f"activations kept by the graph at the end of forward: {report.saved_bytes:,} B")
    print()
    print(report.ledger)
    print()
    print("reconciliation: each row an independent prediction beside the measurement")
    print(report.reconciliation)
    events = report.timeline
    print(f"\ntimeline: {len(events)} events, {sum(e.new_segment for e in events)} new "
          f"segments, measured peak {report.stats['peak_bytes']:,} B")
    if args.plot:
        print(f"timeline plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
