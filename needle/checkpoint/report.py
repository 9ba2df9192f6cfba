"""What a checkpoint policy changes, measured: ``checkpoint_report`` and its command line.

For a chain of layers, an input and one or more policies (``None``/``"plain"``: no
checkpointing; an int K: ``checkpoint_sequential`` with K equal segments; a
:class:`~needle.checkpoint.CheckpointPlan`), each policy runs one forward + backward (the
output's gradient is ones) under :func:`needle.memory.profile` and gives one row:

* ``saved``, ``saved_bytes``: activation buffers alive between forward and backward (after
  autograd's last release pass, where backward starts), and their bytes;
* ``bytes_saved``: how many fewer bytes than the plain graph keeps;
* ``recomputed``, ``recomputed_bytes``: activation buffers allocated again during backward (the
  recomputation of checkpointed segments);
* ``extra_flops``: forward FLOPs run again during backward (multiply-adds count 2: a matmul
  ``2·m·k·n``, a linear layer that plus 1 per output element for its bias; elementwise ops 1
  per output element; reductions 1 per input element; views, reshapes and broadcasts 0);
* ``draws_replayed``: random draws made again while recomputing (dropout masks: the same
  numbers, see docs/checkpointing.md);
* ``predicted_peak``, ``measured_peak``: the activation peak the cost model predicts from the
  layers' measured costs (:func:`~needle.checkpoint.measure_layer_costs`) and the one the
  allocator measured. They agree exactly: both are in allocator blocks, so the only rounding
  (to 512 B) is inside the measured costs already.

``python -m needle.memory checkpoint-report`` runs it on a chain of Linear + ReLU (+ Dropout)
layers: ``--layers --width --batch --dropout --device --segments K [K ...] --budget B [B ...]
--json PATH``.

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle import nn
    >>> d = ndl.cpu_numpy(); np.random.seed(0)
    >>> layers = [nn.Sequential(nn.Linear(64, 64, device=d), nn.ReLU()) for _ in range(4)]
    >>> x = ndl.Tensor(np.ones((32, 64)), device=d, requires_grad=False)
    >>> rows = checkpoint_report(layers, x, [None, 2]).rows
    >>> rows[1].recomputed > 0, rows[1].predicted_peak == rows[1].measured_peak
    (True, True)
"""
from __future__ import annotations

import gc
import json
import math
from dataclasses import asdict, dataclass

import numpy as np

from .. import memory
from .. import random as ndl_random
from .._core.errors import MemoryArgumentError
from ..autograd import Tensor
from ..autograd.release import sweep
from ..memory.observers import Observer, add_observer
from .costs import measure_layer_costs
from .plan import CheckpointPlan, equal_segments, predict_peak
from .region import is_recomputing
from .sequential import _module_list, checkpoint_sequential

__all__ = ["checkpoint_report", "CheckpointReport", "PolicyRow", "op_flops"]

_FREE = {"Reshape", "BroadcastTo", "Transpose", "MakeTensorTuple", "TupleGetItem", "Stack",
         "Split", "GetItem"}
_REDUCE = {"Summation", "LogSumExp", "Max", "Mean"}


def op_flops(name: str, input_shapes: list, output_shape) -> int:
    """FLOPs of one forward op by the module docstring's rule."""
    if name in _FREE or name.startswith("_Region"):
        return 0
    if name in ("MatMul", "FusedLinear") and len(input_shapes) >= 2:
        a, b = input_shapes[:2]
        batch = math.prod(output_shape[:-2]) if len(output_shape) > 2 else 1
        bias = math.prod(output_shape) if len(input_shapes) == 3 else 0  # linear's bias add
        return 2 * batch * a[-2] * a[-1] * b[-1] + bias
    if name in _REDUCE and input_shapes:
        return math.prod(input_shapes[0])
    return math.prod(output_shape) if output_shape is not None else 0


@dataclass
class PolicyRow:
    """One policy, measured (see the module docstring for each field)."""

    policy: str
    segments: list
    checkpointed: list
    saved: int
    saved_bytes: int
    bytes_saved: int
    recomputed: int
    recomputed_bytes: int
    extra_flops: int
    draws_replayed: int
    predicted_peak: int
    measured_peak: int


@dataclass
class CheckpointReport:
    rows: list
    layers: int
    device: str

    def __str__(self) -> str:
        head = (f"{'policy':<16}{'saved':>7}{'saved MiB':>11}{'-MiB':>9}{'recomp.':>9}"
                f"{'extra GFLOP':>13}{'draws':>7}{'pred. MiB':>11}{'meas. MiB':>11}")
        mib = 2 ** 20
        body = [f"{r.policy:<16}{r.saved:>7}{r.saved_bytes / mib:>11.3f}"
                f"{r.bytes_saved / mib:>9.3f}{r.recomputed:>9}{r.extra_flops / 1e9:>13.4f}"
                f"{r.draws_replayed:>7}{r.predicted_peak / mib:>11.3f}"
                f"{r.measured_peak / mib:>11.3f}" for r in self.rows]
        return "\n".join([f"checkpoint policies: {self.layers} layers on {self.device}", head,
                          *body])

    def to_json(self) -> dict:
        return {"layers": self.layers, "device": self.device,
                "rows": [asdict(r) for r in self.rows]}


class _Recompute(Observer):
    """Counts forward FLOPs and the ops run while a checkpoint region recomputes."""

    def __init__(self):
        self.flops = 0

    def op_begin(self, op, inputs):
        if not is_recomputing():
            return None
        return type(op).__name__, [tuple(x.shape) for x in inputs]

    def op_end(self, token, node) -> None:
        if token is not None and node is not None and not node._is_tuple:
            self.flops += op_flops(token[0], token[1], tuple(node.shape))


def _policy(policy, n: int):
    if policy is None or policy == "plain":
        return "plain", ((0, n),), (False,)
    if isinstance(policy, CheckpointPlan):
        return (f"plan {sum(policy.checkpointed)}/{len(policy.segments)} ckpt",
                policy.segments, policy.checkpointed)
    if isinstance(policy, int) and not isinstance(policy, bool):
        return f"{policy} segments", equal_segments(n, policy), (True,) * policy
    raise MemoryArgumentError(
        f"checkpoint_report: bad policy, expected None, 'plain', an int or a CheckpointPlan, "
        f"got {policy!r}")


def _run(layers, x, segments, flags):
    plan = CheckpointPlan("given", tuple(segments), tuple(flags), 0, 0, 0)
    with memory.category("other"):
        seed = Tensor(np.ones(x.shape, "float32"), device=x.device, requires_grad=False)
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    gc.collect()
    counter = _Recompute()
    draws = [0]

    def on_draw(kind, device, value):
        if is_recomputing():
            draws[0] += 1

    with memory.profile(x.device) as prof:
        y = checkpoint_sequential(layers, plan, x)
        sweep(final=True)
        prof._sync()
        mark = len(prof.records)
        watching, hearing = add_observer(counter), ndl_random.add_draw_observer(on_draw)
        try:
            y.backward(seed)
        finally:
            watching.remove()
            hearing.remove()
        del y
    return prof, mark, counter.flops, draws[0]


def _row(name, segments, flags, prof, mark, flops, draws, device, predicted) -> dict:
    recs = [r for r in prof.records if r.device == device]
    live: dict = {}
    for r in recs[:mark]:
        if r.kind == "alloc":
            live[r.block] = r
        elif r.kind == "free":
            live.pop(r.block, None)
    acts = [r for r in live.values() if r.category == "activation"]
    again = [r for r in recs[mark:] if r.kind == "alloc" and r.category == "activation"]
    report = prof.report()["devices"][device]
    start = prof.start_stats[device]["by_category"]["activation"]["current"]
    return dict(policy=name, segments=[list(s) for s in segments], checkpointed=list(flags),
                saved=len(acts), saved_bytes=sum(r.nbytes for r in acts), bytes_saved=0,
                recomputed=len(again), recomputed_bytes=sum(r.nbytes for r in again),
                extra_flops=flops, draws_replayed=draws, predicted_peak=predicted,
                measured_peak=report["by_category"]["activation"]["peak"] - start)


def checkpoint_report(layers, x, policies=(None,)) -> CheckpointReport:
    """Measure each policy on ``layers`` and ``x`` (module docstring); the plain graph is
    always measured first, as the reference of ``bytes_saved``.

    Raises:
        MemoryArgumentError: a policy of an unknown kind.
    """
    layers = _module_list(layers)
    costs = measure_layer_costs(layers, x)
    wanted = [None] + [p for p in policies if p is not None and p != "plain"]
    rows = []
    for policy in wanted:
        name, segments, flags = _policy(policy, len(layers))
        predicted = predict_peak(costs, segments, flags)
        prof, mark, flops, draws = _run(layers, x, segments, flags)
        rows.append(PolicyRow(**_row(name, segments, flags, prof, mark, flops, draws,
                                     x.device.name, predicted)))
    for row in rows:
        row.bytes_saved = rows[0].saved_bytes - row.saved_bytes
    return CheckpointReport(rows, len(layers), x.device.name)


# ---- python -m needle.memory checkpoint-report ------------------------------------------------
def _arguments(parser) -> None:
    parser.add_argument("--layers", type=int, default=16, help="Linear+ReLU layers (%(default)s)")
    parser.add_argument("--width", type=int, default=512, help="%(default)s")
    parser.add_argument("--batch", type=int, default=64, help="%(default)s")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="a Dropout after each ReLU with this p (%(default)s: none)")
    parser.add_argument("--device", default="cpu_numpy", help="%(default)s")
    parser.add_argument("--segments", type=int, nargs="*", default=[2, 4],
                        help="checkpoint_sequential segment counts (%(default)s)")
    parser.add_argument("--budget", type=float, nargs="*", default=[],
                        help="plan_checkpoints budgets, in MiB of activation memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the table here")


def _command(args) -> int:
    from .. import nn
    from ..backend_ndarray import device_by_name
    from .plan import plan_checkpoints

    device = device_by_name(args.device)
    np.random.seed(args.seed)
    layers = []
    for _ in range(args.layers):
        mods = [nn.Linear(args.width, args.width, device=device), nn.ReLU()]
        if args.dropout:
            mods.append(nn.Dropout(args.dropout))
        layers.append(nn.Sequential(*mods))
    x = Tensor(np.random.randn(args.batch, args.width).astype("float32"), device=device,
               requires_grad=False)
    policies: list = list(args.segments)
    if args.budget:
        costs = measure_layer_costs(layers, x)
        policies += [plan_checkpoints(costs, memory_budget=int(b * 2**20)) for b in args.budget]
    report = checkpoint_report(layers, x, policies)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0


def _register() -> None:
    from ..memory.cli import register_command

    register_command("checkpoint-report", "measure checkpoint policies on a Linear+ReLU chain: "
                     "saved vs recomputed tensors, FLOPs, draws, predicted vs measured peak",
                     _arguments, _command)


_register()
