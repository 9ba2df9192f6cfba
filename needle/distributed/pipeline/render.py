"""Draw a simulated (or measured) pipeline timeline: as text, or as a PNG with matplotlib."""
from __future__ import annotations

import math
from typing import Any

_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
_BUBBLE = "#bbbbbb"


def timeline_text(sim: Any, width: int = 120) -> str:
    """Two lines per rank: the kind running in each time cell (``.`` when idle) and the
    micro-batch it works on (mod 10). One cell is the shortest compute action, or longer when
    the makespan would not fit in ``width`` cells.

    Example:
        >>> from needle.distributed.pipeline import simulate
        >>> print(simulate("gpipe", 2, 2, forward=1, backward=1).text())  # doctest: +ELLIPSIS
        gpipe: 2 stages, 2 micro-batches, makespan 6 (1 cell = 1)
        stage 0  FF..BB
                 01..01
        stage 1  .FFBB.
                 .0101.
        bubble 0.3333 (per stage 0.333 0.333); peak in-flight micro-batches 2 2
    """
    compute = [e for row in sim.timeline for e in row if e.kind in _COLOURS and e.end > e.start]
    shortest = min((e.end - e.start for e in compute), default=1.0)
    cells = math.ceil(sim.makespan / shortest - 1e-9) if sim.makespan > 0 else 0
    unit = shortest if cells <= width else sim.makespan / width
    cells = min(cells, width)
    plan = sim.plan
    head = (f"{plan.name}: {plan.num_ranks} stages"
            + (f" x {plan.virtual_stages} virtual" if plan.virtual_stages > 1 else "")
            + f", {plan.num_microbatches} micro-batches, makespan {sim.makespan:g} "
            f"(1 cell = {unit:.3g})")
    lines = [head]
    for r, row in enumerate(sim.timeline):
        kinds, mbs = ["."] * cells, ["."] * cells
        for e in row:
            if e.kind not in _COLOURS:
                continue
            for c in range(cells):
                mid = (c + 0.5) * unit
                if e.start <= mid < e.end:
                    kinds[c], mbs[c] = e.kind, str(e.microbatch % 10)
        lines.append(f"stage {r:<2d} {''.join(kinds)}")
        lines.append(f"{'':9s}{''.join(mbs)}")
    per = " ".join(f"{b:.3f}" for b in sim.bubble_per_rank)
    peaks = " ".join(str(x) for x in sim.peak_inflight)
    lines.append(f"bubble {sim.bubble_fraction:.4f} (per stage {per}); "
                 f"peak in-flight micro-batches {peaks}")
    return "\n".join(lines)


def plot_timeline(sim: Any, path: str, title: str | None = None) -> str:
    """Write a PNG: one row per rank, forward/backward/weight boxes in three colours with the
    micro-batch number, idle time (the bubble) grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = len(sim.timeline)
    fig, ax = plt.subplots(figsize=(max(6.0, min(18.0, 0.25 * sim.makespan + 4)), 0.6 * p + 1.4))
    for r, row in enumerate(sim.timeline):
        y = p - 1 - r
        ax.broken_barh([(0, sim.makespan)], (y - 0.4, 0.8), facecolors=_BUBBLE)
        for e in row:
            if e.kind not in _COLOURS or e.end <= e.start:
                continue
            ax.broken_barh([(e.start, e.end - e.start)], (y - 0.4, 0.8),
                           facecolors=_COLOURS[e.kind], edgecolors="white", linewidth=0.5)
            if sim.plan.num_microbatches <= 32:
                ax.text((e.start + e.end) / 2, y, str(e.microbatch), ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {p - 1 - y}" for y in range(p)])
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time")
    kinds = ["F", "B", "W"] if sim.plan.split_backward else ["F", "B"]
    names = {"F": "forward", "B": "backward" if len(kinds) == 2 else "backward (input grad)",
             "W": "backward (weight grad)"}
    handles = [Patch(color=_COLOURS[k], label=names[k]) for k in kinds]
    handles.append(Patch(color=_BUBBLE, label="bubble (idle)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if p < 3 else -0.2),
              ncol=len(handles), fontsize=8, frameon=False)
    plan = sim.plan
    ax.set_title(title or f"{plan.name}: {plan.num_ranks} stages, {plan.num_microbatches} "
                 f"micro-batches, bubble {sim.bubble_fraction:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
