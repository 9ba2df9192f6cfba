"""The main job's options: one :class:`Config`, one parser, one validation pass.

Options common to every strategy live here; each strategy adds its own through
``add_arguments`` (see ``strategies/base.py``) so that the parser stays the single place that
knows every flag, and ``--help`` shows every default.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

MODELS = ("mlp_resnet", "mlp", "cnn")
DATASETS = ("digits", "mnist")
OPTIMIZERS = ("adam", "sgd")
DEVICES = ("cpu", "cpu_numpy", "cuda")
BACKENDS = ("mpi", "tcp", "nccl")  # how the ranks talk (needle.distributed.launch --backend)
PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed")
# Each optimizer's own learning rate: Adam's 0.003 left SGD below chance (0.08 after 2 epochs).
DEFAULT_LR = {"adam": 0.003, "sgd": 0.1}


class UsageError(Exception):
    """A bad command line or missing input: reported in one line, exit status 2."""


@dataclass
class Config:
    """Everything one run of the main job depends on (strategy options included)."""

    data: str = "digits"
    data_dir: str | None = None
    model: str = "mlp_resnet"
    epochs: int = 20
    max_steps: int | None = None
    batch_size: int = 64
    optimizer: str = "adam"
    lr: float | None = None  # None: DEFAULT_LR[optimizer]
    weight_decay: float = 1e-4
    hidden: int = 100
    device: str | None = None
    out: str = "runs"
    seed: int = 0
    progress: bool = True
    nproc: int = 1
    backend: str | None = None  # None: $NEEDLE_DIST_BACKEND, else the strategy's default
    strategy: str | None = None  # None: "single" for one process, "ddp" for more
    precision: str = "fp32"
    accumulate: int = 1
    clip_grad: float | None = None  # max global L2 norm of the gradients per step
    slow_worker: str | None = None  # "RANK:MS"
    kill_worker: str | None = None  # "RANK@STEP"
    freeze_worker: str | None = None  # "RANK@STEP"
    die_at_step: int | None = None
    die_after_micro_batches: int | None = None
    flip_bit: str | None = None  # "RANK@STEP"
    nan_at: str | None = None  # "RANK@STEP"
    skip_layer: str | None = None  # "RANK@STEP"
    check_replicas: int | None = None  # every K steps (debugging.py)
    detect_anomaly: bool = False  # the first op that makes a NaN/Inf stops the job
    trace: str | None = None  # the merged Chrome trace of every rank (trace.py)
    save_every: int | None = None
    checkpoint_dir: str | None = None  # None: --resume's folder, else OUT/checkpoints
    keep_checkpoints: int = 3
    resume: str | None = None
    adopt_run: bool = False  # --resume from a checkpoint of another run than its folder's
    rng_ledger: str | None = None
    verify_resume: int | None = None
    activation_checkpoints: str | None = None  # "2c,2,2c": segment lengths, c = recomputed
    memory_budget: int | None = None  # bytes per rank: apps/training/planner.py chooses
    extra: dict | None = None  # strategy-specific options, by dest name

    @property
    def learning_rate(self) -> float:
        return DEFAULT_LR[self.optimizer] if self.lr is None else self.lr


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block, no traceback
        raise UsageError(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" where it says something: not after a help that names its default
    already, not for None, and not for a flag (its default is "off")."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or action.nargs == 0):
            return text
        return super()._get_help_string(action)


def _one_of(values) -> str:
    """A metavar that lists the accepted values, as argparse's own choices would."""
    return "{" + ",".join(values) + "}"


# long: one flat list of the common options, each with its help, reads as the --help page
def build_parser(strategies: dict) -> argparse.ArgumentParser:
    """The parser with the common options and every registered strategy's options."""
    d = Config()
    p = _Parser(prog="train.py", description="Train a model end to end and report held-out "
                "accuracy and throughput.", formatter_class=_HelpFormatter)
    p.add_argument("--data", default=d.data, metavar=_one_of(DATASETS), help="the dataset")
    p.add_argument("--data-dir", default=None, help="folder with the MNIST IDX .gz files")
    p.add_argument("--model", default=d.model, metavar=_one_of(MODELS), help="the model")
    p.add_argument("--epochs", type=int, default=d.epochs,
                   help="passes over the training data")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps (default: run all epochs)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="examples per optimizer step, summed over data-parallel replicas")
    p.add_argument("--optimizer", default=d.optimizer, metavar=_one_of(OPTIMIZERS),
                   help="the optimizer")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: " + ", ".join(
                       f"{k} {v}" for k, v in DEFAULT_LR.items()) + ")")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="L2 weight decay the optimizer adds to each gradient")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden width of MLP models")
    p.add_argument("--device", default=None, metavar=_one_of(DEVICES),
                   help="where tensors live (default: cpu if built, else cpu_numpy)")
    p.add_argument("--out", default=d.out, help="output folder for summary.json and the plot")
    p.add_argument("--seed", type=int, default=d.seed, help="makes runs repeatable")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars (per-epoch lines are still printed)")
    p.add_argument("--nproc", type=int, default=d.nproc,
                   help="ranks started through needle.distributed.launch")
    p.add_argument("--backend", default=None, metavar=_one_of(BACKENDS),
                   help="how the ranks communicate: mpi, tcp, or nccl (cuda() tensors through "
                        "NCCL, the rest over tcp; with --device cuda) (default: "
                        "$NEEDLE_DIST_BACKEND, else mpi, tcp for ps)")
    p.add_argument("--strategy", default=None, metavar=_one_of(strategies),
                   help="how the ranks share the work (default: single for --nproc 1, else "
                        "ddp)")
    p.add_argument("--precision", default=d.precision, metavar=_one_of(PRECISIONS),
                   help="fp16-mixed = float16 parameters, autocast, loss scaling, float32 "
                        "master weights; bf16-mixed = the same in bfloat16, without loss "
                        "scaling (single, ddp, zero)")
    p.add_argument("--accumulate", type=int, default=d.accumulate, metavar="G",
                   help="micro-batches per optimizer step, gradients accumulated with "
                        "weights n_i / n (single, ddp, zero)")
    p.add_argument("--clip-grad", type=float, default=None, metavar="X",
                   help="before each optimizer step, scale the gradients down to global L2 "
                        "norm X when it is larger: the whole model's norm under every "
                        "strategy (not ps)")
    p.add_argument("--activation-checkpoints", default=None, metavar="PLAN",
                   help="recompute activations in backward: the model's layers cut into "
                        "segments by length, 'c' marking a recomputed one, e.g. 2c,2,2c "
                        "(single, ddp, zero)")
    p.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                   help="peak bytes per rank: choose the ZeRO stage, the activation "
                        "checkpoints, the micro-batch count and the pipeline split with the "
                        "least predicted step time that fits, and fail if the measured peak "
                        "exceeds it (single, ddp, zero, pipeline; docs/training.md)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="with --memory-budget: predict the step times from this machine's "
                        "calibration (python -m needle.plan calibrate) instead of nominal "
                        "rates")
    faults = p.add_argument_group("fault injection (really sleeps, SIGKILLs, SIGSTOPs)")
    faults.add_argument("--slow-worker", default=None, metavar="RANK:MS",
                        help="rank RANK sleeps MS milliseconds before every step")
    faults.add_argument("--kill-worker", default=None, metavar="RANK@STEP",
                        help="rank RANK SIGKILLs itself when it reaches step STEP")
    faults.add_argument("--freeze-worker", default=None, metavar="RANK@STEP",
                        help="rank RANK SIGSTOPs itself when it reaches step STEP (alive but "
                             "silent; the launcher stops it once the job has finished)")
    faults.add_argument("--die-at-step", type=int, default=None, metavar="N",
                        help="every rank of the job SIGKILLs itself at step N")
    faults.add_argument("--die-after-micro-batches", type=int, default=None, metavar="M",
                        help="with --die-at-step N and --accumulate G > M: die after M "
                             "micro-batches of step N, in the middle of its accumulation")
    faults.add_argument("--flip-bit", default=None, metavar="RANK@STEP",
                        help="rank RANK flips the top mantissa bit of its first parameter's "
                             "first element right after step STEP's update")
    faults.add_argument("--nan-at", default=None, metavar="RANK@STEP",
                        help="rank RANK adds log(0) to its model's output in step STEP")
    faults.add_argument("--skip-layer", default=None, metavar="RANK@STEP",
                        help="rank RANK detaches its first layer's output in step STEP: no "
                             "gradient for that layer's parameters on that rank")
    debug = p.add_argument_group("debugging (docs/debugging.md)")
    debug.add_argument("--trace", default=None, metavar="FILE",
                       help="write one Chrome trace of every rank (open in ui.perfetto.dev) "
                            "and add critical_path to summary.json")
    debug.add_argument("--check-replicas", type=int, default=None, metavar="K",
                       help="every K steps, data-parallel replicas compare digests of their "
                            "replicated state; a difference stops the job (ddp, zero)")
    debug.add_argument("--detect-anomaly", action="store_true",
                       help="stop at the first op (forward or backward) whose output holds a "
                            "NaN or Inf, naming it, its source line, the step and the rank")
    ckpt = p.add_argument_group("checkpoints and exact resume")
    ckpt.add_argument("--save-every", type=int, default=None, metavar="K",
                      help="write a checkpoint every K optimizer steps")
    ckpt.add_argument("--checkpoint-dir", default=None, metavar="D",
                      help="where checkpoints go (default: the --resume folder, else "
                           "OUT/checkpoints)")
    ckpt.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints,
                      help="how many complete checkpoints to keep")
    ckpt.add_argument("--resume", default=None, metavar="D",
                      help="continue from the newest complete checkpoint under D")
    ckpt.add_argument("--adopt-run", action="store_true",
                      help="with --resume: accept a checkpoint whose run differs from its "
                           "folder's run.json (one copied from another run); refused without")
    ckpt.add_argument("--rng-ledger", default=None, metavar="FILE",
                      help="record every random draw (JSON lines; one file per rank)")
    ckpt.add_argument("--verify-resume", type=int, default=None, metavar="K",
                      help="certify exact resume: run --max-steps straight, then save at step "
                           "K, SIGKILL, resume, and compare (see docs/training.md)")
    for name, cls in strategies.items():
        group = p.add_argument_group(f"--strategy {name}")
        cls.add_arguments(group)
    return p


def refuse_outside_launcher() -> bool:
    """Started as 1 of N > 1 by mpiexec, not needle: raise on the first, True on the others."""
    env, size = os.environ, max(int(os.environ.get(n, "").strip() or 1) for n in (
        "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"))
    if size <= 1 or env.get("NEEDLE_LAUNCH_STATUS_DIR"):
        return False
    if any(env.get(n, "0") != "0" for n in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        return True
    raise UsageError(f"started by an outside launcher as one of {size} processes: use "
                     f"`python apps/train.py --nproc {size}` (needle starts the ranks itself)")


def parse_args(argv, strategies: dict) -> Config:
    """Command line → :class:`Config` (raises :class:`UsageError` on bad values)."""
    namespace = vars(build_parser(strategies).parse_args(argv))
    common = {f.name for f in fields(Config)}
    cfg = Config(**{k: v for k, v in namespace.items() if k in common})
    cfg.extra = {k: v for k, v in namespace.items() if k not in common}
    if cfg.strategy is None:
        cfg.strategy = "single" if cfg.nproc == 1 else "ddp"
    validate(cfg, strategies)
    return cfg


def _choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise UsageError(f"unknown {name} {value!r}, expected one of {', '.join(allowed)}")


def validate(cfg: Config, strategies: dict) -> None:
    """Check the common options, then let the chosen strategy check its own."""
    _choice("--data", cfg.data, DATASETS)
    _choice("--model", cfg.model, MODELS)
    _choice("--optimizer", cfg.optimizer, OPTIMIZERS)
    _choice("--strategy", cfg.strategy, tuple(strategies))
    if cfg.device is not None:
        _choice("--device", cfg.device, DEVICES)
    _choice("--precision", cfg.precision, PRECISIONS)
    if cfg.backend is not None:
        _choice("--backend", cfg.backend, BACKENDS)
    if cfg.clip_grad is not None and not 0 < cfg.clip_grad < float("inf"):
        raise UsageError(f"--clip-grad must be a positive number, got {cfg.clip_grad}")
    if cfg.accumulate < 1:
        raise UsageError(f"--accumulate must be positive, got {cfg.accumulate}")
    if (cfg.precision != "fp32" or cfg.accumulate > 1) and not strategies[
            cfg.strategy].mixed_precision_and_accumulation:
        raise UsageError(f"--precision and --accumulate apply to the single, ddp and zero "
                         f"strategies, got --strategy {cfg.strategy}")
    if cfg.die_after_micro_batches is not None and (
            cfg.die_at_step is None and cfg.verify_resume is None
            or not 0 < cfg.die_after_micro_batches < cfg.accumulate):
        raise UsageError(f"--die-after-micro-batches M needs --die-at-step (or "
                         f"--verify-resume) and 0 < M < --accumulate {cfg.accumulate}, got "
                         f"M={cfg.die_after_micro_batches}")
    for name in ("epochs", "batch_size", "hidden", "nproc"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got "
                             f"{getattr(cfg, name)}")
    for name in ("max_steps", "die_at_step", "save_every", "keep_checkpoints", "verify_resume",
                 "check_replicas"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if cfg.verify_resume is not None and (cfg.max_steps is None
                                          or not 0 < cfg.verify_resume < cfg.max_steps):
        raise UsageError(f"--verify-resume K needs --max-steps S with 0 < K < S, got K="
                         f"{cfg.verify_resume}, S={cfg.max_steps}")
    if cfg.resume is not None and not os.path.isdir(cfg.resume):
        raise UsageError(f"--resume: no such folder {cfg.resume}")
    if cfg.adopt_run and cfg.resume is None:
        raise UsageError("--adopt-run applies to the checkpoint --resume D loads, got no --resume")
    if (cfg.flip_bit or cfg.nan_at or cfg.skip_layer) and cfg.strategy not in (
            "single", "ddp", "zero"):
        raise UsageError(f"--flip-bit, --nan-at and --skip-layer apply to --strategy single, "
                         f"ddp and zero, got --strategy {cfg.strategy}")
    if cfg.check_replicas is not None and cfg.strategy not in ("ddp", "zero"):
        raise UsageError(f"--check-replicas compares data-parallel replicas: --strategy ddp or "
                         f"zero, got --strategy {cfg.strategy}")
    if cfg.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {cfg.seed}")
    if cfg.lr is not None and cfg.lr <= 0:
        raise UsageError(f"--lr must be positive, got {cfg.lr}")
    if (cfg.extra or {}).get("compile") and cfg.strategy != "single":
        raise UsageError(f"--compile runs the single-process step; with --nproc {cfg.nproc} "
                         f"--strategy {cfg.strategy} it is not supported yet: use --compile "
                         f"with --nproc 1 (--strategy single)")
    _validate_memory_options(cfg, strategies)
    if cfg.data == "mnist":
        if cfg.data_dir is None:
            raise UsageError("--data mnist needs --data-dir DIR holding the IDX .gz files")
        if not os.path.isdir(cfg.data_dir):
            raise UsageError(f"data directory not found: {cfg.data_dir}")
    strategies[cfg.strategy].validate(cfg)


PLANNED = ("single", "ddp", "zero", "pipeline")  # what --memory-budget plans for


def parse_checkpoints(spec: str) -> list[tuple[int, bool]]:
    """``"2c,2,2c"`` -> ``[(2, True), (2, False), (2, True)]``: consecutive segments of the
    model's layers by length, ``c`` marking one recomputed in backward."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        length = item[:-1] if item.endswith("c") else item
        if not length.isdigit() or int(length) < 1:
            raise UsageError(f"--activation-checkpoints: expected segment lengths such as "
                             f"2c,2,2c (a positive length, 'c' for a recomputed segment), "
                             f"got {spec!r}")
        out.append((int(length), item.endswith("c")))
    return out


def layers_per_stage(text: str | None) -> list[int] | None:
    """``--layers-per-stage`` as a list of positive counts (None when not given)."""
    if text is None:
        return None
    counts = [c.strip() for c in str(text).split(",")]
    if not all(c.isdigit() and int(c) > 0 for c in counts):
        raise UsageError(f"--layers-per-stage: expected positive counts such as 2,4, got "
                         f"{text!r}")
    return [int(c) for c in counts]


def format_checkpoints(segments) -> str:
    """The inverse of :func:`parse_checkpoints`."""
    return ",".join(f"{n}{'c' if c else ''}" for n, c in segments)


def _validate_memory_options(cfg: Config, strategies: dict) -> None:
    default_step = strategies[cfg.strategy].mixed_precision_and_accumulation
    if cfg.activation_checkpoints is not None:
        parse_checkpoints(cfg.activation_checkpoints)
        if not default_step or (cfg.extra or {}).get("compile"):
            raise UsageError(f"--activation-checkpoints applies to the single, ddp and zero "
                             f"strategies without --compile, got --strategy {cfg.strategy}")
    if cfg.memory_budget is None:
        if (cfg.extra or {}).get("calibration"):
            raise UsageError("--calibration sets the planner's step times: it needs "
                             "--memory-budget")
        return
    if cfg.memory_budget < 1:
        raise UsageError(f"--memory-budget must be a positive number of bytes, got "
                         f"{cfg.memory_budget}")
    if cfg.strategy not in PLANNED:
        raise UsageError(f"--memory-budget plans for --strategy {', '.join(PLANNED)}, got "
                         f"--strategy {cfg.strategy}")
    extra = cfg.extra or {}
    if cfg.precision != "fp32" or extra.get("compile") or extra.get("data_shares", 1) > 1:
        raise UsageError("--memory-budget predicts the fp32 step without --compile or "
                         "--data-shares")
    if cfg.activation_checkpoints is not None:
        raise UsageError("--memory-budget chooses the activation checkpoints: leave out "
                         "--activation-checkpoints")
    if extra.get("balance", "params") != "params":
        raise UsageError("--memory-budget chooses the pipeline split: leave out --balance")
