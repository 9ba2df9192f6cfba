"""``python -m needle.distributed.pipeline simulate``: predict a schedule's timeline.

Example:
    $ python -m needle.distributed.pipeline simulate --schedule gpipe --stages 4 --microbatches 8
    $ python -m needle.distributed.pipeline simulate --schedule 1f1b --stages 4 \\
          --microbatches 8 --plot 1f1b.png
    $ python -m needle.distributed.pipeline simulate --schedule gpipe --stages 4 \\
          --target-bubble 0.1          # the fewest micro-batches below a 10% bubble
"""
from __future__ import annotations

import argparse
import json
import sys

from .schedules import SCHEDULES, ScheduleError
from .simulator import min_microbatches, simulate


def _costs(text: str) -> float | list[float]:
    parts = [float(x) for x in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m needle.distributed.pipeline",
                                description="Pipeline schedule tools.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="predict timeline, bubble and activation memory",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--schedule", default="gpipe", help=f"one of {SCHEDULES}")
    s.add_argument("--stages", type=int, default=4, help="pipeline ranks p")
    s.add_argument("--microbatches", type=int, default=8, help="micro-batches m")
    s.add_argument("--virtual-stages", type=int, default=None,
                   help="chunks per rank (interleaved; default 2 there)")
    s.add_argument("--forward", type=_costs, default=1.0,
                   help="cost of one forward (or comma-separated, one per stage)")
    s.add_argument("--backward", type=_costs, default=2.0, help="cost of one backward")
    s.add_argument("--weight", type=_costs, default=None,
                   help="weight-gradient cost (then --backward is the input-gradient cost)")
    s.add_argument("--comm", type=float, default=0.0, help="time of one message")
    s.add_argument("--activation-bytes", type=_costs, default=1.0,
                   help="bytes one micro-batch holds on a stage")
    s.add_argument("--plot", default=None, metavar="FILE", help="draw the timeline to FILE")
    s.add_argument("--width", type=int, default=120, help="text timeline width")
    s.add_argument("--json", action="store_true", help="print the numbers as JSON")
    s.add_argument("--target-bubble", type=float, default=None,
                   help="instead: print the fewest micro-batches whose bubble is below this")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    costs = dict(forward=opts.forward, backward=opts.backward, weight=opts.weight,
                 comm=opts.comm, activation_bytes=opts.activation_bytes)
    try:
        if opts.target_bubble is not None:
            m = min_microbatches(opts.schedule, opts.stages, opts.target_bubble,
                                 virtual_stages=opts.virtual_stages, **costs)
            bubble = simulate(opts.schedule, opts.stages, m, virtual_stages=opts.virtual_stages,
                              **costs).bubble_fraction
            print(f"{opts.schedule} on {opts.stages} stages: the bubble first drops below "
                  f"{opts.target_bubble:g} at {m} micro-batches ({bubble:.4f})")
            return 0
        sim = simulate(opts.schedule, opts.stages, opts.microbatches,
                       virtual_stages=opts.virtual_stages, **costs)
    except ScheduleError as exc:
        print(f"pipeline simulate: error: {exc}", file=sys.stderr)
        return 2
    if opts.json:
        print(json.dumps(sim.as_dict(), indent=2))
    else:
        print(sim.text(opts.width))
    if opts.plot:
        print(f"wrote {sim.plot(opts.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
