"""A directory of checkpoints: one file per rank, the manifest last, the newest K kept.

Layout::

    D/step-00000040/rank-00000.ndl     each rank's state (ndl.save format, atomic write)
    D/step-00000040/rank-00001.ndl
    D/step-00000040/manifest.json      written last, by rank 0, after every shard is on disk

A checkpoint is *complete* when its manifest exists and every shard it lists has the SHA-256
the manifest records. A process killed in the middle of a save leaves at worst an incomplete
directory, which :func:`latest_checkpoint` skips, so the previous complete checkpoint is
what a resume finds.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from typing import Any, Callable

from .._core.errors import SerializationError
from ..serialization import atomic_write_bytes, load, save

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def _shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.ndl"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checkpoint(directory: str, step: int, shard: Any, *, rank: int = 0,
                     world_size: int = 1, keep: int | None = 3,
                     barrier: Callable[[], None] | None = None,
                     meta: dict | None = None) -> str:
    """Write this rank's ``shard`` of checkpoint ``step``; rank 0 then writes the manifest.

    Every rank of the job must call it with the same ``step`` (``barrier`` synchronises
    them; it is required when ``world_size > 1``). Returns the checkpoint's directory.
    """
    if world_size > 1 and barrier is None:
        raise SerializationError(
            f"write_checkpoint: {world_size} ranks need a barrier, expected barrier=callable, "
            f"got None")
    path = _step_dir(directory, step)
    os.makedirs(path, exist_ok=True)
    if rank == 0 and os.path.exists(os.path.join(path, MANIFEST)):
        os.unlink(os.path.join(path, MANIFEST))  # rewriting a step: incomplete until done
    save(shard, os.path.join(path, _shard_name(rank)))
    if barrier is not None:
        barrier()  # every shard is on disk before the manifest says so
    if rank == 0:
        shards = {str(r): {"file": _shard_name(r),
                           "sha256": _sha256(os.path.join(path, _shard_name(r)))}
                  for r in range(world_size)}
        manifest = {"version": MANIFEST_VERSION, "step": int(step), "world_size": world_size,
                    "shards": shards, "written_at": time.time(), "meta": meta or {}}
        atomic_write_bytes(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())
        if keep is not None:
            _prune(directory, keep)
    if barrier is not None:
        barrier()  # nobody returns before the checkpoint is complete
    return path


def _read_manifest(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "shards" in manifest else None


def list_checkpoints(directory: str) -> list[tuple[int, str, bool]]:
    """Every ``(step, path, complete)`` under ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _STEP_DIR.match(name)
        if match:
            path = os.path.join(directory, name)
            found.append((int(match.group(1)), path, _is_complete(path)))
    return sorted(found)


def _is_complete(path: str) -> bool:
    manifest = _read_manifest(path)
    if manifest is None:
        return False
    for info in manifest["shards"].values():
        shard = os.path.join(path, info["file"])
        if not os.path.exists(shard) or _sha256(shard) != info["sha256"]:
            return False
    return True


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint directory under ``directory`` (None if there is none)."""
    complete = [path for _, path, ok in list_checkpoints(directory) if ok]
    return complete[-1] if complete else None


def _prune(directory: str, keep: int) -> None:
    entries = list_checkpoints(directory)
    complete = [path for _, path, ok in entries if ok]
    newest = complete[-1] if complete else None
    doomed = set(complete[:-keep] if keep > 0 else complete)
    # incomplete leftovers older than the newest complete one are dead ends of a crash
    if newest is not None:
        doomed |= {path for step, path, ok in entries
                   if not ok and step < int(os.path.basename(newest)[5:])}
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def _resolve(path_or_directory: str, caller: str) -> str:
    if _read_manifest(path_or_directory) is not None:
        return path_or_directory
    latest = latest_checkpoint(path_or_directory)
    if latest is None:
        raise SerializationError(
            f"{caller}: {path_or_directory}: no complete checkpoint, expected a "
            f"step-NNNNNNNN directory with {MANIFEST} and every shard it lists")
    return latest


def read_all_shards(path_or_directory: str, device=None) -> tuple[dict, list]:
    """``(manifest, [shard of rank 0, shard of rank 1, ...])`` of a checkpoint directory (or
    of the newest complete one under a parent directory): what a run needs to load a state
    that was sharded over another number of ranks.

    Raises:
        SerializationError: as :func:`read_checkpoint`, for any rank's shard.
    """
    path = _resolve(path_or_directory, "read_all_shards")
    manifest = _read_manifest(path)
    return manifest, [read_checkpoint(path, r, device=device)[1]
                      for r in range(int(manifest["world_size"]))]


def read_checkpoint(path_or_directory: str, rank: int = 0, device=None) -> tuple[dict, Any]:
    """``(manifest, shard of rank)`` of a checkpoint directory, or of the newest complete
    one when given the parent directory.

    Raises:
        SerializationError: no complete checkpoint, a shard missing for ``rank``, or a shard
            whose checksum differs from the manifest's.
    """
    path = _resolve(path_or_directory, "read_checkpoint")
    manifest = _read_manifest(path)
    info = manifest["shards"].get(str(rank))
    if info is None:
        raise SerializationError(
            f"read_checkpoint: {path}: no shard for rank {rank}, expected one of ranks "
            f"{sorted(int(r) for r in manifest['shards'])} (saved by {manifest['world_size']} "
            f"ranks)")
    shard_path = os.path.join(path, info["file"])
    if not os.path.exists(shard_path) or _sha256(shard_path) != info["sha256"]:
        raise SerializationError(
            f"read_checkpoint: {shard_path}: missing or its checksum differs from the "
            f"manifest's {info['sha256']}")
    return manifest, load(shard_path, device=device)
