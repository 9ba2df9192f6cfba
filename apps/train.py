"""The main job: train a model end to end and report held-out accuracy and throughput.

With no arguments it trains an MLP-ResNet on scikit-learn's 8×8 handwritten digits (1,797
real images shipped with scikit-learn, 20% held out) in one process and writes
``runs/summary.json`` and ``runs/training.png``. ``--strategy`` and ``--nproc`` spread the same
job over processes started through needle's launcher (``docs/training.md``); run
``python apps/train.py --help`` for every option and its default.

Example:
    $ python apps/train.py --epochs 5 --out runs/quick
    $ python apps/train.py --nproc 2 --epochs 5                 # data parallel (ddp)
    $ python apps/train.py --data mnist --data-dir data --model cnn --device cpu
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile

_APPS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_APPS)
if _APPS not in sys.path:  # the training package beside this file
    sys.path.insert(0, _APPS)
for _p in (_ROOT, os.path.join(_ROOT, "python")):  # run from this repo or a course root
    if os.path.isdir(os.path.join(_p, "needle")) and _p not in sys.path:
        sys.path.append(_p)

from training import trace  # noqa: E402
from training.checkpoints import interrupted_line  # noqa: E402
from training.config import (  # noqa: E402
    DATASETS,
    DEVICES,
    MODELS,
    OPTIMIZERS,
    Config,
    UsageError,
    refuse_outside_launcher,
)
from training.config import parse_args as _parse_args  # noqa: E402
from training.data import load_data, load_digits_split, load_mnist_split  # noqa: E402
from training.debugging import ReplicasDiverged  # noqa: E402
from training.loop import (  # noqa: E402
    Interrupted,
    NothingToTrain,
    install_interrupt_handler,
    interrupt_asked,
    run,
)
from training.models import build_model, build_optimizer  # noqa: E402
from training.strategies import STRATEGIES  # noqa: E402
from training.summary import params_sha256, write_outputs  # noqa: E402

__all__ = ["Config", "UsageError", "parse_args", "train", "main", "load_data",
           "load_digits_split", "load_mnist_split", "build_model", "build_optimizer",
           "write_outputs", "params_sha256", "MODELS", "DATASETS", "OPTIMIZERS", "DEVICES"]


def parse_args(argv=None) -> Config:
    """Command line → :class:`Config` (raises :class:`UsageError` on bad values)."""
    return _parse_args(argv, STRATEGIES)


def train(cfg: Config, *, rank: int = 0, world_size: int = 1) -> dict | None:
    """Run ``cfg`` on this rank; the summary on the reporting rank, None on the others.
    With ``--memory-budget`` the planner chooses first (``training/planner.py``) and the
    summary gains ``plan``."""
    plan = None
    if cfg.memory_budget is not None:
        from training.planner import choose

        cfg, plan = choose(cfg, rank, world_size)
    strategy = STRATEGIES[cfg.strategy](cfg, rank, world_size)
    traced = trace.start(cfg, strategy)
    try:
        summary = run(cfg, strategy, rank, world_size)
    except Interrupted:  # the other ranks stop too: closing may find them gone
        with contextlib.suppress(Exception):
            strategy.close()
        raise
    except BaseException:
        strategy.close()
        raise
    strategy.close()
    if traced:  # after the run: every rank's part is complete
        trace.finish(summary, cfg)
    if summary is not None and plan is not None:
        summary["plan"] = plan.block(summary)
    return summary


def _start_ranks(cfg: Config) -> tuple[int, int]:
    """With a distributed strategy: in the user's process, run this command on ``--nproc``
    ranks and exit with the job's status; inside a rank, join the process group and return
    (rank, world size)."""
    cls = STRATEGIES[cfg.strategy]
    if not cls(cfg).distributed:
        return 0, 1
    from needle.distributed.launch import relaunch

    ranks = cls.ranks(cfg)
    # the parameter server runs on tcp by default: it survives dead and restarted workers
    backend = cfg.backend or os.environ.get("NEEDLE_DIST_BACKEND") or (
        "tcp" if cfg.strategy == "ps" else None)
    with _interrupt_steps() as steps_file:
        try:  # returns only inside a rank
            relaunch(ranks, backend, restart_workers=(cfg.extra or {}).get("restart_workers", 0),
                     announce_interrupt=False)  # the one line below says it
        except SystemExit as exc:
            if exc.code in (130, 143):  # the ranks were stopped by SIGINT or SIGTERM
                print(interrupted_line(cfg, _read_steps(steps_file)), file=sys.stderr)
            raise
    import needle.distributed as dist

    # nccl also with --nproc 1 (no launcher): a one-rank NCCL group over a singleton host group
    dist.init_process_group("nccl" if cfg.backend == "nccl" else None, timeout=300)
    if dist.get_world_size() != ranks:
        raise UsageError(f"--strategy {cfg.strategy} --nproc {cfg.nproc} needs {ranks} ranks "
                         f"but the process group has {dist.get_world_size()}")
    return dist.get_rank(), dist.get_world_size()


_STEPS_ENV = "NEEDLE_TRAIN_INTERRUPT_STEPS"


@contextlib.contextmanager
def _interrupt_steps():
    """In the user's process: a file the ranks' first speaker writes its step count to when
    interrupted (``_STEPS_ENV`` names it), removed afterwards. Inside a rank: that name."""
    if _STEPS_ENV in os.environ:
        yield os.environ[_STEPS_ENV]
        return
    folder = tempfile.mkdtemp(prefix="needle-train-")
    os.environ[_STEPS_ENV] = os.path.join(folder, "steps")
    try:
        yield os.environ[_STEPS_ENV]
    finally:
        del os.environ[_STEPS_ENV]
        shutil.rmtree(folder, ignore_errors=True)


def _read_steps(path: str) -> int | None:
    """The step count of the lowest rank that left one (a parameter server's servers don't)."""
    folder, name = os.path.split(path)
    ranks = sorted(int(f.rsplit(".", 1)[1]) for f in os.listdir(folder)
                   if f.startswith(name + ".") and f.rsplit(".", 1)[1].isdigit())
    for rank in ranks:
        try:
            with open(f"{path}.{rank}") as f:
                return int(f.read())
        except (OSError, ValueError):
            continue
    return None


def _interrupted(cfg, steps: int | None, rank: int, world_size: int) -> int:
    """Ctrl-C: one line from the user's process (a rank leaves it the step count)."""
    if cfg is None:
        print("interrupted", file=sys.stderr)
    elif world_size == 1:
        print(interrupted_line(cfg, steps), file=sys.stderr)
    elif steps is not None and _STEPS_ENV in os.environ:
        with open(f"{os.environ[_STEPS_ENV]}.{rank}", "w") as f:
            f.write(str(steps))
    return 130



def main(argv=None) -> int:
    from needle import NeedleError
    from needle.autograd import NonFiniteError
    from needle.distributed import PeerError

    install_interrupt_handler()
    cfg, rank, world_size = None, 0, 1
    try:
        if refuse_outside_launcher():  # raises on the outside job's first process
            return 2
        cfg = parse_args(argv)
        if cfg.verify_resume is not None:
            from training.verify_resume import verify_resume

            return verify_resume(cfg, sys.argv[1:] if argv is None else list(argv),
                                 os.path.abspath(__file__))
        rank, world_size = _start_ranks(cfg)
        summary = train(cfg, rank=rank, world_size=world_size)
    except (Interrupted, KeyboardInterrupt) as exc:
        return _interrupted(cfg, getattr(exc, "steps", None), rank, world_size)
    except NothingToTrain:  # the rank that announces resumes said so
        return 0
    except ReplicasDiverged as exc:  # every rank knows: the first one says it
        if exc.rank == 0:
            print(f"train.py: error: {exc}", file=sys.stderr)
        return 4
    except NonFiniteError as exc:
        print(f"train.py: error: non-finite value on rank {getattr(exc, 'rank', 0)} at step "
              f"{getattr(exc, 'step', '?')}: {exc}", file=sys.stderr)
        return 5
    except PeerError:
        if interrupt_asked():  # stopped with the others: the user's process says so
            return 130
        raise  # another rank failed first: the launcher must see whom this error blames
    except (UsageError, NeedleError) as exc:  # bad input: one line, no traceback
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    if summary is None:
        return 0
    json_path, png_path = write_outputs(summary, cfg.out)
    ranks = f" x {world_size} ranks" if world_size > 1 else ""
    print(f"held-out accuracy {summary['accuracy']:.4f} ({summary['test_examples']} examples), "
          f"{summary['examples_per_s']:,.0f} examples/second on {summary['device']}{ranks} "
          f"[{summary['strategy']}, {summary['steps']} steps]")
    traffic = summary.get("traffic")
    if traffic:
        verdict = "all equal" if traffic["all_match"] else "MISMATCHES"
        print(f"traffic (rank {traffic['rank']}): {traffic['calls']} calls, predicted "
              f"{traffic['predicted_sent']:,} B sent, measured {traffic['sent']:,} B "
              f"(+{traffic['overhead_sent']:,} B call checks and headers): {verdict}")
    plan = summary.get("plan")
    if plan:
        chosen = " ".join(f"{k} {v}" for k, v in plan["chosen"].items() if v is not None)
        print(f"memory plan: {chosen}; peak per rank predicted {plan['predicted_peak']:,} B, "
              f"measured {plan['measured_peak']:,} B, budget {plan['budget']:,} B "
              f"({len(plan['rejected'])} cheaper configurations rejected)")
    print(f"wrote {json_path} and {png_path}")
    if plan and not plan["within_budget"]:
        print(f"train.py: error: --memory-budget {plan['budget']}: a step's measured peak "
              f"{plan['measured_peak']:,} bytes exceeds the budget", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
