"""One training step of a model, predicted before it runs beside the allocator's measurement.

The table reconciles every category: a prediction made without the allocator (ledger bytes per
parameter, rounding from the shapes, the optimizer's update rule, and a shape-only trace of the
step for the activations, the kernels' scratch and every buffer's lifetime,
needle/memory/shape_trace.py), the measured bytes, the gap, and the row's tolerance, which
comes from allocator rounding alone (needle/memory/reconcile.py). The exit code is 1 when a
row is out of its tolerance; a row that cannot be predicted says why.

Example:
    python apps/memory_report.py --model mlp_resnet --batch-size 128 --optimizer adam \\
        --device cpu_numpy --plot step.png

Models: ``mlp_resnet`` (the course's hw2 MLP-ResNet on MNIST-shaped input: 784 → hidden, blocks
of Linear/BatchNorm/ReLU/Dropout/Linear/BatchNorm with a residual, → 10 classes), ``mlp``
(``--num-layers`` × Linear+ReLU of width ``--hidden-dim``) and ``linear`` (one bias-free
``Linear(--input-dim, --hidden-dim)``). Inputs are random, seeded.

Model state per rank (weights, gradients, master weights, optimizer moments) under data
parallelism, ZeRO, mixed precision and gradient accumulation, predicted beside measured::

    python apps/memory_report.py --model linear --input-dim 1000 --hidden-dim 1000 \\
        --strategy zero --zero-stage 2 --nproc 4 --precision fp16-mixed --device cpu

(1,000,000 parameters: 5,500,000 bytes per rank.) ``--strategy ddp|zero`` start ``--nproc``
ranks through needle's launcher; ``--strategy single`` with ``--precision``/``--accumulate``
reports one process. The same command runs under the memory profiler of your own scripts,
``python -m needle.memory report apps/memory_report.py --strategy zero ...``.

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

try:  # the repository's one MLP-ResNet builder, beside this file
    from mlp_resnet import MLPResNet
except ImportError:
    from apps.mlp_resnet import MLPResNet

MODELS = ("mlp_resnet", "mlp", "linear")
STRATEGIES = ("single", "ddp", "zero")
OPTIMIZERS = ("adam", "sgd", "sgd_momentum")


def _mlp_resnet(dim, hidden, blocks, classes, device, drop_prob=0.1):
    return MLPResNet(dim, hidden, num_blocks=blocks, num_classes=classes, drop_prob=drop_prob,
                     device=device)


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
    elif args.model == "linear":
        model = nn.Sequential(nn.Linear(args.input_dim, args.hidden_dim, bias=False,
                                        device=device))
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
    state = parser.add_argument_group("model state per rank (data parallel, ZeRO, mixed "
                                      "precision, accumulation)")
    state.add_argument("--strategy", choices=STRATEGIES, default=None,
                       help="report the model state per rank for this strategy")
    state.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=2)
    state.add_argument("--nproc", type=int, default=1, help="ranks (ddp, zero)")
    state.add_argument("--precision", choices=("fp32", "fp16-mixed"), default="fp32")
    state.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    state.add_argument("--steps", type=int, default=1, help="training steps before measuring")
    args = parser.parse_args(argv)
    if args.strategy is None and (args.precision != "fp32" or args.accumulate > 1
                                  or args.nproc > 1):
        args.strategy = "single" if args.nproc == 1 else "ddp"
    if args.strategy == "single" and args.nproc != 1:
        parser.error(f"--strategy single runs one process, got --nproc {args.nproc}")
    if args.accumulate < 1 or args.steps < 1 or args.nproc < 1:
        parser.error("--accumulate, --steps and --nproc must be positive")
    return args


def state_report(args) -> int:
    """The model-state table per rank (rank 0 prints it)."""
    if str(Path(__file__).resolve().parent) not in sys.path:  # run by path (runpy, launcher)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    import memory_state

    if args.strategy in ("ddp", "zero"):
        import needle.distributed as dist
        from needle.distributed.launch import relaunch

        relaunch(args.nproc)  # returns only inside a rank
        dist.init_process_group(timeout=300)
    device = ndl.backend_ndarray.device_by_name(args.device)
    row = memory_state.rank_row(args, build, device)
    rows = memory_state.gather_rows(row)
    if row["rank"] == 0:
        what = (f"zero stage {args.zero_stage}" if args.strategy == "zero" else args.strategy)
        print(f"needle memory report: {args.model}, {row['parameters']:,} parameters, {what} "
              f"on {len(rows)} rank(s), {args.precision}, {args.optimizer}, batch "
              f"{args.batch_size} in {args.accumulate} micro-batch(es), after {args.steps} "
              f"step(s), device {device}")
        print("model state right after the step: predicted = needle.memory.estimate, "
              "measured = bytes held per category (needle.memory), allocated = 512-byte "
              "blocks")
        print(memory_state.table(rows))
    mismatch = any(r["measured"] != r["predicted"] for r in rows)
    return 1 if mismatch else 0


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.strategy is not None:
        try:
            return state_report(args)
        except ndl.NeedleError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        model, loss_fn, opt, x, y = build(args)
        report = training_step_report(model, loss_fn, opt, x, y, optimizer_name=args.optimizer,
                                      device=x.device, margin=args.margin, plot=args.plot,
                                      build=lambda: build(args))
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
    print(report.prediction)
    print()
    print("reconciliation: each row an independent prediction beside the measurement")
    print(report.reconciliation)
    for row in report.reconciliation.rows:
        if not row.checked:
            print(f"not predicted: {row.name}: {row.gap_terms[0][0]}")
    events = report.timeline
    print(f"\ntimeline: {len(events)} events, {sum(e.new_segment for e in events)} new "
          f"segments, measured peak {report.stats['peak_bytes']:,} B")
    if args.plot:
        print(f"timeline plot written to {args.plot}")
    return 0 if report.reconciliation.ok else 1


if __name__ == "__main__":
    sys.exit(main())
