"""Checkpoints that resume under another strategy: every saved layout to one *full* state.

A strategy saves its own layout (ddp: whole replicas; zero: each rank's pieces of every
parameter; tp / pipeline / 3d: each rank's chunks of the model, tensor-parallel layers cut
along their split axis). :func:`to_full` turns the shards of any of them into one canonical
state, the state a single process would hold for the same training:

* ``model``: the single-process model's ``Module.state_dict()`` (names of the model
  ``--model`` builds; parameters and buffers);
* ``optimizer``: the single-process optimizer's ``state_dict()`` over that model's
  ``parameters()`` order (moments, float32 master weights, step counter);
* ``scaler``: the loss scaler's state (None where the saving strategy has none).

:func:`load_full` gives each resuming strategy the part it owns. Random streams and the loop
cursor are per rank and are not part of the full state: a resuming rank takes them, with
its data-parallel buffers, from the saved rank it continues (``rank % saved ranks``).

What may differ between the saved run and the resumed one is the *layout* (:data:`LAYOUT`,
:data:`LAYOUT_EXTRA`): options that change where the numbers live, not which numbers are
computed. One exception: a model with BatchNorm normalises each step's batch piece by piece
(per data-parallel replica, per pipeline micro-batch), so for such a model the number of
pieces is part of the math and must match (:func:`batch_pieces`). The parameter server's
state (its servers' shards, worker clocks) is not converted.
"""
from __future__ import annotations

import numpy as np

from .config import UsageError

# Options that place the state without changing what a step computes.
LAYOUT = ("strategy", "nproc")
LAYOUT_EXTRA = ("zero_stage", "bucket_cap_mb", "schedule", "microbatches", "virtual_stages",
                "balance", "dp", "tp", "pp", "compile")
# Strategies whose checkpoints convert, as savers and as resumers.
CONVERTIBLE = ("single", "ddp", "zero", "tp", "pipeline", "3d")
_MESH = ("tp", "pipeline", "3d")


def without_layout(config: dict) -> dict:
    """A run's fingerprint (``checkpoints.fingerprint``) without its layout options."""
    out = {k: v for k, v in config.items() if k not in LAYOUT}
    out["extra"] = {k: v for k, v in (config.get("extra") or {}).items()
                    if k not in LAYOUT_EXTRA}
    return out


def mesh_shape(config: dict) -> tuple[int, int, int]:
    """``(dp, tp, pp)`` of a run's fingerprint (``(nproc, 1, 1)`` for data parallelism)."""
    name, n, extra = config["strategy"], int(config["nproc"]), config.get("extra") or {}
    if name == "tp":
        return 1, n, 1
    if name == "pipeline":
        return 1, 1, n
    if name == "3d":
        return int(extra.get("dp", 1)), int(extra.get("tp", 1)), int(extra.get("pp", 1))
    return n, 1, 1


def batch_pieces(config: dict) -> int:
    """Into how many pieces a step's batch is cut for the forward pass, each normalised by
    BatchNorm with its own statistics: data-parallel replicas times pipeline micro-batches
    (``--accumulate`` is compared as an option of its own)."""
    dp, _, pp = mesh_shape(config)
    micro = int((config.get("extra") or {}).get("microbatches", 4)) if pp > 1 else 1
    return dp * micro


def has_batchnorm(model) -> bool:
    """Whether ``model`` holds a BatchNorm layer (its forward depends on the batch's cut)."""
    from needle import nn

    return any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) for m in model._children())


def template_model(strategy):
    """A fresh single-process model of the run's ``--model`` (what the full state's names,
    shapes and layer order are taken from; built from ``--seed`` like every rank's, so any
    draw it makes is undone by the random streams a resume restores afterwards)."""
    return strategy.ctx.new_model()


def layout_words(config: dict) -> str:
    """``--strategy S --nproc N`` and the layout options that S reads, for messages."""
    extra = config.get("extra") or {}
    words = f"--strategy {config.get('strategy')} --nproc {config.get('nproc')}"
    dp, tp, pp = mesh_shape(config)
    if config.get("strategy") == "zero":
        words += f" --zero-stage {extra.get('zero_stage', 2)}"
    if config.get("strategy") == "3d":
        words += f" --dp {dp} --tp {tp} --pp {pp}"
    if pp > 1:
        words += f" --microbatches {extra.get('microbatches', 4)}"
    return words


# ---- saved shards -> full ------------------------------------------------------------------
def to_full(strategy_name: str, manifest: dict, shards: list, template,
            continued: int = 0) -> dict:
    """The full training state (see the module doc) in the strategy states ``shards`` (one
    per saved rank, in rank order) of a checkpoint saved by ``strategy_name``.

    ``template`` is a single-process model of the same ``--model`` (:func:`template_model`;
    only its names, shapes and layer structure are read); ``continued`` is the saved rank whose
    data-parallel buffers (BatchNorm statistics) and loss scaler the resuming rank takes.

    Raises:
        UsageError: a strategy whose state does not convert, or shards that do not match
            the model (the message names the tensor, the expected and the saved shape).
    """
    config = manifest.get("meta", {}).get("config", {})
    if strategy_name in ("single", "ddp"):
        mine = shards[continued]
        return {"model": dict(mine["model"]), "optimizer": mine["optimizer"],
                "scaler": mine.get("scaler")}
    if strategy_name == "zero":
        return _zero_to_full(shards, template, continued)
    if strategy_name in _MESH:
        return _mesh_to_full(config, shards, template)
    raise UsageError(f"--resume: a checkpoint of --strategy {strategy_name} cannot be "
                     f"converted to another strategy, expected one saved by "
                     f"{', '.join(CONVERTIBLE)}")


def _zero_to_full(shards: list, template, continued: int) -> dict:
    from needle.distributed.zero.state import assemble

    # the same assembly that ZeroDataParallel.load_state_dict reshards from
    weights, optimizer = assemble([s["zero"] for s in shards])
    named = template.named_parameters()
    if len(weights) != len(named):
        raise UsageError(f"--resume: the zero checkpoint holds {len(weights)} parameters, "
                         f"expected {len(named)} (the parameters of --model)")
    model = {}
    for (name, p), w in zip(named, weights, strict=True):
        _check_shape(name, tuple(p.shape), w.shape)
        model[name] = w
    mine = shards[continued]
    model.update(mine["buffers"])  # replicas keep their own BatchNorm statistics
    return {"model": model, "optimizer": optimizer, "scaler": mine.get("scaler")}


def _mesh_pieces(config: dict, template, role: str) -> tuple[int, int, int, list]:
    """``(dp, tp, pp, chunks)``: the model cut as the mesh strategy of ``config`` cuts it
    (``split_sequential`` with parameter costs, the same on every rank)."""
    from needle.distributed import pipeline

    dp, tp, pp = mesh_shape(config)
    extra = config.get("extra") or {}
    interleaved = pp > 1 and extra.get("schedule", "1f1b") == "interleaved"
    chunks = pp * (int(extra.get("virtual_stages", 2)) if interleaved else 1)
    if chunks == 1:
        return dp, tp, pp, [template]
    if extra.get("balance", "params") != "params":
        raise UsageError(f"--resume: {role} cut the model with --balance "
                         f"{extra.get('balance')!r} (timings), which cannot be cut the same "
                         f"way again; expected --balance params to convert the checkpoint")
    layers = list(template.modules)
    return dp, tp, pp, pipeline.split_sequential(template, chunks,
                                                 pipeline.parameter_costs(layers))


def _local_index(pieces: list, pp: int, k: int) -> int:
    """Where chunk ``k``'s first parameter sits in its rank's optimizer (the rank holds
    chunks ``s, s + pp, ...`` of stage ``s``, their parameters in that order)."""
    return sum(len(pieces[c].parameters()) for c in range(k % pp, k, pp))


def _mesh_to_full(config: dict, shards: list, template) -> dict:
    dp, tp, pp, pieces = _mesh_pieces(config, template, "the saved run")
    if len(shards) != dp * tp * pp:
        raise UsageError(f"--resume: the checkpoint has {len(shards)} shards, expected "
                         f"{dp * tp * pp} for the mesh dp={dp} tp={tp} pp={pp}")
    names = {id(t): n for n, t in template.named_tensors()}
    shapes = {n: tuple(t.shape) for n, t in template.named_tensors()}
    order = {id(p): i for i, p in enumerate(template.parameters())}
    model: dict = {}
    slots: dict = {}
    first = shards[0]["optimizer"]
    for k, piece in enumerate(pieces):
        s = k % pp
        # data-parallel replica 0 (rank (0, t, s) of the mesh): replicas hold equal
        # parameters and optimizer state, and replica 0's buffers are the model's
        states = [shards[t * pp + s] for t in range(tp)]
        chunk = [_chunk_state(st, k) for st in states]
        for name, tensor in piece.named_tensors():
            full = names[id(tensor)]
            model[full] = _join([_key(c, name, k) for c in chunk], shapes[full], full)
        at = _local_index(pieces, pp, k)
        for j, p in enumerate(piece.parameters()):
            i, full = order[id(p)], names[id(p)]
            for slot in first["state"]:
                parts = [_get(st["optimizer"]["state"].get(slot, {}), at + j) for st in states]
                if all(part is not None for part in parts):
                    slots.setdefault(slot, {})[i] = _join(parts, shapes[full],
                                                          f"{slot} of {full}")
    missing = sorted(set(shapes) - set(model))
    if missing:
        raise UsageError(f"--resume: the saved chunks lack {missing}, expected every tensor "
                         f"of --model")
    for slot in first["state"]:
        slots.setdefault(slot, {})
    return {"model": model, "optimizer": {"type": first["type"], "hyper": first["hyper"],
                                          "state": slots, "extra": first["extra"]},
            "scaler": None}


def _chunk_state(state: dict, k: int) -> dict:
    modules = state.get("modules", {})
    if str(k) not in modules:
        raise UsageError(f"--resume: a saved rank lacks model chunk {k}, expected chunks "
                         f"{sorted(modules, key=int)} to include it (the model was cut "
                         f"another way)")
    return modules[str(k)]


def _key(chunk: dict, name: str, k: int):
    if name not in chunk:
        raise UsageError(f"--resume: chunk {k} of the checkpoint lacks {name!r}, expected "
                         f"one of {sorted(chunk)[:8]}")
    return chunk[name]


def _get(table: dict, i: int):
    """``table[i]`` whether the saved keys are ints or their strings (None if absent)."""
    return table.get(i, table.get(str(i)))


def _check_shape(name: str, expected: tuple, got: tuple) -> None:
    if tuple(got) != tuple(expected):
        raise UsageError(f"--resume: {name} has shape {tuple(got)} in the checkpoint, "
                         f"expected {tuple(expected)}")


def _split_axis(local: tuple, full: tuple, name: str) -> int | None:
    """The axis along which a tensor-parallel shard of shape ``local`` cuts ``full`` (None:
    the tensor is whole on every rank)."""
    if local == full:
        return None
    differ = [a for a in range(len(full)) if len(local) == len(full) and local[a] != full[a]]
    if len(differ) != 1:
        raise UsageError(f"--resume: {name}: a shard of shape {local} is no slice of the "
                         f"full shape {full} along one axis")
    return differ[0]


def _join(parts: list, full: tuple, name: str) -> np.ndarray:
    """The whole tensor from its tensor-parallel ranks' slices, in rank order."""
    parts = [np.asarray(p) for p in parts]
    axis = _split_axis(tuple(parts[0].shape), full, name)
    out = parts[0] if axis is None else np.concatenate(parts, axis=axis)
    _check_shape(name, full, out.shape)
    return out


def _slice(value, local: tuple, rank: int, name: str) -> np.ndarray:
    """Tensor-parallel rank ``rank``'s slice of shape ``local`` of the whole ``value``."""
    value = np.asarray(value)
    axis = _split_axis(local, tuple(value.shape), name)
    if axis is None:
        return value
    width = local[axis]
    index = [slice(None)] * value.ndim
    index[axis] = slice(rank * width, (rank + 1) * width)
    return value[tuple(index)]


# ---- full -> the resuming strategy --------------------------------------------------------
def load_full(strategy, full: dict) -> None:
    """Give ``strategy`` (set up, on this rank) its part of the ``full`` state: single and
    ddp load it whole, zero reshards it as a one-rank checkpoint, the mesh strategies slice
    their chunks and tensor-parallel shards out of it."""
    from .strategies._mesh import MeshStrategy
    from .strategies.zero import Zero

    if isinstance(strategy, Zero):
        _load_zero(strategy, full)
    elif isinstance(strategy, MeshStrategy):
        _load_mesh(strategy, full)
    elif strategy.name in CONVERTIBLE:
        state = {"model": full["model"], "optimizer": full["optimizer"]}
        if full.get("scaler") is not None:
            state["scaler"] = full["scaler"]
        strategy.load_state_dict(state)
    else:
        raise UsageError(f"--resume: --strategy {strategy.name} cannot resume a checkpoint of "
                         f"another strategy, expected one of {', '.join(CONVERTIBLE)}")


def _load_zero(strategy, full: dict) -> None:
    from needle.distributed.zero.state import FORMAT, VERSION

    params = strategy.model.parameters()
    names = dict((id(p), n) for n, p in strategy.model.named_parameters())
    optimizer = full["optimizer"]
    pieces = {}
    for i, p in enumerate(params):
        weight = np.asarray(full["model"][names[id(p)]])
        _check_shape(names[id(p)], tuple(p.shape), weight.shape)
        state = {slot: np.asarray(_get(values, i)).reshape(-1)
                 for slot, values in optimizer["state"].items()
                 if _get(values, i) is not None}
        pieces[str(i)] = {"lo": 0, "hi": weight.size, "shape": list(weight.shape),
                          "dtype": str(p.dtype), "weight": weight.reshape(-1), "state": state}
    # what a one-rank zero run would have saved: the resharding path cuts this rank's pieces
    one = {"format": FORMAT, "version": VERSION, "stage": strategy.stage, "rank": 0,
           "world_size": 1, "pieces": pieces,
           "optimizer": {k: optimizer[k] for k in ("type", "hyper", "extra")}}
    strategy.zero.load_state_dict([one])
    buffers = {n: v for n, v in full["model"].items() if n not in set(names.values())}
    strategy.model.load_state_dict(buffers, strict=False)
    if full.get("scaler") is not None:
        strategy.scaler.load_state_dict(full["scaler"])


def _load_mesh(strategy, full: dict) -> None:
    template = template_model(strategy)
    config = {"strategy": strategy.name, "nproc": strategy.world_size,
              "extra": strategy.cfg.extra}
    _, _, _, pieces = _mesh_pieces(config, template, "this run")
    if [len(p.modules) for p in pieces] != list(strategy.layers_per_stage):
        raise UsageError(f"--resume: the model's cut differs, expected layers per chunk "
                         f"{strategy.layers_per_stage}, got {[len(p.modules) for p in pieces]}")
    names = {id(t): n for n, t in template.named_tensors()}
    order = {id(p): i for i, p in enumerate(template.parameters())}
    t_rank = strategy.mesh.local_rank("tp")
    optimizer = full["optimizer"]
    slots: dict = {slot: {} for slot in optimizer["state"]}
    at = 0
    for k in strategy.my_chunks:
        # the chunk keeps its unsharded piece's layer tree (parallelize_sequential), so a
        # tensor's name in the chunk is its name in the piece, cut the same way here
        piece, module = pieces[k], strategy.modules[k]
        by_name = {n: names[id(t)] for n, t in piece.named_tensors()}
        state = {}
        for name, t in module.named_tensors():
            if name not in by_name:
                raise UsageError(f"--resume: chunk {k} holds {name!r}, which the "
                                 f"single-process model does not name")
            state[name] = _slice(full["model"][by_name[name]], tuple(t.shape), t_rank, name)
        module.load_state_dict(state)
        for p, local in zip(piece.parameters(), module.parameters(), strict=True):
            i = order[id(p)]
            for slot, values in optimizer["state"].items():
                value = _get(values, i)
                if value is not None:
                    slots[slot][at] = _slice(value, tuple(local.shape), t_rank,
                                             f"{slot} of {names[id(p)]}")
            at += 1
    strategy.optimizer.load_state_dict({**optimizer, "state": slots})
