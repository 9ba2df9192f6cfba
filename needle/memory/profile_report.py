"""The report of a memory profile: numbers (``memory.json``), a timeline (``memory.png``) and a
self-contained page (``memory.html``, no network needed to open it).

Per device (:func:`build_report`):

* ``by_category``: peak and final bytes of each category, replayed from the events and the
  baseline (they equal ``needle.memory.stats`` of the device: the profile resets the peaks when
  it opens, and every byte moves through an event);
* ``peak``: the event where the device's allocated bytes were highest and the *live set* there
  — every buffer with its bytes (blocks, as ``allocated_bytes`` counts them), requested bytes,
  shape, dtype, category, the op that allocated it, the Python line that called that op and its
  phase; the live set sums to ``peak_bytes``;
* ``phases``: the highest allocated bytes inside each phase (forward, backward, optimizer,
  other) with the op and category split there;
* ``timeline``: what the PNG draws, with its axis labels: x is the allocator event index in op
  order (``ops`` names the op running at each point), y the bytes of each category stacked,
  ``bands`` the phase spans, ``peak`` the annotated point and its top contributors (the live
  set grouped by the op that made each tensor and its category, also ``peak.by_op``).

Long records are thinned for the timeline only (``MAX_POINTS``), always keeping the peak.

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle.memory.profiler import profile
    >>> d = ndl.cpu_numpy()
    >>> with profile(d) as prof:
    ...     y = ndl.Tensor(np.ones((8, 8)), device=d) * 3
    >>> rep = build_report(prof)["devices"]["cpu_numpy"]
    >>> live = sum(t["bytes"] for t in rep["peak"]["live"])
    >>> rep["timeline"]["x_label"], live == rep["peak_bytes"]
    ('allocator event (op order)', True)
"""
from __future__ import annotations

import base64
import html
import json
import os

import numpy as np

from ._errors import MemoryArgumentError
from ._text import op_label
from .categories import CATEGORIES

__all__ = ["build_report", "save_report", "plot_report", "html_report", "MAX_POINTS",
           "X_AXES"]

MAX_POINTS = 4000  # timeline points kept in the JSON and the plot
TOP = 3            # contributors named at the peak of the plot
PHASES = ("forward", "backward", "optimizer", "other")


def _shape(shape) -> list | None:
    """A buffer's tensor shape as a list: [] for a scalar (a loss), None when unknown."""
    return None if shape is None else list(shape)


def _live_entry(rec) -> dict:
    return {"block": rec.block, "bytes": rec.nbytes, "requested": rec.requested,
            "category": rec.category, "shape": _shape(rec.shape),
            "dtype": rec.dtype, "op": rec.op, "line": rec.line, "user_line": rec.user_line,
            "phase": rec.phase, "allocated_at": rec.index}


def _baseline_entry(b: dict) -> dict:
    return {"block": b["block"], "bytes": b["nbytes"], "requested": b["requested"],
            "category": b["category"], "shape": _shape(b["shape"]),
            "dtype": b["dtype"], "op": b["op"], "line": None, "user_line": None,
            "phase": "before", "allocated_at": None}


def _series(recs: list, start: dict) -> dict[str, np.ndarray]:
    """Bytes of each category after each event (index 0: before the first)."""
    deltas = {c: np.zeros(len(recs) + 1, dtype=np.int64) for c in CATEGORIES}
    for i, r in enumerate(recs, start=1):
        if r.kind == "alloc":
            deltas[r.category][i] += r.nbytes
        elif r.kind == "free":
            deltas[r.category][i] -= r.nbytes
        else:
            deltas[r.prev_category][i] -= r.nbytes
            deltas[r.category][i] += r.nbytes
    return {c: start[c] + np.cumsum(deltas[c]) for c in CATEGORIES}


def _live_at(recs: list, baseline: dict, upto: int) -> list[dict]:
    """The live buffers after the first ``upto`` events, largest first."""
    live = {b: _baseline_entry(e) for b, e in baseline.items()}
    for r in recs[:upto]:
        if r.kind == "alloc":
            live[r.block] = _live_entry(r)
        elif r.kind == "free":
            live.pop(r.block, None)
        elif r.block in live:
            live[r.block]["category"] = r.category
    return sorted(live.values(), key=lambda e: (-e["bytes"], e["block"]))


def _phases(recs: list, totals: np.ndarray, series: dict) -> dict:
    out = {}
    for name in PHASES:
        idx = [i for i, r in enumerate(recs, start=1) if r.phase == name]
        if not idx:
            continue
        best = max(idx, key=lambda i: totals[i])
        rec = recs[best - 1]
        out[name] = {"peak_bytes": int(totals[best]), "events": len(idx), "at_event": best - 1,
                     "op": rec.op, "line": rec.line or rec.user_line,
                     "by_category": {c: int(series[c][best]) for c in CATEGORIES}}
    return out


def _bands(recs: list) -> list[dict]:
    bands = []
    for i, r in enumerate(recs, start=1):
        if bands and bands[-1]["phase"] == r.phase:
            bands[-1]["end"] = i
        else:
            bands.append({"phase": r.phase, "start": i - 1, "end": i})
    return bands


def _thin(n: int, keep: int) -> np.ndarray:
    """Indices of at most MAX_POINTS of n + 1 points, always with the first, last and peak."""
    if n + 1 <= MAX_POINTS:
        return np.arange(n + 1)
    idx = np.unique(np.concatenate([np.linspace(0, n, MAX_POINTS - 1).astype(np.int64),
                                    [keep]]))
    return idx


def _by_op(live: list) -> list[dict]:
    """The live set grouped by (op that made it, category), largest first."""
    groups: dict = {}
    for e in live:
        key = (op_label(e["op"], e["phase"]), e["category"])
        g = groups.setdefault(key, {"op": key[0], "category": key[1], "bytes": 0, "tensors": 0,
                                    "line": e["line"] or e["user_line"]})
        g["bytes"] += e["bytes"]
        g["tensors"] += 1
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def _timeline(recs: list, series: dict, totals: np.ndarray, peak_index: int,
              by_op: list, device: str) -> dict:
    idx = _thin(len(recs), peak_index)
    ops = ["(start)"] + [r.op or f"({r.phase})" for r in recs]
    top = by_op[:TOP]
    return {
        "x_label": "allocator event (op order)",
        "y_label": f"bytes allocated on {device}",
        "x": idx.tolist(),
        "time_s": [0.0 if i == 0 else round(recs[i - 1].t, 6) for i in idx],
        "ops": [ops[i] for i in idx],
        "series": {c: series[c][idx].tolist() for c in CATEGORIES},
        "bands": _bands(recs),
        "peak": {"x": int(peak_index), "bytes": int(totals[peak_index]), "top": top},
    }


def _device_report(prof, device: str) -> dict:
    recs = [r for r in prof.records if r.device == device]
    start = prof.start_stats[device]
    base = {c: start["by_category"][c]["current"] for c in CATEGORIES}
    series = _series(recs, base)
    totals = sum(series[c] for c in CATEGORIES)
    peak_index = int(np.argmax(totals))
    live = _live_at(recs, prof.baseline.get(device, {}), peak_index)
    by_op = _by_op(live)
    peak_rec = recs[peak_index - 1] if peak_index else None
    return {
        "device": device,
        "events": len(recs),
        "peak_bytes": int(totals[peak_index]),
        "final_bytes": int(totals[-1]),
        "baseline_bytes": int(totals[0]),
        "by_category": {c: {"peak": int(series[c].max()), "final": int(series[c][-1])}
                        for c in CATEGORIES},
        "peak": {"event": peak_index - 1, "op": peak_rec.op if peak_rec else None,
                 "phase": peak_rec.phase if peak_rec else "before",
                 "line": (peak_rec.line or peak_rec.user_line) if peak_rec else None,
                 "time_s": peak_rec.t if peak_rec else 0.0, "live": live, "by_op": by_op},
        "phases": _phases(recs, totals, series),
        "stats_end": prof.end_stats.get(device),
        "timeline": _timeline(recs, series, totals, peak_index, by_op, device),
    }


def build_report(prof) -> dict:
    """The profile as a JSON-ready dict: one entry per watched device (module docstring)."""
    devices = {name: _device_report(prof, name) for name in prof.start_stats}
    return {"version": 1, "wall_s": prof.wall_s, "ops": len(prof.ops),
            "categories": list(CATEGORIES), "devices": devices}


# ---- the picture -----------------------------------------------------------------------------
_COLORS = {"weight": "#4c72b0", "gradient": "#dd8452", "optimizer": "#55a868", "master": "#2f6b3f",
           "optimizer_temp": "#a1d99b", "activation": "#c44e52", "workspace": "#8172b3",
           "other": "#937860"}
_BAND = {"forward": "#fff3c4", "backward": "#d8ecff", "optimizer": "#e0f5e0", "other": None}


def _label(group: dict) -> str:
    where = f" @ {group['line']}" if group.get("line") else ""
    return (f"{group['bytes'] / 2**20:.2f} MiB {group['category']} from {group['op']} "
            f"({group['tensors']} tensors){where}")


X_AXES = ("event", "time")  # what a profile plot's x axis counts


def _check_x_axis(x_axis: str) -> None:
    if x_axis not in X_AXES:
        raise MemoryArgumentError(f"memory plot: unknown x axis, expected one of "
                                f"{', '.join(X_AXES)}, got {x_axis!r}")


def plot_report(dev: dict, path, title: str | None = None, x_axis: str = "event") -> str:
    """Draw one device's timeline (``dev`` from :func:`build_report`) into a PNG.

    ``x_axis``: ``"event"`` (allocator events in op order, ticks named by the op running) or
    ``"time"`` (seconds since the profile opened: where the time went, not only the bytes).

    Raises:
        MemoryArgumentError: for another ``x_axis``.
    """
    _check_x_axis(x_axis)
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    tl = dev["timeline"]
    events = np.asarray(tl["x"])
    seconds = np.asarray(tl["time_s"], dtype=np.float64)

    def at(index):  # an event index (or array of them) on the chosen axis
        return np.interp(index, events, seconds) if x_axis == "time" else index

    x = at(events)
    fig, ax = plt.subplots(figsize=(12, 5.5))
    try:
        for band in tl["bands"]:
            color = _BAND.get(band["phase"])
            if color:
                ax.axvspan(at(band["start"]), at(band["end"]), color=color, zorder=0,
                           linewidth=0)
        ax.stackplot(x, *[np.asarray(tl["series"][c]) / 2**20 for c in CATEGORIES],
                     labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES], step="post",
                     zorder=1)
        peak = tl["peak"]
        peak_x = at(peak["x"])
        ax.axvline(peak_x, color="black", linestyle="--", linewidth=1, zorder=2)
        text = "\n".join([f"peak {peak['bytes'] / 2**20:.2f} MiB"]
                         + [_label(t) for t in peak["top"]])
        right_end = float(max(x[-1], 1e-9 if x_axis == "time" else 1))
        left = peak_x > 0.6 * right_end  # keep the note inside the axes
        ax.annotate(text, (peak_x, peak["bytes"] / 2**20), xytext=(-8 if left else 8, -8),
                    textcoords="offset points", fontsize=7, va="top",
                    ha="right" if left else "left",
                    bbox={"boxstyle": "round", "fc": "white", "alpha": 0.85}, zorder=3)
        if x_axis == "event":
            ticks = np.linspace(0, len(x) - 1, num=min(14, len(x))).astype(int)
            ax.set_xticks(x[ticks])
            ax.set_xticklabels([tl["ops"][i] for i in ticks], rotation=60, ha="right",
                               fontsize=7)
            ax.set_xlabel(tl["x_label"] + ", labelled with the op running")
        else:
            ax.set_xlabel("seconds since the profile opened")
        for phase, color in _BAND.items():
            if color and any(b["phase"] == phase for b in tl["bands"]):
                ax.fill_between([], [], color=color, label=f"{phase} phase")
        ax.set_ylabel(tl["y_label"].replace("bytes", "MiB"))
        ax.set_title(title or f"needle memory profile: {dev['device']}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
        ax.set_xlim(0, right_end)
        fig.tight_layout()
        fig.savefig(str(path), format="png", dpi=110)
    finally:
        plt.close(fig)
    return str(path)


def _table(head: list, rows: list) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>")
    return "\n".join(out + ["</table>"])


def html_report(report: dict, pngs: dict, title: str) -> str:
    """One page: for each device the embedded PNG, categories, phases and the live set at
    the peak. Images are inlined (base64): nothing is fetched when the page opens."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
             "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:"
             "collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;"
             "text-align:right}img{max-width:100%}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    for name, dev in report["devices"].items():
        parts.append(f"<h2>{html.escape(name)}: peak {dev['peak_bytes']:,} B, final "
                     f"{dev['final_bytes']:,} B, {dev['events']:,} events</h2>")
        if name in pngs:
            with open(pngs[name], "rb") as f:
                data = base64.b64encode(f.read()).decode()
            parts.append(f"<img alt='timeline' src='data:image/png;base64,{data}'>")
        parts.append(_table(["category", "peak bytes", "final bytes"],
                            [(c, f"{v['peak']:,}", f"{v['final']:,}")
                             for c, v in dev["by_category"].items()]))
        parts.append("<h3>phases</h3>" + _table(
            ["phase", "peak bytes", "events", "op at the peak", "line"],
            [(p, f"{v['peak_bytes']:,}", v["events"], v["op"], v["line"])
             for p, v in dev["phases"].items()]))
        parts.append(f"<h3>live at the peak (op {html.escape(str(dev['peak']['op']))}, "
                     f"{dev['peak']['phase']})</h3>" + _table(
                         ["bytes", "category", "shape", "dtype", "op", "line", "your line",
                          "phase"],
                         [(f"{e['bytes']:,}", e["category"], e["shape"], e["dtype"], e["op"],
                           e["line"], e["user_line"], e["phase"])
                          for e in dev["peak"]["live"]]))
    parts.append("</body></html>")
    return "\n".join(parts)


def save_report(prof, directory, *, html: bool = True, title: str | None = None,
                x_axis: str = "event") -> dict:
    """Write ``memory.json``, ``memory.png`` (one per device past the first:
    ``memory.<device>.png``; ``x_axis`` as for :func:`plot_report`) and ``memory.html`` into
    ``directory``; returns the paths."""
    _check_x_axis(x_axis)
    os.makedirs(directory, exist_ok=True)
    report = build_report(prof)
    paths = {"json": os.path.join(directory, "memory.json")}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    pngs = {}
    used = [n for n, d in report["devices"].items() if d["events"]] or list(report["devices"])
    for k, name in enumerate(used):
        png = os.path.join(directory, "memory.png" if k == 0 else f"memory.{name}.png")
        pngs[name] = plot_report(report["devices"][name], png, title, x_axis)
    paths.update({"png": pngs[used[0]]} if used else {}, pngs=pngs)
    if html:
        paths["html"] = os.path.join(directory, "memory.html")
        with open(paths["html"], "w") as f:
            f.write(html_report(report, pngs, title or "needle memory profile"))
    return paths
