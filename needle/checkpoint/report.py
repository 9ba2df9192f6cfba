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
* ``extra_flops`` (R): forward FLOPs run again during backward; ``forward_flops`` (F) and
  ``backward_flops`` (B): those of the step's own forward and backward (the same in every
  row: a checkpointed backward differentiates the same nodes). Counting, per op:
  forward, a matmul ``2·m·k·n`` (a linear layer that plus 1 per output element for its
  bias), elementwise ops 1 per output element, reductions 1 per input element, views,
  reshapes and broadcasts 0; backward, per node and per input that needs a gradient, a
  matmul's ``2·m·k·n`` for each of its two operands, a bias's sum 1 per output element, a
  broadcast's sum 1 per output element, a sum's broadcast 0, other reductions 1 per input
  element, every other op 1 per output element (sums of the partial gradients of a tensor
  with several consumers are not counted);
* ``overhead`` = R/(F+B): the extra arithmetic relative to the ordinary step, and
  ``recompute_share`` = R/(F+B+R): the part of the checkpointed step spent recomputing;
  ``measured_overhead``: the same ratio from wall time, the recomputation (timed inside
  each region) over the plain row's forward + backward (best of ``repeats`` unprofiled runs
  each; ``forward_s``, ``backward_s`` (recomputation included), ``recompute_s``);
* ``draws_replayed``: random draws made again while recomputing (dropout masks: the same
  numbers, see docs/checkpointing.md);
* ``predicted_peak``, ``measured_peak``: the activation peak the cost model predicts from the
  layers' measured costs (:func:`~needle.checkpoint.measure_layer_costs`) and the one the
  allocator measured. They agree exactly: both are in allocator blocks, so the only rounding
  (to 512 B) is inside the measured costs already.

Policies by name: ``"every-layer"`` (one region per layer), ``"sqrt"`` (round(√N) equal
segments, all recomputed), ``"sqrt-last-stored"`` (the same segments, the last one run
without a region, as PyTorch's ``checkpoint_sequential`` does: backward starts there).

``python -m needle.memory checkpoint-report`` runs it on a chain of Linear + ReLU (+ Dropout)
layers: ``--layers --width --batch --dropout --device --segments K [K ...] --budget B [B ...]
--repeats --json PATH``; ``--course`` runs the lecture's uniform chain instead: ``--layers``
bias-free Linear layers whose input needs a gradient, so each layer's backward is exactly two
of its forward matmuls (B = 2F), under plain, every-layer, sqrt and sqrt-last-stored.

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
import time
from dataclasses import asdict, dataclass
from fractions import Fraction

import numpy as np

from .. import memory
from .. import random as ndl_random
from .._core.errors import MemoryArgumentError
from ..autograd import Tensor
from ..autograd.release import sweep
from ..memory.observers import Observer, add_observer
from .costs import measure_layer_costs
from .plan import CheckpointPlan, equal_segments, predict_peak
from .region import is_recomputing, recompute_seconds
from .sequential import _module_list, checkpoint_sequential

__all__ = ["checkpoint_report", "CheckpointReport", "PolicyRow", "op_flops", "grad_flops",
           "POLICY_NAMES"]

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


def grad_flops(name: str, input_shapes: list, needs: list, output_shape) -> int:
    """FLOPs of one node's backward by the module docstring's rule (``needs[i]``: whether
    input ``i`` needs a gradient)."""
    out = math.prod(output_shape) if output_shape is not None else 0
    if name.startswith("_Region") or (name in _FREE and name != "BroadcastTo"):
        return 0  # a region's work is its recomputation (R) and the nodes it backpropagates
    if name in ("MatMul", "FusedLinear") and len(input_shapes) >= 2:
        matmul = op_flops("MatMul", input_shapes[:2], output_shape)
        return matmul * sum(needs[:2]) + (out if len(needs) == 3 and needs[2] else 0)
    if name == "Summation":
        return 0
    if name in _REDUCE and input_shapes:
        return math.prod(input_shapes[0]) * any(needs)
    return out * sum(needs)


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
    forward_flops: int = 0
    backward_flops: int = 0
    overhead: float = 0.0
    recompute_share: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    measured_overhead: float = 0.0


@dataclass
class CheckpointReport:
    rows: list
    layers: int
    device: str

    def __str__(self) -> str:
        head = (f"{'policy':<30}{'saved':>7}{'saved MiB':>11}{'-MiB':>9}{'recomp.':>9}"
                f"{'extra GFLOP':>13}{'draws':>7}{'pred. MiB':>11}{'meas. MiB':>11}")
        mib = 2 ** 20
        body = [f"{r.policy:<30}{r.saved:>7}{r.saved_bytes / mib:>11.3f}"
                f"{r.bytes_saved / mib:>9.3f}{r.recomputed:>9}{r.extra_flops / 1e9:>13.4f}"
                f"{r.draws_replayed:>7}{r.predicted_peak / mib:>11.3f}"
                f"{r.measured_peak / mib:>11.3f}" for r in self.rows]
        cost = (f"{'policy':<30}{'F GFLOP':>10}{'B GFLOP':>10}{'R GFLOP':>10}{'R/(F+B)':>15}"
                f"{'R/(F+B+R)':>15}{'measured R/(F+B)':>18}")
        lines = [f"{r.policy:<30}{r.forward_flops / 1e9:>10.4f}{r.backward_flops / 1e9:>10.4f}"
                 f"{r.extra_flops / 1e9:>10.4f}"
                 f"{_ratio(r.extra_flops, r.forward_flops + r.backward_flops):>15}"
                 f"{_ratio(r.extra_flops, r.forward_flops + r.backward_flops + r.extra_flops):>15}"
                 f"{r.measured_overhead:>18.3f}" for r in self.rows]
        return "\n".join([f"checkpoint policies: {self.layers} layers on {self.device}", head,
                          *body, "recompute overhead (FLOPs counted from the graph's ops; "
                          "measured: recompute time / plain forward+backward time)", cost,
                          *lines])

    def to_json(self) -> dict:
        return {"layers": self.layers, "device": self.device,
                "rows": [asdict(r) for r in self.rows]}


def _ratio(num: int, den: int) -> str:
    """``num/den`` as a decimal, with the exact fraction when it is a small one."""
    if not den:
        return "-"
    exact = Fraction(num, den)
    return f"{float(exact):.4f}" + (f" ={exact}" if 1 < exact.denominator <= 64 else "")


class _Counter(Observer):
    """FLOPs of one step: ``forward`` (ops of the first forward), ``flops`` (forward ops run
    again while a region recomputes) and ``backward`` (nodes differentiated)."""

    def __init__(self):
        self.flops = self.forward = self.backward = 0
        self.phase = "forward"

    def op_begin(self, op, inputs):
        if not is_recomputing() and self.phase != "forward":
            return None
        return type(op).__name__, [tuple(x.shape) for x in inputs]

    def op_end(self, token, node) -> None:
        if token is not None and node is not None and not node._is_tuple:
            flops = op_flops(token[0], token[1], tuple(node.shape))
            if is_recomputing():
                self.flops += flops
            else:
                self.forward += flops

    def node_begin(self, node):
        if not node._is_tuple and not is_recomputing():
            self.backward += grad_flops(type(node.op).__name__,
                                        [tuple(x.shape) for x in node.inputs],
                                        [x.requires_grad for x in node.inputs],
                                        tuple(node.shape))
        return None


POLICY_NAMES = ("plain", "every-layer", "sqrt", "sqrt-last-stored")


def _policy(policy, n: int):
    if policy is None or policy == "plain":
        return "plain", ((0, n),), (False,)
    if isinstance(policy, CheckpointPlan):
        return (f"plan {sum(policy.checkpointed)}/{len(policy.segments)} ckpt",
                policy.segments, policy.checkpointed)
    if isinstance(policy, int) and not isinstance(policy, bool):
        return f"{policy} segments", equal_segments(n, policy), (True,) * policy
    if policy == "every-layer":
        return "every layer", equal_segments(n, n), (True,) * n
    if policy in ("sqrt", "sqrt-last-stored"):
        k = max(1, min(n, round(math.sqrt(n))))
        last = policy == "sqrt"
        return (f"sqrt: {k} segments" + ("" if last else ", last stored"),
                equal_segments(n, k), (True,) * (k - 1) + (last,))
    raise MemoryArgumentError(
        f"checkpoint_report: bad policy, expected None, an int, a CheckpointPlan or one of "
        f"{POLICY_NAMES}, got {policy!r}")


def _fresh(layers, x) -> Tensor:
    """Gradients cleared (parameters and the input); the output's gradient (ones)."""
    with memory.category("other"):
        seed = Tensor(np.ones(x.shape, "float32"), device=x.device, requires_grad=False)
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    x.grad = None
    gc.collect()
    return seed


def _run(layers, x, segments, flags):
    plan = CheckpointPlan("given", tuple(segments), tuple(flags), 0, 0, 0)
    seed = _fresh(layers, x)
    counter = _Counter()
    draws = [0]

    def on_draw(kind, device, value):
        if is_recomputing():
            draws[0] += 1

    with memory.profile(x.device) as prof:
        watching = add_observer(counter)
        try:
            y = checkpoint_sequential(layers, plan, x)
            counter.phase = "backward"
            sweep(final=True)
            prof._sync()
            mark = len(prof.records)
            hearing = ndl_random.add_draw_observer(on_draw)
            try:
                y.backward(seed)
            finally:
                hearing.remove()
        finally:
            watching.remove()
        del y
    return prof, mark, counter, draws[0]


def _timed(layers, x, segments, flags, repeats: int) -> tuple:
    """Best (forward, backward, recompute) seconds of ``repeats`` unprofiled runs."""
    plan = CheckpointPlan("given", tuple(segments), tuple(flags), 0, 0, 0)
    best = [math.inf] * 3
    for _ in range(repeats):
        seed = _fresh(layers, x)
        t0, r0 = time.perf_counter(), recompute_seconds()
        y = checkpoint_sequential(layers, plan, x)
        t1 = time.perf_counter()
        y.backward(seed)
        t2 = time.perf_counter()
        del y
        for i, v in enumerate((t1 - t0, t2 - t1, recompute_seconds() - r0)):
            best[i] = min(best[i], v)
    return tuple(best)


def _row(name, segments, flags, prof, mark, counter, draws, device, predicted) -> dict:
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
                extra_flops=counter.flops, draws_replayed=draws, predicted_peak=predicted,
                measured_peak=report["by_category"]["activation"]["peak"] - start,
                forward_flops=counter.forward, backward_flops=counter.backward)


def checkpoint_report(layers, x, policies=(None,), repeats: int = 3) -> CheckpointReport:
    """Measure each policy on ``layers`` and ``x`` (module docstring); the plain graph is
    always measured first, as the reference of ``bytes_saved`` and of the measured overhead;
    ``repeats`` timed runs per policy (0: no timing).

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
        prof, mark, counter, draws = _run(layers, x, segments, flags)
        row = PolicyRow(**_row(name, segments, flags, prof, mark, counter, draws,
                               x.device.name, predicted))
        f, b, r = row.forward_flops, row.backward_flops, row.extra_flops
        row.overhead = r / (f + b) if f + b else 0.0
        row.recompute_share = r / (f + b + r) if f + b + r else 0.0
        if repeats:
            row.forward_s, row.backward_s, row.recompute_s = _timed(layers, x, segments,
                                                                    flags, repeats)
        rows.append(row)
    for row in rows:
        row.bytes_saved = rows[0].saved_bytes - row.saved_bytes
        ordinary = rows[0].forward_s + rows[0].backward_s
        row.measured_overhead = row.recompute_s / ordinary if ordinary else 0.0
    return CheckpointReport(rows, len(layers), x.device.name)


# ---- python -m needle.memory checkpoint-report ------------------------------------------------
def _arguments(parser) -> None:
    parser.add_argument("--layers", type=int, default=16, help="Linear+ReLU layers (%(default)s)")
    parser.add_argument("--width", type=int, default=512, help="%(default)s")
    parser.add_argument("--batch", type=int, default=64, help="%(default)s")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="a Dropout after each ReLU with this p (%(default)s: none)")
    parser.add_argument("--device", default="cpu_numpy", help="%(default)s")
    parser.add_argument("--segments", type=int, nargs="*", default=None,
                        help="checkpoint_sequential segment counts (default 2 4; none with "
                             "--course)")
    parser.add_argument("--policies", nargs="*", default=[], choices=POLICY_NAMES[1:],
                        help="named policies (module docstring)")
    parser.add_argument("--course", action="store_true",
                        help="the lecture's uniform chain: bias-free Linear layers, B = 2F, "
                             "under every-layer, sqrt and sqrt-last-stored")
    parser.add_argument("--budget", type=float, nargs="*", default=[],
                        help="plan_checkpoints budgets, in MiB of activation memory")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per policy for the measured overhead (%(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the table here")


def _chain(args, device) -> list:
    from .. import nn

    if args.course:  # each layer one matmul: its backward is exactly two more (dX, dW)
        return [nn.Linear(args.width, args.width, bias=False, device=device)
                for _ in range(args.layers)]
    layers = []
    for _ in range(args.layers):
        mods = [nn.Linear(args.width, args.width, device=device), nn.ReLU()]
        if args.dropout:
            mods.append(nn.Dropout(args.dropout))
        layers.append(nn.Sequential(*mods))
    return layers


def _command(args) -> int:
    from ..backend_ndarray import device_by_name
    from .plan import plan_checkpoints

    device = device_by_name(args.device)
    np.random.seed(args.seed)
    layers = _chain(args, device)
    # the course's chain is a piece of a network: its input needs a gradient too
    x = Tensor(np.random.randn(args.batch, args.width).astype("float32"), device=device,
               requires_grad=args.course)
    segments = args.segments if args.segments is not None else ([] if args.course else [2, 4])
    named = list(args.policies) or (list(POLICY_NAMES[1:]) if args.course else [])
    policies: list = named + list(segments)
    if args.budget:
        costs = measure_layer_costs(layers, x)
        policies += [plan_checkpoints(costs, memory_budget=int(b * 2**20)) for b in args.budget]
    report = checkpoint_report(layers, x, policies, repeats=args.repeats)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0


def _register() -> None:
    from ..memory.cli import register_command

    register_command("checkpoint-report", "measure checkpoint policies on a Linear+ReLU chain: "
                     "saved vs recomputed tensors, FLOPs, draws, predicted vs measured peak, "
                     "recompute overhead R/(F+B) counted and measured",
                     _arguments, _command)


_register()
