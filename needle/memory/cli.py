"""``python -m needle.memory``: memory tools on the command line.

* ``profile [--device D] [--out DIR] [--no-html] [--plot-x event|time] SCRIPT [ARGS...]``
  runs your script as ``__main__`` (``sys.argv`` = ``[SCRIPT, *ARGS]``; options go before the
  script, as ``python -m cProfile`` takes them) inside :func:`needle.memory.profile` and
  writes ``DIR/memory.json``, ``DIR/memory.png`` (x: allocator events in op order, or with
  ``--plot-x time`` seconds) and ``DIR/memory.html`` (default DIR: ``memory_profile``); it
  prints the peak, the categories and the largest tensors at the peak.
* ``report [--plot PNG] SCRIPT [ARGS...]`` runs the script inside :func:`needle.memory.record`
  and prints, per device used, peak and current bytes per category and the allocation counts.
* subcommands that layers above register (``checkpoint-report``, from ``needle.checkpoint``).

Example:
    python -m needle.memory profile --device cpu --out runs/mem apps/train.py --epochs 1
    python -m needle.memory report --plot step.png my_training_step.py --epochs 1

The estimate-beside-measurement report for the built-in models (ledger, rounding, residual)
needs ``needle.nn`` and ``needle.optim``, which this layer does not import: it is
``python apps/memory_report.py --model mlp_resnet ...``.
"""
from __future__ import annotations

import argparse
import runpy
import sys

from ._text import columns, line_label, op_label, shape_label
from .categories import CATEGORIES
from .registry import _allocators_for, reset_peak
from .timeline import plot_timeline, record

MOVED = ("--model", "--optimizer", "--batch-size", "--num-blocks", "--num-layers",
         "--strategy", "--zero-stage", "--precision", "--accumulate")

# name -> (help, add_arguments(parser), run(args) -> exit code): commands of higher layers,
# registered when they are imported (``import needle`` imports them all).
_COMMANDS: dict = {}


def register_command(name: str, help: str, add_arguments, run) -> None:
    """Add ``python -m needle.memory NAME`` (used by layers this one may not import)."""
    _COMMANDS[name] = (help, add_arguments, run)


def parse(argv):
    # ``python -m needle.memory`` imports the ``needle`` package first, which imports the
    # layers that register their commands (needle.checkpoint: checkpoint-report)
    parser = argparse.ArgumentParser(prog="python -m needle.memory",
                                     description="needle memory tools")
    sub = parser.add_subparsers(dest="command", required=True)
    pro = sub.add_parser("profile", help="run a script and write its memory profile "
                         "(memory.json, memory.png, memory.html)")
    pro.add_argument("--device", default=None,
                     help="the device to profile, e.g. cpu (default: every device)")
    pro.add_argument("--out", default="memory_profile", help="output folder (default: "
                     "%(default)s)")
    pro.add_argument("--no-html", action="store_true", help="skip memory.html")
    pro.add_argument("--plot-x", choices=["event", "time"], default="event",
                     help="memory.png's x axis: allocator events in op order, or seconds "
                          "since the script started (default: %(default)s)")
    pro.add_argument("script", help="a Python file, run as __main__")
    pro.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    rep = sub.add_parser("report", help="run a script and report its memory per category")
    rep.add_argument("--plot", default=None, help="write the timeline PNG here")
    rep.add_argument("script", help="a Python file, run as __main__")
    rep.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    for name, (text, add_arguments, _) in _COMMANDS.items():
        add_arguments(sub.add_parser(name, help=text))
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


def _profile_summary(report: dict) -> str:
    mib = 2 ** 20
    lines = []
    for name, dev in report["devices"].items():
        if not dev["events"]:
            continue
        peak = dev["peak"]
        lines.append(f"device {name}: peak {dev['peak_bytes'] / mib:.2f} MiB at op "
                     f"{op_label(peak['op'], peak['phase'])} ({peak['phase']}), final "
                     f"{dev['final_bytes'] / mib:.2f} MiB, {dev['events']} events")
        rows = [["category", "peak MiB", "final MiB"]]
        rows += [[cat, f"{row['peak'] / mib:.3f}", f"{row['final'] / mib:.3f}"]
                 for cat, row in dev["by_category"].items()]
        lines += columns(rows, right=[1, 2], indent="  ")
        rows = [["phase", "peak MiB", "op", "line"]]
        rows += [[phase, f"{row['peak_bytes'] / mib:.3f}", op_label(row["op"], phase),
                  line_label(row["line"], phase)] for phase, row in dev["phases"].items()]
        lines += columns(rows, right=[1], indent="  ")
        lines.append("  largest tensors at the peak:")
        rows = [["bytes", "category", "shape", "op", "line"]]
        rows += [[f"{e['bytes']:,}", e["category"], shape_label(e["shape"]),
                  op_label(e["op"], e["phase"]), line_label(e["line"] or e["user_line"],
                                                            e["phase"])]
                 for e in peak["live"][:5]]
        lines += columns(rows, right=[0], indent="    ")
    return "\n".join(lines)


def profile_script(script: str, args: list, out: str, device=None, html: bool = True,
                   x_axis: str = "event") -> int:
    """Run ``script`` with ``args`` under :func:`needle.memory.profile`; save into ``out``
    (``x_axis``: the plot's, ``"event"`` or ``"time"``)."""
    from .profiler import profile

    with profile(device) as prof:
        code = _run_script(script, args)
    paths = prof.save(out, html=html, title=f"{script}: memory profile", x_axis=x_axis)
    print(f"\nneedle memory profile: {script}")
    print(_profile_summary(prof.report()))
    print("wrote " + ", ".join(p for k, p in paths.items() if k != "pngs"))
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
    if args.command == "profile":
        return profile_script(args.script, args.args, args.out, args.device, not args.no_html,
                              args.plot_x)
    if args.command in _COMMANDS:
        from needle._core.errors import NeedleError

        try:
            return _COMMANDS[args.command][2](args)
        except NeedleError as exc:  # bad input: one line, no traceback
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return report(args.script, args.args, args.plot)
