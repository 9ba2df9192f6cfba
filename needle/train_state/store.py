"""A directory of checkpoints: one file per rank, the manifest last, the newest K kept.

Layout::

    D/step-00000040/rank-00000.ndl     each rank's state (ndl.save format, atomic write)
    D/step-00000040/rank-00001.ndl
    D/step-00000040/manifest.json      written last, by rank 0, after every shard is on disk

A checkpoint is *complete* when its manifest exists and every shard it lists has the SHA-256
the manifest records. A process killed in the middle of a save leaves at worst an incomplete
directory, which :func:`latest_checkpoint` skips, so the previous complete checkpoint is
what a resume finds. :func:`latest_checkpoint_report` also says why each newer checkpoint was
skipped ("no manifest", "shard rank1 missing: rank-00001.ndl", "sha256 mismatch in ...").
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


def _step_dirs(directory: str) -> list[tuple[int, str]]:
    """Every ``(step, path)`` of a step-NNNNNNNN directory under ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _STEP_DIR.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found)


def list_checkpoints(directory: str) -> list[tuple[int, str, bool]]:
    """Every ``(step, path, complete)`` under ``directory``, oldest first."""
    return [(step, path, _is_complete(path)) for step, path in _step_dirs(directory)]


def _rank_order(rank: str) -> tuple[int, str]:
    return len(rank), rank  # "2" before "10" without trusting the keys to be numbers


def incomplete_reason(path: str) -> str | None:
    """Why the checkpoint directory ``path`` is not complete, or None when it is.

    The first problem found, in the order a loader meets them: the manifest (missing,
    unreadable, without a shard table or not listing every rank), then each shard by rank
    (missing, or a SHA-256 other than the manifest's).

    Example:
        >>> import os, tempfile
        >>> path = write_checkpoint(tempfile.mkdtemp(), 3, {"w": 1})
        >>> incomplete_reason(path) is None
        True
        >>> os.unlink(os.path.join(path, "rank-00000.ndl")); incomplete_reason(path)
        'shard rank0 missing: rank-00000.ndl'
    """
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        return "no manifest"
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), dict):
        return f"{MANIFEST} has no shards table"
    shards = manifest["shards"]
    world_size = manifest.get("world_size")
    # a manifest that lists fewer ranks than it says ran would fail one rank's load only:
    # refusing it here keeps every rank choosing the same checkpoint
    if isinstance(world_size, int) and set(shards) != {str(r) for r in range(world_size)}:
        return (f"{MANIFEST} lists shards of ranks {sorted(shards, key=_rank_order)}"
                f", expected ranks 0..{world_size - 1} (world_size {world_size})")
    for rank, info in sorted(shards.items(), key=lambda item: _rank_order(item[0])):
        if not isinstance(info, dict) or "file" not in info or "sha256" not in info:
            return f"{MANIFEST} entry of rank{rank} lacks file or sha256"
        shard = os.path.join(path, info["file"])
        if not os.path.exists(shard):
            return f"shard rank{rank} missing: {info['file']}"
        actual = _sha256(shard)
        if actual != info["sha256"]:
            return f"sha256 mismatch in {info['file']}: expected {info['sha256']}, got {actual}"
    return None


def _is_complete(path: str) -> bool:
    return incomplete_reason(path) is None


def latest_checkpoint_report(directory: str) -> tuple[str | None, list[tuple[str, str]]]:
    """``(newest complete checkpoint or None, [(path, reason), ...])`` under ``directory``.

    The list names every checkpoint newer than the one chosen (all of them when none is
    complete), newest first, each with the reason it was skipped. The choice depends on the
    files only, so every rank that reads the same directory chooses the same checkpoint.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> for step in (2, 4, 6):
        ...     _ = write_checkpoint(d, step, {"step": step})
        >>> os.unlink(os.path.join(d, "step-00000006", "manifest.json"))
        >>> path, skipped = latest_checkpoint_report(d)
        >>> os.path.basename(path), [(os.path.basename(p), why) for p, why in skipped]
        ('step-00000004', [('step-00000006', 'no manifest')])
    """
    skipped = []
    for _, path in reversed(_step_dirs(directory)):  # newest first: stop at the first good one
        reason = incomplete_reason(path)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint directory under ``directory`` (None if there is none)."""
    return latest_checkpoint_report(directory)[0]


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


def resolve_checkpoint(path_or_directory: str, caller: str = "resolve_checkpoint"
                       ) -> tuple[str, list[tuple[str, str]]]:
    """``(checkpoint directory, [(skipped path, reason), ...])`` that a read of
    ``path_or_directory`` uses: the directory itself when it holds a manifest (nothing
    skipped), else the newest complete checkpoint under it (see
    :func:`latest_checkpoint_report`).

    Raises:
        SerializationError: no complete checkpoint; the message names every step directory
            skipped and why (``caller`` prefixes it).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); path = write_checkpoint(d, 8, {"w": 1})
        >>> resolve_checkpoint(d) == (path, [])
        True
    """
    if _read_manifest(path_or_directory) is not None:
        return path_or_directory, []
    if _STEP_DIR.match(os.path.basename(os.path.normpath(path_or_directory))):
        # a step directory named on purpose: say what is wrong with it, not with its contents
        latest, skipped = None, [(path_or_directory, incomplete_reason(path_or_directory))]
    else:
        latest, skipped = latest_checkpoint_report(path_or_directory)
    if latest is not None:
        return latest, skipped
    if skipped:
        found = f"skipped {len(skipped)}: " + "; ".join(f"{p} ({why})" for p, why in skipped)
    elif os.path.isdir(path_or_directory):
        found = "found no step-NNNNNNNN directory"
    else:
        found = "no such directory"
    raise SerializationError(
        f"{caller}: {path_or_directory}: no complete checkpoint, expected a "
        f"step-NNNNNNNN directory with {MANIFEST} and every shard it lists; {found}")


def _resolve(path_or_directory: str, caller: str) -> str:
    return resolve_checkpoint(path_or_directory, caller)[0]


def read_manifest(path_or_directory: str) -> dict:
    """The manifest of a checkpoint directory (or of the newest complete one under a parent
    directory), without reading any shard: what a loader needs to decide which shards to
    read (the saved world size, ``meta``).

    Raises:
        SerializationError: no complete checkpoint (see :func:`resolve_checkpoint`).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); _ = write_checkpoint(d, 8, {"w": 1}, meta={"k": 1})
        >>> m = read_manifest(d); m["step"], m["world_size"], m["meta"]
        (8, 1, {'k': 1})
    """
    return _read_manifest(_resolve(path_or_directory, "read_manifest"))


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
