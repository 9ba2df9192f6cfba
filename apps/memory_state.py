"""Model state per rank under data parallelism, ZeRO, mixed precision and accumulation:
the ledger's prediction beside the allocator's measurement, term by term.

Used by ``apps/memory_report.py --strategy single|ddp|zero`` (see its docstring). Each rank
builds the model, runs ``--steps`` training steps the way ``apps/train.py`` does (autocast and
a GradScaler with ``--precision fp16-mixed``, ``--accumulate`` micro-batches weighted
``n_i / n``), then reads ``needle.memory`` right after the last step; rank 0 prints every
rank's row.
"""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np

CATEGORIES = ("weight", "gradient", "master", "optimizer")
TERMS = {"weight": "working weights", "gradient": "gradients", "master": "master weights",
         "optimizer": "optimizer moments"}


def _wrap(args, model, make_optimizer):
    """(forward, optimizer, no_sync, stage) for the strategy."""
    import needle.distributed as dist

    if args.strategy == "zero":
        zero = dist.ZeroDataParallel(model, optimizer=make_optimizer, stage=args.zero_stage)
        return zero, zero.optimizer, zero.no_sync, args.zero_stage, zero
    optimizer = make_optimizer(model.parameters())
    if args.strategy == "ddp":
        ddp = dist.DistributedDataParallel(model)
        return ddp, ddp.wrap_optimizer(optimizer), ddp.no_sync, 0, ddp
    return model, optimizer, None, 0, None


def _steps(args, forward, optimizer, no_sync, scaler, x, y, wrapper, device) -> None:
    """``args.steps`` steps on host arrays ``x``, ``y`` (this rank's share)."""
    import needle as ndl
    from needle import amp, memory, nn

    loss_fn = nn.SoftmaxLoss()
    n = len(y)
    cuts = [n * i // args.accumulate for i in range(args.accumulate + 1)]
    for _ in range(args.steps):
        optimizer.reset_grad()
        if wrapper is not None:
            wrapper.set_num_examples(n)
        for i, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
            last = i == args.accumulate - 1
            with nullcontext() if last or no_sync is None else no_sync():
                xs = ndl.Tensor(x[lo:hi], device=device, requires_grad=False)
                ys = ndl.Tensor(y[lo:hi], device=device, requires_grad=False)
                with amp.autocast(enabled=args.precision == "fp16-mixed"):
                    loss = loss_fn(forward(xs), ys)
                scaler.scale(loss * ((hi - lo) / n)).backward()
        sync = getattr(wrapper, "finish_gradient_sync", None)
        if sync is not None:
            sync()
        if args.strategy == "ddp":  # DDP installs its averaged gradients outside backward
            for p in forward.module.parameters():
                memory.attribute(p.grad, "gradient")
        scaler.step(optimizer)
        scaler.update()


def rank_row(args, build, device) -> dict:
    """This rank's measured and predicted model-state bytes after ``args.steps`` steps."""
    from needle import amp, memory, optim
    from needle.distributed.zero import accounting

    memory.stats(device)  # categories tracked from the first buffer on
    model, _, _, x, y = build(args)
    if args.precision == "fp16-mixed":
        amp.cast_parameters(model)

    def make_optimizer(params):
        if args.optimizer == "adam":
            return optim.Adam(params, lr=1e-3)
        return optim.SGD(params, lr=0.01, momentum=0.9 if args.optimizer == "sgd_momentum"
                         else 0.0)

    forward, optimizer, no_sync, stage, wrapper = _wrap(args, model, make_optimizer)
    scaler = amp.GradScaler(enabled=args.precision == "fp16-mixed")
    rank, world = _rank_world()
    x, y = x.numpy(), y.numpy()
    lo, hi = len(y) * rank // world, len(y) * (rank + 1) // world
    _steps(args, forward, optimizer, no_sync, scaler, x[lo:hi], y[lo:hi], wrapper, device)
    inner = getattr(optimizer, "optimizer", optimizer)
    got = accounting.measured(device)
    want = accounting.predicted(model, inner, stage, world, rank)
    ledger = memory.estimate(model=model, precision=accounting.precision_of(
        model.parameters()), optimizer=accounting.optimizer_kind(inner), zero_stage=stage,
        dp=world, rank=rank if world > 1 else None, margin=0)
    return {"rank": rank, "measured": got["requested"], "allocated": got["allocated"],
            "predicted": want, "formulas": {c: ledger.row(TERMS[c]).formula
                                            for c in CATEGORIES},
            "parameters": ledger.num_params}


def _rank_world() -> tuple[int, int]:
    import needle.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_rows(row: dict) -> list[dict]:
    """Every rank's row on every rank (collective when distributed)."""
    rank, world = _rank_world()
    if world == 1:
        return [row]
    import needle.distributed as dist

    mine = np.array([row[k][c] for k in ("measured", "allocated", "predicted")
                     for c in CATEGORIES], dtype=np.int64)
    every = [np.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    rows = []
    for r, values in enumerate(every):
        v = values.reshape(3, len(CATEGORIES))
        rows.append({"rank": r, **{k: {c: int(v[i][j]) for j, c in enumerate(CATEGORIES)}
                                   for i, k in enumerate(("measured", "allocated",
                                                          "predicted"))},
                     "formulas": row["formulas"] if r == rank else None})
    return rows


def table(rows: list[dict]) -> str:
    """The side-by-side table: per rank and category, predicted, measured, allocated."""
    head = (f"{'rank':>4}  {'category':<10}{'predicted':>14}{'measured':>14}{'allocated':>14}"
            f"{'rounding':>11}  ledger term")
    lines = [head]
    for row in rows:
        for c in CATEGORIES:
            p, m, a = row["predicted"][c], row["measured"][c], row["allocated"][c]
            formula = row["formulas"][c] if row.get("formulas") else ""
            mark = "" if p == m else "  <- differs"
            lines.append(f"{row['rank']:>4}  {c:<10}{p:>14,}{m:>14,}{a:>14,}{a - m:>11,}  "
                         f"{formula}{mark}")
        lines.append(f"{row['rank']:>4}  {'total':<10}{sum(row['predicted'].values()):>14,}"
                     f"{sum(row['measured'].values()):>14,}"
                     f"{sum(row['allocated'].values()):>14,}")
    return "\n".join(lines)
