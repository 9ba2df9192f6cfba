"""DDP step time with communication overlapped with backward vs all buckets sent after it,
and with bucket priority; plus a per-bucket timeline plot (ready, all-reduce start, done).

    python bench/bench_ddp.py --nproc 2 --backend mpi --png docs/ddp_timeline.png

The model is an MLP of several large Linear layers; each layer's gradients are about one
bucket (bucket_cap_mb is set to one layer's weight). The three variants alternate step by
step. "first layer ready" is when the next step's first layer could start: the all-reduce
of the bucket holding the first layer (the last one backward fills) is done, measured from
the end of backward. With ``priority=1`` that bucket goes over a second process group
instead of queueing behind the other buckets' all-reduces.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import needle.autograd  # noqa: E402,F401 - before needle.nn (import order)
import needle.distributed as dist  # noqa: E402
from needle import nn  # noqa: E402
from needle.autograd import Tensor  # noqa: E402
from needle.distributed.launch import relaunch  # noqa: E402


def build(width: int, layers: int, overlap: bool,
          priority: int = 0) -> dist.DistributedDataParallel:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    cap = 1.05 * width * width * 4 / 2**20  # one layer (weight + bias) per bucket
    return dist.DistributedDataParallel(nn.Sequential(*blocks), bucket_cap_mb=cap,
                                        overlap=overlap, priority=priority)


def step(ddp: dist.DistributedDataParallel, x: np.ndarray) -> dict:
    for p in ddp.params:
        p.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    loss = (ddp(Tensor(x)) * 1.0).sum()
    t_forward = time.perf_counter()
    loss.backward()
    t_backward = time.perf_counter()
    ddp.finish_gradient_sync()
    t_end = time.perf_counter()
    record = dict(ddp.timeline[-1], t0=t0, forward_end=t_forward, backward_end=t_backward,
                  end=t_end)
    first = max(record["buckets"], key=lambda b: b["index"])  # holds parameter 0
    record["first_layer_ready"] = first["done"] - t_backward
    return record


def plot(records: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(records), 1, figsize=(9, 2.5 * len(records)), sharex=True)
    for ax, (name, rec) in zip(axes, records.items(), strict=False):
        t0 = rec["t0"]
        ax.axvspan(0, (rec["forward_end"] - t0) * 1e3, color="0.9", label="forward")
        ax.axvspan((rec["forward_end"] - t0) * 1e3, (rec["backward_end"] - t0) * 1e3,
                   color="#cde", label="backward")
        for b in rec["buckets"]:
            y = b["index"]
            ax.plot((b["ready"] - t0) * 1e3, y, "k|", markersize=12)
            ax.barh(y, (b["done"] - b["started"]) * 1e3, left=(b["started"] - t0) * 1e3,
                    height=0.6, color="tab:orange")
        ax.axvline((rec["end"] - t0) * 1e3, color="tab:red", label="grads synced")
        ax.set_ylabel("bucket")
        ax.set_title(f"{name}: step {1e3 * (rec['end'] - t0):.1f} ms "
                     "(| ready, bar = all-reduce on the comm thread)")
        ax.legend(loc="lower right", fontsize=7)
    axes[-1].set_xlabel("ms since forward start (rank 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", choices=["mpi", "tcp"], default="mpi")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--png", default="ddp_timeline.png")
    opts = parser.parse_args()
    relaunch(opts.nproc, backend=opts.backend, timeout=1800)
    dist.init_process_group(timeout=120)
    models = {"overlap on": build(opts.width, opts.layers, True),
              "overlap off": build(opts.width, opts.layers, False),
              "overlap + priority": build(opts.width, opts.layers, True, priority=1)}
    x = np.random.default_rng(dist.get_rank()).standard_normal((opts.batch, opts.width))
    x = x.astype(np.float32) / opts.width
    times: dict[str, list[float]] = {k: [] for k in models}
    first: dict[str, list[float]] = {k: [] for k in models}
    last: dict[str, dict] = {}
    for i in range(opts.steps + 1):
        for name, ddp in models.items():
            rec = step(ddp, x)
            if i:  # the first step warms up buffers and threads
                times[name].append(rec["end"] - rec["t0"])
                first[name].append(rec["first_layer_ready"])
                last[name] = rec
    if dist.get_rank() == 0:
        on, off = (statistics.median(times[k]) for k in ("overlap on", "overlap off"))
        comm = statistics.median(sum(b["done"] - b["started"] for b in last[k]["buckets"])
                                 for k in ("overlap off",))
        print(f"{len(models['overlap on'].buckets)} buckets, {opts.layers} x Linear({opts.width})"
              f", batch {opts.batch}, {dist.get_world_size()} ranks, {dist.get_backend()}")
        print(f"step median: overlap on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, "
              f"speedup {off / on:.2f}x; all-reduce time when not overlapped {comm * 1e3:.1f} ms,"
              f" hidden by overlap {(off - on) / comm:.0%}")
        ready = {k: statistics.median(v) * 1e3 for k, v in first.items()}
        print(f"first layer ready after backward (median): overlap {ready['overlap on']:.1f} ms,"
              f" overlap + priority {ready['overlap + priority']:.1f} ms, ratio "
              f"{ready['overlap on'] / max(ready['overlap + priority'], 1e-9):.2f}x; step with "
              f"priority {statistics.median(times['overlap + priority']) * 1e3:.1f} ms")
        plot(last, opts.png)
        print(f"timeline: {opts.png}")
    for ddp in models.values():
        ddp.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
