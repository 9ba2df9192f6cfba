"""A directory of checkpoints: one file per rank, the manifest last, the newest K kept.

Layout::

    D/step-00000040/rank-00000.ndl     each rank's state (ndl.save format, atomic write)
    D/step-00000040/rank-00001.ndl
    D/step-00000040/manifest.json      written last, by rank 0, after every shard is on disk
    D/run.json                         the run these checkpoints belong to (its ``run_id``)

A checkpoint is *complete* when its manifest exists, is well formed (every rank's shard named
``rank-RRRRR.ndl`` inside the checkpoint, the step its directory says) and every shard it
lists is a regular file with the SHA-256 the manifest records. A process killed in the
middle of a save leaves at worst an incomplete directory, which :func:`latest_checkpoint`
skips, so the previous complete checkpoint is what a resume finds.
:func:`latest_checkpoint_report` also says why each newer checkpoint was skipped ("no
manifest", "shard rank1 missing: rank-00001.ndl", "sha256 mismatch in ...").

Every manifest carries the ``run_id`` of ``D/run.json`` (created by the first save). Reading a
checkpoint whose run differs from its directory's (a step directory copied in from another
run) is refused unless the caller passes ``adopt_run=True``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
import warnings
from typing import Any, Callable

from .._core.errors import SerializationError
from ..serialization import atomic_write_bytes, load, save

MANIFEST = "manifest.json"
RUN_FILE = "run.json"
MANIFEST_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_MAX_JSON_BYTES = 16 << 20  # a manifest lists one line per rank
_FOREIGN = "from another run"


def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def _shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.ndl"


def _open_regular(path: str):
    """``path`` opened for reading; OSError unless it is a regular file (a FIFO would block,
    a device never end). O_NONBLOCK makes opening a FIFO return at once."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with _open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_json(path: str) -> Any:
    """A small JSON file; OSError or ValueError for anything else (too big, nested too deep)."""
    with _open_regular(path) as f:
        data = f.read(_MAX_JSON_BYTES + 1)
    if len(data) > _MAX_JSON_BYTES:
        raise ValueError(f"larger than {_MAX_JSON_BYTES} bytes")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def run_id_of(directory: str) -> str | None:
    """The ``run_id`` recorded in ``directory``'s ``run.json`` (None when it has none).

    Raises:
        SerializationError: a ``run.json`` that is unreadable or holds no run_id.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); _ = write_checkpoint(d, 1, {}, run_id="run-a")
        >>> run_id_of(d)
        'run-a'
    """
    path = os.path.join(directory, RUN_FILE)
    if not os.path.lexists(path):
        return None
    try:
        run = _read_json(path)
    except (OSError, ValueError) as exc:
        raise SerializationError(f"{path}: unreadable, expected {{\"run_id\": str}} ({exc})"
                                 ) from None
    if not isinstance(run, dict) or not isinstance(run.get("run_id"), str):
        raise SerializationError(f"{path}: expected {{\"run_id\": str}}, got {str(run)[:80]}")
    return run["run_id"]


def _check_arguments(step: Any, rank: Any, world_size: Any, keep: Any) -> None:
    def bad(name: str, value: Any, expected: str) -> SerializationError:
        return SerializationError(f"write_checkpoint: {name} must be {expected}, got {value!r}")

    for name, value in (("step", step), ("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(name, value, "an int")
    if step < 0:
        raise bad("step", step, ">= 0")
    if world_size < 1 or not 0 <= rank < world_size:
        raise bad("rank", (rank, world_size), "in [0, world_size) with world_size >= 1")
    # keep=0 would prune the checkpoint just written, leaving nothing to resume from
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise bad("keep", keep, "an int >= 1 (or None to keep every checkpoint)")


def write_checkpoint(directory: str, step: int, shard: Any, *, rank: int = 0,
                     world_size: int = 1, keep: int | None = 3,
                     barrier: Callable[[], None] | None = None,
                     meta: dict | None = None, run_id: str | None = None) -> str:
    """Write this rank's ``shard`` of checkpoint ``step``; rank 0 then writes the manifest.

    Every rank of the job must call it with the same ``step`` (``barrier`` synchronises
    them; it is required when ``world_size > 1``). The manifest records the directory's run
    (``run.json``, created with ``run_id`` or a random one by the first save). Returns the
    checkpoint's directory.

    Raises:
        SerializationError: ``step < 0``, ``keep < 1``, a rank outside the world, no barrier
            for several ranks, or a ``run_id`` other than the one ``directory`` belongs to.
    """
    _check_arguments(step, rank, world_size, keep)
    if world_size > 1 and barrier is None:
        raise SerializationError(
            f"write_checkpoint: {world_size} ranks need a barrier, expected barrier=callable, "
            f"got None")
    owner = run_id_of(directory)  # every rank checks, so every rank refuses alike
    if run_id is not None and owner is not None and owner != run_id:
        raise SerializationError(
            f"write_checkpoint: {directory} holds the checkpoints of run {owner}, expected run "
            f"{run_id}: write this run's checkpoints to another directory")
    path = _step_dir(directory, step)
    os.makedirs(path, exist_ok=True)
    if rank == 0 and os.path.exists(os.path.join(path, MANIFEST)):
        os.unlink(os.path.join(path, MANIFEST))  # rewriting a step: incomplete until done
    save(shard, os.path.join(path, _shard_name(rank)))
    if barrier is not None:
        barrier()  # every shard is on disk before the manifest says so
    if rank == 0:
        if owner is None:
            owner = run_id or secrets.token_hex(16)
            atomic_write_bytes(os.path.join(directory, RUN_FILE),
                               json.dumps({"run_id": owner}).encode())
        shards = {str(r): {"file": _shard_name(r),
                           "sha256": _sha256(os.path.join(path, _shard_name(r)))}
                  for r in range(world_size)}
        manifest = {"version": MANIFEST_VERSION, "step": int(step), "world_size": world_size,
                    "run_id": owner, "shards": shards, "written_at": time.time(),
                    "meta": meta or {}}
        atomic_write_bytes(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())
        if keep is not None:
            _prune(directory, keep, owner)
    if barrier is not None:
        barrier()  # nobody returns before the checkpoint is complete
    return path


def _read_manifest(path: str) -> dict | None:
    """The well-formed manifest of ``path``, else None."""
    try:
        manifest = _read_json(os.path.join(path, MANIFEST))
    except (OSError, ValueError):
        return None
    return manifest if _manifest_problem(path, manifest) is None else None


def _manifest_problem(path: str, manifest: Any) -> str | None:
    """What makes ``manifest`` unusable: its shape, its step, its ranks, a shard named
    anything but ``rank-RRRRR.ndl`` (which keeps every shard inside the checkpoint)."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), dict):
        return f"{MANIFEST} has no shards table"
    world_size, shards = manifest.get("world_size"), manifest["shards"]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return f"{MANIFEST} has world_size {world_size!r}, expected an int >= 1"
    named = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if named and manifest.get("step") != int(named.group(1)):
        return (f"{MANIFEST} is of step {manifest.get('step')!r}, expected {int(named.group(1))}"
                f" (its directory's)")
    if not isinstance(manifest.get("meta", {}), dict) or not isinstance(
            manifest.get("run_id", ""), str):
        return f"{MANIFEST} has a meta that is not an object or a run_id that is not a string"
    # a manifest that lists fewer ranks than it says ran would fail one rank's load only:
    # refusing it here keeps every rank choosing the same checkpoint
    if set(shards) != {str(r) for r in range(world_size)}:
        return (f"{MANIFEST} lists shards of ranks {sorted(shards, key=_rank_order)}"
                f", expected ranks 0..{world_size - 1} (world_size {world_size})")
    for rank, info in sorted(shards.items(), key=lambda item: _rank_order(item[0])):
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
            return f"{MANIFEST} entry of rank{rank} lacks file or sha256"
        if info.get("file") != _shard_name(int(rank)):
            return (f"{MANIFEST} entry of rank{rank} names file {info.get('file')!r}, expected "
                    f"{_shard_name(int(rank))} inside the checkpoint")
    return None


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


def incomplete_reason(path: str, run_id: str | None = None) -> str | None:
    """Why the checkpoint directory ``path`` is not complete, or None when it is.

    The first problem found, in the order a loader meets them: the manifest (missing,
    unreadable or malformed, see the module's docstring), its run (when ``run_id`` is given:
    "from another run ..."), then each shard by rank (missing, not a regular file inside the
    checkpoint, or a SHA-256 other than the manifest's).

    Example:
        >>> import os, tempfile
        >>> path = write_checkpoint(tempfile.mkdtemp(), 3, {"w": 1})
        >>> incomplete_reason(path) is None
        True
        >>> os.unlink(os.path.join(path, "rank-00000.ndl")); incomplete_reason(path)
        'shard rank0 missing: rank-00000.ndl'
    """
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.lexists(manifest_path):
        return "no manifest"
    try:
        manifest = _read_json(manifest_path)
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    problem = _manifest_problem(path, manifest)
    if problem is not None:
        return problem
    if run_id is not None and manifest.get("run_id") != run_id:
        return f"{_FOREIGN}: run_id {manifest.get('run_id')!r}, expected {run_id!r}"
    for rank, info in sorted(manifest["shards"].items(), key=lambda i: _rank_order(i[0])):
        reason = _shard_problem(path, rank, info)
        if reason is not None:
            return reason
    return None


def _shard_problem(path: str, rank: str, info: dict) -> str | None:
    shard = os.path.join(path, info["file"])
    if not os.path.lexists(shard):
        return f"shard rank{rank} missing: {info['file']}"
    if os.path.dirname(os.path.realpath(shard)) != os.path.realpath(path):
        return f"shard rank{rank} {info['file']} resolves outside the checkpoint"
    try:
        actual = _sha256(shard)
    except OSError as exc:
        return f"shard rank{rank} unreadable: {exc}"
    if actual != info["sha256"]:
        return f"sha256 mismatch in {info['file']}: expected {info['sha256']}, got {actual}"
    return None


def _is_complete(path: str, run_id: str | None = None) -> bool:
    return incomplete_reason(path, run_id) is None


def latest_checkpoint_report(directory: str, run_id: str | None = None
                             ) -> tuple[str | None, list[tuple[str, str]]]:
    """``(newest complete checkpoint or None, [(path, reason), ...])`` under ``directory``.

    The list names every checkpoint newer than the one chosen (all of them when none is
    complete), newest first, each with the reason it was skipped; with ``run_id``, one of
    another run is skipped too ("from another run ..."). The choice depends on the files
    only, so every rank that reads the same directory chooses the same checkpoint.

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
        reason = incomplete_reason(path, run_id)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint directory under ``directory`` (None if there is none)."""
    return latest_checkpoint_report(directory)[0]


def _prune(directory: str, keep: int, run_id: str) -> None:
    # only this run's checkpoints count and go: another run's are not this run's to delete
    entries = [(step, path, _is_complete(path, run_id)) for step, path in _step_dirs(directory)]
    complete = [path for _, path, ok in entries if ok]
    newest = complete[-1] if complete else None
    doomed = set(complete[:-keep])
    # leftovers without a manifest older than the newest complete one are dead ends of a crash
    if newest is not None:
        doomed |= {path for step, path, ok in entries if not ok and step < int(
            os.path.basename(newest)[5:]) and not os.path.lexists(os.path.join(path, MANIFEST))}
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def resolve_checkpoint(path_or_directory: str, caller: str = "resolve_checkpoint", *,
                       run_id: str | None = None, adopt_run: bool = False
                       ) -> tuple[str, list[tuple[str, str]]]:
    """``(checkpoint directory, [(skipped path, reason), ...])`` that a read of
    ``path_or_directory`` uses: the directory itself when it holds a manifest (nothing
    skipped), else the newest complete checkpoint under it (see
    :func:`latest_checkpoint_report`).

    The checkpoint must belong to the run of its directory's ``run.json`` (and to ``run_id``
    when given); ``adopt_run=True`` takes one of another run all the same.

    Raises:
        SerializationError: no complete checkpoint (the message names every step directory
            skipped and why; ``caller`` prefixes it), or one of another run without
            ``adopt_run``.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); path = write_checkpoint(d, 8, {"w": 1})
        >>> resolve_checkpoint(d) == (path, [])
        True
    """
    named = _read_manifest(path_or_directory) is not None or bool(
        _STEP_DIR.match(os.path.basename(os.path.normpath(path_or_directory))))
    home = os.path.dirname(os.path.normpath(path_or_directory)) if named else path_or_directory
    expected = _expected_run(caller, home, run_id, adopt_run)
    if _read_manifest(path_or_directory) is not None:
        _check_run(caller, path_or_directory, expected, adopt_run)
        return path_or_directory, []
    if named:
        # a step directory named on purpose: say what is wrong with it, not with its contents
        latest, skipped = None, [(path_or_directory, incomplete_reason(path_or_directory))]
    else:
        latest, skipped = latest_checkpoint_report(path_or_directory,
                                                   None if adopt_run else expected)
    foreign = [(p, why) for p, why in skipped if why.startswith(_FOREIGN)]
    if foreign:
        raise SerializationError(
            f"{caller}: {path_or_directory} holds checkpoints of run {expected}, got "
            + "; ".join(f"{p} ({why})" for p, why in foreign) + _ADOPT_HINT)
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


_ADOPT_HINT = (" (a step directory copied from another run?); pass adopt_run=True "
               "(apps/train.py: --adopt-run) to resume from it all the same")


def _expected_run(caller: str, home: str, run_id: str | None, adopt_run: bool) -> str | None:
    """The run a checkpoint under ``home`` must belong to: ``run_id``, else home's own."""
    owner = run_id_of(home) if os.path.isdir(home) else None
    if run_id is not None and owner is not None and owner != run_id and not adopt_run:
        raise SerializationError(f"{caller}: {home} holds the checkpoints of run {owner}, "
                                 f"expected run {run_id}" + _ADOPT_HINT)
    return run_id if run_id is not None else owner


def _check_run(caller: str, path: str, expected: str | None, adopt_run: bool) -> None:
    got = (_read_manifest(path) or {}).get("run_id")
    if expected is not None and got != expected and not adopt_run:
        raise SerializationError(f"{caller}: {path} is a checkpoint of run {got!r}, expected "
                                 f"run {expected!r}" + _ADOPT_HINT)


def _resolve(path_or_directory: str, caller: str, run_id: str | None,
             adopt_run: bool) -> str:
    path, skipped = resolve_checkpoint(path_or_directory, caller, run_id=run_id,
                                       adopt_run=adopt_run)
    for skipped_path, reason in skipped:  # never silently: a newer checkpoint was not used
        warnings.warn(f"{caller}: skipped {skipped_path}: {reason}; using {path}",
                      stacklevel=3)
    return path


def read_manifest(path_or_directory: str, *, run_id: str | None = None,
                  adopt_run: bool = False) -> dict:
    """The manifest of a checkpoint directory (or of the newest complete one under a parent
    directory), without reading any shard: what a loader needs to decide which shards to
    read (the saved world size, ``meta``). ``run_id``, ``adopt_run``: see
    :func:`resolve_checkpoint`; a newer checkpoint skipped is reported as a warning.

    Raises:
        SerializationError: no complete checkpoint (see :func:`resolve_checkpoint`).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); _ = write_checkpoint(d, 8, {"w": 1}, meta={"k": 1})
        >>> m = read_manifest(d); m["step"], m["world_size"], m["meta"]
        (8, 1, {'k': 1})
    """
    manifest = _read_manifest(_resolve(path_or_directory, "read_manifest", run_id, adopt_run))
    assert manifest is not None  # resolve_checkpoint returns checkpoints with one
    return manifest


def read_all_shards(path_or_directory: str, device=None, *, run_id: str | None = None,
                    adopt_run: bool = False) -> tuple[dict, list]:
    """``(manifest, [shard of rank 0, shard of rank 1, ...])`` of a checkpoint directory (or
    of the newest complete one under a parent directory): what a run needs to load a state
    that was sharded over another number of ranks.

    Raises:
        SerializationError: as :func:`read_checkpoint`, for any rank's shard.
    """
    path = _resolve(path_or_directory, "read_all_shards", run_id, adopt_run)
    manifest = read_manifest(path, adopt_run=True)  # the run was checked just above
    return manifest, [read_checkpoint(path, r, device=device, adopt_run=True)[1]
                      for r in range(int(manifest["world_size"]))]


def read_checkpoint(path_or_directory: str, rank: int = 0, device=None, *,
                    world_size: int | None = None, run_id: str | None = None,
                    adopt_run: bool = False) -> tuple[dict, Any]:
    """``(manifest, shard of rank)`` of a checkpoint directory, or of the newest complete
    one when given the parent directory. With ``world_size``, the checkpoint must have been
    saved by that many ranks (a run of fewer ranks would silently drop the others' shards:
    use :func:`read_all_shards` to reshard). ``run_id``, ``adopt_run``: see
    :func:`resolve_checkpoint`; a newer checkpoint skipped is reported as a warning.

    Raises:
        SerializationError: no complete checkpoint, one of another run, another world size,
            a shard missing for ``rank``, or a shard whose checksum differs from the
            manifest's.
    """
    path = _resolve(path_or_directory, "read_checkpoint", run_id, adopt_run)
    manifest = read_manifest(path, adopt_run=True)
    if world_size is not None and manifest["world_size"] != world_size:
        raise SerializationError(
            f"read_checkpoint: {path}: saved by {manifest['world_size']} ranks, expected "
            f"world_size {world_size}: loading it by rank would leave shards unread (use "
            f"read_all_shards to reshard)")
    info = manifest["shards"].get(str(rank))
    if info is None:
        raise SerializationError(
            f"read_checkpoint: {path}: no shard for rank {rank}, expected one of ranks "
            f"{sorted(int(r) for r in manifest['shards'])} (saved by {manifest['world_size']} "
            f"ranks)")
    shard_path = os.path.join(path, info["file"])
    reason = _shard_problem(path, str(rank), info)
    if reason is not None:
        raise SerializationError(f"read_checkpoint: {shard_path}: missing, unreadable or its "
                                 f"checksum differs from the manifest's ({reason})")
    return manifest, load(shard_path, device=device)
