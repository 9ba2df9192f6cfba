"""``summary.json`` (a contract: users, tests and benchmarks read its keys) and the plot."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict

import numpy as np


def params_sha256(params: list[np.ndarray]) -> str:
    """SHA-256 over every parameter's bytes, in order, as stored (C order, native dtype)."""
    digest = hashlib.sha256()
    for p in params:
        array = np.ascontiguousarray(p)
        digest.update(str(array.dtype).encode() + str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def buffers_sha256(buffers: dict) -> str:
    """SHA-256 over the model's buffers (BatchNorm running statistics, ...) in name order:
    each name, dtype, shape and bytes. A model without buffers hashes the empty input."""
    digest = hashlib.sha256()
    for name in sorted(buffers):
        array = np.ascontiguousarray(buffers[name])
        digest.update(f"{name}:{array.dtype}:{array.shape}:".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def build_summary(cfg, strategy, device, history, losses, steps, wall, params,
                  n_train, n_test, steps_per_epoch, buffers=None) -> dict:
    """The summary dict of a finished run (the reporting rank's view): ``params`` are the
    model's parameters in ``parameters()`` order, ``buffers`` its buffers by name."""
    accuracy = history.test_acc[-1] if history.test_acc else float("nan")
    test_loss = history.test_loss[-1] if history.test_loss else float("nan")
    rate = float(np.median(history.examples_per_s)) if history.examples_per_s else 0.0
    summary = {
        "strategy": strategy.name, "world_size": strategy.world_size, "steps": steps,
        "accuracy": accuracy, "final_loss": losses[-1] if losses else float("nan"),
        "losses": losses, "wall_s": wall, "examples_per_s": rate,
        "params_sha256": params_sha256(params),
        "buffers_sha256": buffers_sha256(buffers or {}),
        "buffers": sorted(buffers or {}),
        "config": asdict(cfg), "device": str(device),
        "parameters": int(sum(p.size for p in params)),
        "train_examples": int(n_train), "test_examples": int(n_test),
        "steps_per_epoch": steps_per_epoch, "history": asdict(history),
        # the names of the first release, kept for readers that use them
        "final_test_accuracy": accuracy, "final_test_loss": test_loss,
        "final_train_loss": history.train_loss[-1] if history.train_loss else float("nan"),
        "examples_per_second": rate, "train_seconds": wall,
    }
    summary.update(strategy.summary_blocks())
    return summary


def write_outputs(summary: dict, out_dir: str) -> tuple[str, str]:
    """Write ``summary.json``, ``training.png`` (loss and accuracy per epoch) and, when the
    summary carries the trained model's state (``model_state``), ``model.ndl``; the JSON then
    names that file under ``model_file``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .model_state import MODEL_FILE, save_model

    os.makedirs(out_dir, exist_ok=True)
    summary = dict(summary)
    state = summary.pop("model_state", None)
    if state is not None:
        save_model(state, os.path.join(out_dir, MODEL_FILE))
        summary["model_file"] = MODEL_FILE
    json_path = os.path.join(out_dir, "summary.json")
    from needle.serialization import atomic_write_bytes

    # readers never see half a file, and nothing planted at a temporary name is written through
    atomic_write_bytes(json_path, json.dumps(summary, indent=2).encode())
    h = summary["history"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(range(1, len(summary["losses"]) + 1), summary["losses"], alpha=0.4,
                 label="train (per step)")
    per_epoch = summary.get("steps_per_epoch") or 1
    ax_loss.plot([e * per_epoch for e in h["epoch"]], h["test_loss"], "o-", label="held-out")
    ax_loss.set(xlabel="optimizer step", ylabel="softmax loss", title="loss")
    # markers: a history of one epoch (a parameter server's, a short run) is still visible
    ax_acc.plot(h["epoch"], h["train_acc"], "o-", label="train")
    ax_acc.plot(h["epoch"], h["test_acc"], "o-", label="held-out")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    from matplotlib.ticker import MaxNLocator

    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole epochs
    if h["epoch"]:  # half an epoch of margin: a single epoch gets a whole-number tick too
        ax_acc.set_xlim(min(h["epoch"]) - 0.5, max(h["epoch"]) + 0.5)
    for ax in (ax_loss, ax_acc):
        ax.legend()
        ax.grid(alpha=0.3)
    cfg = summary["config"]
    fig.suptitle(f"{cfg['model']} on {cfg['data']}, strategy {summary['strategy']} "
                 f"x {summary['world_size']} ({summary['device']})")
    fig.tight_layout()
    png_path = os.path.join(out_dir, "training.png")
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return json_path, png_path
