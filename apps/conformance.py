"""The conformance matrix: every strategy trains, evaluates, saves and resumes the same model.

Each cell is one ``apps/train.py`` run (a strategy × a model × a precision × micro-batches per
step), started as its own job, beside a single-process reference run of the same cell, on a
batch of 63 examples (so data-parallel shares and micro-batches are unequal: equal ones, with
weights of exactly 1/2, would hide a wrong weighting). A cell passes when every check that
applies to it passes:

- ``runs``: the job exits 0 and writes ``summary.json`` and ``model.ndl``;
- ``matches single``: the reference is the single-process run with the same data-parallel
  shares (``--data-shares 2`` for ddp, zero, ps and 3d) and micro-batches (``--accumulate``
  the pipeline's ``--microbatches``). ddp, zero and the synchronous parameter server give its
  parameters and buffers bit for bit on every model (``--data-shares`` draws each share's
  Dropout masks from its own stream and keeps share 0's BatchNorm statistics, as the
  replicas do); on a model without BatchNorm or Dropout (``mlp``) the pipelines and 3d do
  too, and tp gives its loss at every step within a relative 1e-4 (fp16-mixed: 2e-2), its
  sums running in another order. Where the layout changes the math by design, the held-out
  accuracy is within 2 points of the reference's instead: tp, pipeline and 3d ranks draw
  their own Dropout masks and pipelines normalise per micro-batch in another stream order,
  and asynchronous parameter-server modes apply stale gradients;
- ``same as ddp``: zero (every stage) and the synchronous parameter server end with
  bitwise ddp's parameters (``params_sha256``) and buffers (``buffers_sha256``);
- ``re-evaluated``: the accuracy in ``summary.json`` equals a fresh single process's
  evaluation of the saved ``model.ndl`` (exactly where the evaluation runs the same kernels
  on the whole model; within one held-out example for tp, pipeline and 3d, whose sharded
  sums round differently);
- ``blocks``: every ``summary.json`` block the strategy promises is present;
- ``resume``: ``--verify-resume`` certifies IDENTICAL (synchronous strategies);
- ``clip-grad``: with ``--clip-grad 0.05`` (SGD, so the clipping shows) the losses are the
  single-process reference's under the same clipping (the parameter server refuses the flag:
  the check is that it says so);
- ``resumed by single``: a checkpoint saved at step 3 by the strategy resumes in a single
  process, whose losses to step 6 are the straight single run's (the parameter server's state
  does not convert: the check is that the refusal names it).

``resume``, ``clip-grad`` and ``resumed by single`` run a short budget (6 steps) and, but for
``resume``, only on ``mlp``: with BatchNorm or Dropout the layout changes the math, so there
is no exact single-process run to compare a few steps with (the accuracy columns cover them).

A cell whose strategy refuses its precision or micro-batching says so (``n/a``) and is not
counted as passing. The CI suite runs a subset (``python_tests/apps/test_conformance.py``).

Example:
    $ python apps/conformance.py --strategies single,ddp,ps-sync --models mlp_resnet
    $ python apps/conformance.py --full --json runs/conformance.json     # the whole matrix
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np

_APPS = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(_APPS, "train.py")
if _APPS not in sys.path:
    sys.path.insert(0, _APPS)

# strategy label -> train.py arguments (two workers or stages; 3d is a 2 x 1 x 2 mesh)
STRATEGIES: dict[str, list[str]] = {
    "single": ["--strategy", "single"],
    "ddp": ["--strategy", "ddp", "--nproc", "2"],
    **{f"zero{k}": ["--strategy", "zero", "--nproc", "2", "--zero-stage", str(k)]
       for k in (1, 2, 3)},
    **{f"ps-{m}": ["--strategy", "ps", "--servers", "1", "--nproc", "2", "--ps-mode", m]
       for m in ("sync", "async", "ssp", "backup")},
    **{f"pipeline-{s}": ["--strategy", "pipeline", "--nproc", "2", "--schedule", s,
                         "--microbatches", "4"]
       for s in ("gpipe", "1f1b", "interleaved", "zero-bubble")},
    "tp": ["--strategy", "tp", "--nproc", "2"],
    "3d": ["--strategy", "3d", "--dp", "2", "--tp", "1", "--pp", "2", "--microbatches", "4"],
}
MODELS = ("mlp", "mlp_resnet", "cnn")
PRECISIONS = ("fp32", "fp16-mixed")
ACCUMULATE = (1, 3)
ASYNC = {"ps-async", "ps-ssp", "ps-backup"}  # backup drops the slowest worker's gradient
SYNC_DATA_PARALLEL = {"ddp", "zero1", "zero2", "zero3", "ps-sync"}
DATA_PARALLEL = {*SYNC_DATA_PARALLEL, *ASYNC}
# layouts that sum every gradient in the single-process reference's order (two replicas:
# a sum of two terms has one order; pipeline micro-batches accumulate in micro-batch order);
# tensor parallelism splits each product's sum over ranks, so it matches within TOLERANCE
BITWISE = {"ddp", "zero1", "zero2", "zero3", "ps-sync", "3d",
           *(f"pipeline-{s}" for s in ("gpipe", "1f1b", "interleaved", "zero-bubble"))}
SAME_AS_DDP = {"zero1", "zero2", "zero3", "ps-sync"}
SHARDED_EVAL = ("tp", "pipeline", "3d")
EXACT_MODELS = {"mlp"}  # no BatchNorm, no Dropout: data and model layouts keep the math
# blocks of summary.json each strategy promises, beside the ones every run writes
_EVERY = {"params_sha256", "buffers_sha256", "model_file", "state_sha256"}
_DEFAULT_STEP = {"memory", "scaler", "accumulation"}
PROMISED: dict[str, set[str]] = {
    "single": _DEFAULT_STEP, "ddp": _DEFAULT_STEP | {"traffic"},
    **{f"zero{k}": _DEFAULT_STEP | {"zero"} for k in (1, 2, 3)},
    **{f"ps-{m}": {"ps"} for m in ("sync", "async", "ssp", "backup")},
    **{f"pipeline-{s}": {"mesh", "pipeline", "traffic", "memory"}
       for s in ("gpipe", "1f1b", "interleaved", "zero-bubble")},
    "tp": {"mesh", "traffic", "memory"}, "3d": {"mesh", "pipeline", "traffic", "memory"},
}
TOLERANCE = {"fp32": 1e-4, "fp16-mixed": 2e-2}
# An odd batch: data-parallel shares (32 + 31) and micro-batches are unequal, as equal ones
# (weights of exactly 1/2) would hide a wrong weighting.
BATCH = ["--batch-size", "63"]
SHORT = ["--epochs", "1", "--max-steps", "6", "--seed", "0", *BATCH]  # resume, clip, conversion
ACCURACY_POINTS = 0.02


@dataclass(frozen=True)
class Cell:
    strategy: str
    model: str
    precision: str = "fp32"
    accumulate: int = 1
    shares: int = 1  # single only: --data-shares

    @property
    def name(self) -> str:
        shares = f"/shares{self.shares}" if self.shares > 1 else ""
        return f"{self.strategy}/{self.model}/{self.precision}/acc{self.accumulate}{shares}"

    @property
    def microbatches(self) -> int:
        """Micro-batches per step as the math sees them (a pipeline's, or --accumulate)."""
        args = STRATEGIES[self.strategy]
        return int(args[args.index("--microbatches") + 1]) if "--microbatches" in args \
            else self.accumulate

    @property
    def replicas(self) -> int:
        """Data-parallel replicas (2 for ddp, zero, ps and the 3d mesh; else 1)."""
        args = STRATEGIES[self.strategy]
        if "--dp" in args:
            return int(args[args.index("--dp") + 1])
        return 2 if self.strategy in DATA_PARALLEL else self.shares

    def reference(self) -> Cell:
        """The single-process cell this one is compared with: the same data-parallel shares
        (``--data-shares``) and micro-batches (``--accumulate``)."""
        return Cell("single", self.model, self.precision, self.microbatches, self.replicas)

    def args(self) -> list[str]:
        out = [*STRATEGIES[self.strategy], "--model", self.model]
        if self.precision != "fp32":
            out += ["--precision", self.precision]
        if self.accumulate != 1:
            out += ["--accumulate", str(self.accumulate)]
        if self.shares != 1:
            out += ["--data-shares", str(self.shares)]
        return out


@dataclass
class Result:
    cell: Cell
    checks: dict[str, tuple[bool | None, str]] = field(default_factory=dict)
    summary: dict | None = None
    refused: str | None = None

    @property
    def passed(self) -> bool:
        return self.refused is None and all(ok is not False for ok, _ in self.checks.values())


class Runner:
    """Runs cells in ``workdir`` with a common budget (``--epochs``, ``--max-steps``, seed)."""

    def __init__(self, workdir: str, budget: list[str], timeout: float = 900.0,
                 short_checks: bool = True):
        self.workdir, self.budget, self.timeout = workdir, budget, timeout
        self.short_checks = short_checks
        self._done: dict[Cell, Result] = {}
        self._short: dict[tuple, dict | None] = {}

    def _train(self, cell: Cell, extra: list[str], out: str,
               budget: list[str] | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, TRAIN, *cell.args(), *(self.budget if budget is None else budget),
               "--no-progress", "--out", out, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout,
                              env=env)

    def _short_summary(self, cell: Cell, extra: list[str], tag: str) -> dict | None:
        """``cell`` run for the short budget with ``extra`` (once); its summary or None."""
        key = (cell, tuple(extra))
        if key not in self._short:
            out = os.path.join(self.workdir, f"{cell.name.replace('/', '_')}_{tag}")
            proc = self._train(cell, extra, out, SHORT)
            self._short[key] = _summary(out) if proc.returncode == 0 else None
        return self._short[key]

    def run(self, cell: Cell) -> Result:
        """Train ``cell`` (once; later calls return the same result) and check it."""
        if cell in self._done:
            return self._done[cell]
        result = Result(cell)
        self._done[cell] = result
        out = os.path.join(self.workdir, cell.name.replace("/", "_"))
        proc = self._train(cell, [], out)
        path = os.path.join(out, "summary.json")
        refusal = _usage_error(proc)
        if refusal is not None and not os.path.exists(path):
            result.refused = refusal
            return result
        ran = proc.returncode == 0 and os.path.exists(path)
        result.checks["runs"] = (ran, "" if ran else f"exit {proc.returncode}: "
                                 f"{proc.stderr.strip()[-400:]}")
        if not ran:
            return result
        with open(path) as f:
            result.summary = json.load(f)
        result.checks["re-evaluated"] = self._reevaluate(cell, result.summary, out)
        result.checks["blocks"] = _blocks(cell, result.summary)
        self._compare(cell, result)
        if self.short_checks:
            if cell.strategy not in ASYNC:
                result.checks["resume"] = self._verify_resume(cell, out + "_resume")
            if cell.model in EXACT_MODELS:
                result.checks["clip-grad"] = self._clip(cell)
                if cell.strategy != "single":
                    result.checks["resumed by single"] = self._resumed_by_single(cell)
        return result

    def _refusal(self, cell: Cell, extra: list[str], out: str, names: str) -> tuple[bool, str]:
        """A run that must be refused (exit 2) with a message naming ``names``."""
        message = _usage_error(self._train(cell, extra, out, SHORT)) or ""
        return names in message, f"refused: {message}"

    def _clip(self, cell: Cell) -> tuple[bool, str]:
        flags = ["--clip-grad", "0.05", "--optimizer", "sgd"]
        if cell.strategy.startswith("ps-"):
            return self._refusal(cell, flags, os.path.join(self.workdir, "clip_refused"),
                                 "--clip-grad")
        got = self._short_summary(cell, flags, "clip")
        ref = self._short_summary(cell.reference(), flags, "clip")
        if got is None or ref is None:
            return False, "a clipped run failed"
        return _matches(cell, got, ref)

    def _resumed_by_single(self, cell: Cell) -> tuple[bool, str]:
        """Save at step 3 under the cell's strategy, resume to step 6 in one process."""
        folder = os.path.join(self.workdir, f"{cell.name.replace('/', '_')}_ckpt")
        target = Cell("single", cell.model, cell.precision, cell.accumulate)
        if cell.strategy.startswith("ps-"):  # async modes refuse to save; sync's won't convert
            saved = self._train(cell, ["--save-every", "3", "--checkpoint-dir", folder],
                                folder + "_run", SHORT)
            refusal = _usage_error(saved)
            if refusal is not None:
                return "--ps-mode" in refusal, f"saving refused: {refusal}"
            return self._refusal(target, ["--resume", folder], folder + "_resumed", "ps")
        saved = self._train(cell, ["--save-every", "3", "--checkpoint-dir", folder],
                            folder + "_run", SHORT)
        if saved.returncode != 0:
            return False, f"saving run exit {saved.returncode}: {saved.stderr[-300:]}"
        got = self._short_summary(target, ["--resume", folder], f"from_{cell.strategy}")
        ref = self._short_summary(target, [], "straight")
        if got is None or ref is None:
            return False, "the resumed or the straight single run failed"
        # steps 1-3 ran in the saving layout's order: equal to float rounding, not bitwise
        return _matches(cell, got, ref, bitwise=False)

    def _compare(self, cell: Cell, result: Result) -> None:
        if cell.strategy == "single" and cell.microbatches == cell.accumulate:
            return  # the reference itself
        ref = self.run(cell.reference())
        if ref.summary is None:
            result.checks["matches single"] = (False, f"reference {ref.cell.name} did not run")
            return
        result.checks["matches single"] = _matches(cell, result.summary, ref.summary)
        if cell.strategy in SAME_AS_DDP:
            ddp = self.run(Cell("ddp", cell.model, cell.precision, cell.accumulate))
            result.checks["same as ddp"] = (False, "ddp did not run") if ddp.summary is None \
                else _same_as(cell, result.summary, ddp.summary)

    def _reevaluate(self, cell: Cell, summary: dict, out: str) -> tuple[bool, str]:
        got, n = reevaluate(summary, out)
        want = summary["accuracy"]
        slack = 1.0 / n if cell.strategy.startswith(SHARDED_EVAL) else 0.0
        ok = abs(got - want) <= slack + 1e-12
        return ok, f"summary {want:.4f}, model.ndl {got:.4f}"

    def _verify_resume(self, cell: Cell, out: str) -> tuple[bool, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, TRAIN, *cell.args(), *SHORT, "--no-progress", "--out", out,
               "--verify-resume", "3"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * self.timeout,
                              env=env)
        line = next((x for x in proc.stdout.splitlines() if "resume certificate" in x), "")
        return proc.returncode == 0 and "IDENTICAL" in line, line or proc.stderr[-300:]


def _usage_error(proc: subprocess.CompletedProcess) -> str | None:
    """The one-line refusal of a run that exited 2 on bad input (printed by train.py itself,
    or by its ranks through the launcher), else None."""
    if proc.returncode != 2:
        return None
    lines = (proc.stderr + "\n" + proc.stdout).splitlines()
    return next((line.strip() for line in lines if "train.py: error:" in line), None)


def _summary(out: str) -> dict | None:
    path = os.path.join(out, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def reevaluate(summary: dict, out: str) -> tuple[float, int]:
    """(accuracy, held-out examples) of ``out``'s ``model.ndl`` evaluated here, in this
    process, on the run's held-out data."""
    from training.config import Config
    from training.data import load_data
    from training.model_state import load_model
    from training.strategies.base import evaluate_model

    cfg = Config(**summary["config"])
    X, y, Xt, yt = load_data(cfg)
    classes = int(max(y.max(), yt.max())) + 1
    model = load_model(cfg, os.path.join(out, summary["model_file"]), X.shape[1], classes)
    mixed = cfg.precision == "fp16-mixed"
    _, accuracy = evaluate_model(model, Xt, yt, model.parameters()[0].device, mixed)
    return accuracy, int(Xt.shape[0])


def _blocks(cell: Cell, summary: dict) -> tuple[bool, str]:
    missing = sorted(k for k in PROMISED[cell.strategy] | _EVERY if summary.get(k) is None
                     and not (k == "state_sha256" and cell.strategy.startswith("ps-")))
    return not missing, "missing " + ", ".join(missing) if missing else ""


def _exact(cell: Cell) -> bool:
    """Whether the cell computes its reference's math: synchronous data parallelism on any
    model (the reference keeps each share's random stream and share 0's statistics), the
    other layouts on a model without BatchNorm or Dropout."""
    if cell.strategy in ASYNC:
        return False
    return cell.strategy in SYNC_DATA_PARALLEL or cell.model in EXACT_MODELS


def _matches(cell: Cell, got: dict, ref: dict, bitwise: bool | None = None
             ) -> tuple[bool, str]:
    """Whether ``got`` trained what ``ref`` did (see the module doc); ``bitwise`` overrides
    whether the cell's parameters must equal the reference's bit for bit."""
    bitwise = cell.strategy in BITWISE if bitwise is None else bitwise
    if _exact(cell) and bitwise:
        for key in ("params_sha256", "buffers_sha256"):
            if got[key] != ref[key]:
                return False, f"not bitwise: {key} {got[key][:12]} vs {ref[key][:12]}"
    if _exact(cell):  # the reported losses: each layout sums the step's loss its own way
        a, b = np.array(got["losses"]), np.array(ref["losses"])
        if a.shape != b.shape:
            return False, f"{a.size} losses, reference {b.size}"
        tol = TOLERANCE[cell.precision]
        worst = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12))) if a.size else 0.0
        same = "parameters bitwise, " if bitwise else ""
        return worst <= tol, (f"{same}losses, worst relative difference {worst:.1e} "
                              f"(<= {tol:g})")
    gap = abs(got["accuracy"] - ref["accuracy"])
    return gap <= ACCURACY_POINTS, (f"accuracy {got['accuracy']:.4f} vs {ref['accuracy']:.4f} "
                                    f"(within {ACCURACY_POINTS:g})")


def _same_as(cell: Cell, got: dict, ddp: dict) -> tuple[bool, str]:
    if not _exact(cell):
        return _matches(cell, got, ddp)
    same = all(got[k] == ddp[k] for k in ("params_sha256", "buffers_sha256"))
    return same, "params and buffers bitwise" if same else \
        f"params_sha256 {got['params_sha256'][:12]} vs ddp {ddp['params_sha256'][:12]}"


def cells(strategies, models, precisions, accumulate) -> list[Cell]:
    return [Cell(s, m, p, a) for s in strategies for m in models for p in precisions
            for a in accumulate]


def table(results: list[Result]) -> str:
    """One line per cell: the verdict and each check as ok / FAIL / n/a with its detail."""
    names = ["runs", "matches single", "same as ddp", "re-evaluated", "blocks", "resume",
             "clip-grad", "resumed by single"]
    width = max(len(r.cell.name) for r in results)
    lines = [f"{'cell':<{width}}  verdict  " + "  ".join(names)]
    for r in results:
        if r.refused is not None:
            lines.append(f"{r.cell.name:<{width}}  n/a      refused: {r.refused}")
            continue
        marks = []
        for n in names:
            ok, _ = r.checks.get(n, (None, ""))
            marks.append(f"{'-' if ok is None else 'ok' if ok else 'FAIL':<{len(n)}}")
        lines.append(f"{r.cell.name:<{width}}  {'pass' if r.passed else 'FAIL':<7}  "
                     + "  ".join(marks))
        lines += [f"{'':<{width}}    {n}: {detail}" for n, (ok, detail) in r.checks.items()
                  if ok is False]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run the conformance matrix and print its table.")
    p.add_argument("--strategies", default="single,ddp,zero2,ps-sync,pipeline-1f1b,tp")
    p.add_argument("--models", default="mlp,mlp_resnet")
    p.add_argument("--precisions", default="fp32")
    p.add_argument("--accumulate", default="1")
    p.add_argument("--full", action="store_true",
                   help="every strategy x model x precision x accumulate")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--no-short-checks", dest="short_checks", action="store_false",
                   help="skip the resume, clip-grad and resumed-by-single columns")
    p.add_argument("--workdir", default=None, help="keep every run's outputs here")
    p.add_argument("--json", default=None, help="write every cell's checks to this file")
    a = p.parse_args(argv)
    if a.full:
        chosen = cells(STRATEGIES, MODELS, PRECISIONS, ACCUMULATE)
    else:
        chosen = cells(a.strategies.split(","), a.models.split(","), a.precisions.split(","),
                       [int(x) for x in a.accumulate.split(",")])
    unknown = sorted({c.strategy for c in chosen} - set(STRATEGIES))
    if unknown:
        p.error(f"unknown strategies {unknown}, expected some of {list(STRATEGIES)}")
    budget = ["--epochs", str(a.epochs), "--seed", "0", *BATCH]
    if a.max_steps:
        budget += ["--max-steps", str(a.max_steps)]
    workdir = a.workdir or tempfile.mkdtemp(prefix="needle-conformance-")
    runner = Runner(workdir, budget, short_checks=a.short_checks)
    results = []
    for cell in chosen:
        results.append(runner.run(cell))
        verdict = "n/a" if results[-1].refused else "pass" if results[-1].passed else "FAIL"
        print(f"{cell.name}: {verdict}", file=sys.stderr, flush=True)
    print(table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"cell": r.cell.name, "refused": r.refused, "passed": r.passed,
                        "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in r.checks.items()}}
                       for r in results], f, indent=2)
    applicable = [r for r in results if r.refused is None]
    print(f"{sum(r.passed for r in applicable)} passed, "
          f"{sum(not r.passed for r in applicable)} failed")
    return 0 if all(r.passed for r in applicable) else 1


if __name__ == "__main__":
    sys.exit(main())
