"""``python -m needle.memory report SCRIPT [ARGS...]``: run your script, report its memory.

The script runs as ``__main__`` (``sys.argv`` = ``[SCRIPT, *ARGS]``) inside
:func:`needle.memory.record`; afterwards every device with a needle allocator that was used
gets a table: peak and current bytes per category (weight, gradient, optimizer, activation,
workspace, other), allocations and reuses. ``--plot PNG`` writes the timeline.

Example:
    python -m needle.memory report --plot step.png my_training_step.py --epochs 1

The estimate-beside-measurement report for the built-in models (ledger, rounding, residual),
also per rank under data parallelism, ZeRO, mixed precision and accumulation, needs
``needle.nn``, ``needle.optim`` and ``needle.distributed``, which this layer does not import:
it is ``python apps/memory_report.py --model mlp_resnet ...`` (``--strategy zero
--zero-stage 2 --nproc 4 --precision fp16-mixed`` for the model state per rank); run it as
the script of this command to see both tables:
``python -m needle.memory report apps/memory_report.py --strategy zero ...``.
"""
from __future__ import annotations

import argparse
import runpy
import sys

from .categories import CATEGORIES
from .registry import _allocators_for, reset_peak
from .timeline import plot_timeline, record

MOVED = ("--model", "--optimizer", "--batch-size", "--num-blocks", "--num-layers",
         "--strategy", "--zero-stage", "--precision", "--accumulate")


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m needle.memory",
                                     description="needle memory tools")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="run a script and report its memory per category")
    rep.add_argument("--plot", default=None, help="write the timeline PNG here")
    rep.add_argument("script", help="a Python file, run as __main__")
    rep.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser.parse_args(argv)


def _table(stats: dict) -> str:
    mib = 2 ** 20
    lines = [f"device {stats['device']}: peak {stats['peak_bytes'] / mib:.2f} MiB, "
             f"now {stats['allocated_bytes'] / mib:.2f} MiB, {stats['num_allocs']} allocations "
             f"({stats['num_reused']} reused)",
             f"  {'category':<12} {'peak MiB':>10} {'now MiB':>10}"]
    for name in CATEGORIES:
        row = stats["by_category"][name]
        lines.append(f"  {name:<12} {row['peak'] / mib:10.3f} {row['current'] / mib:10.3f}")
    return "\n".join(lines)


def _run_script(script: str, args: list) -> int:
    saved = sys.argv
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def report(script: str, args: list, plot: str | None = None) -> int:
    """Run ``script`` with ``args`` under :func:`record`; print one table per used device."""
    before = {}
    for alloc in _allocators_for(None):
        reset_peak(alloc.name)
        before[alloc.name] = alloc.stats()["num_allocs"]
    with record() as timeline:
        code = _run_script(script, args)
    used = [a.stats() for a in _allocators_for(None)]
    used = [s for s in used if s["num_allocs"] > before.get(s["device"], 0)]
    print(f"\nneedle memory report: {script}, {len(timeline)} allocator events")
    for stats in used:
        print(_table(stats))
    if plot:
        plot_timeline(timeline, plot, title=script)
        print(f"timeline plot written to {plot}")
    return code


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in MOVED for a in argv) and not any(a.endswith(".py") for a in argv):
        print("error: the report on built-in models moved to apps/memory_report.py, run\n"
              "  python apps/memory_report.py " + " ".join(a for a in argv if a != "report")
              + "\nor measure your own script: python -m needle.memory report SCRIPT [ARGS]",
              file=sys.stderr)
        return 2
    args = parse(argv)
    return report(args.script, args.args, args.plot)


if __name__ == "__main__":
    sys.exit(main())
