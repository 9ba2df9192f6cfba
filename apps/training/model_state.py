"""The trained model as one state dict: what is evaluated, saved (``model.ndl``) and hashed.

Every strategy hands the loop the whole model's state under the single-process names
(``Module.state_dict()`` of the model ``--model`` builds), parameters and buffers alike, on
the reporting rank. ``summary.json`` hashes its parameters (``params_sha256``, in
``parameters()`` order, as before) and its buffers (``buffers_sha256``, by name), and
``model.ndl`` beside it loads into a freshly built model in any single process
(:func:`load_model`), so a summary's accuracy can be re-checked against the file.
"""
from __future__ import annotations

import numpy as np

MODEL_FILE = "model.ndl"


def named_state(model, params: list) -> dict[str, np.ndarray]:
    """``model``'s state dict with its parameters taken from ``params`` (full values in
    ``model.parameters()`` order: gathered shards) and its buffers from the model itself."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return {name: np.asarray(params[index[id(t)]]) if id(t) in index else t.numpy()
            for name, t in model.named_tensors()}


def split_state(model, state: dict) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """``state`` as (parameters in ``model.parameters()`` order, buffers by name)."""
    names = dict(model.named_parameters())
    order = {id(p): i for i, p in enumerate(model.parameters())}
    by_index = sorted((order[id(t)], name) for name, t in names.items())
    params = [state[name] for _, name in by_index]
    buffers = {name: state[name] for name, _ in model.named_buffers()}
    return params, buffers


def save_model(state: dict, path: str) -> None:
    """Write ``state`` with ``needle.save`` (no pickle)."""
    import needle as ndl

    ndl.save({name: np.ascontiguousarray(v) for name, v in state.items()}, path)


def load_model(cfg, path: str, in_features: int, classes: int, device=None):
    """A fresh single-process model of ``cfg`` holding the state saved at ``path``."""
    import needle as ndl

    from .models import build_model, device_by_name

    device = device or device_by_name(cfg.device)
    model = build_model(cfg.model, in_features, classes, cfg.hidden, device)
    state = ndl.load(path)
    want = dict(model.named_tensors())
    # a mixed-precision run saves float16 parameters: build the model in the saved dtypes
    for name, t in want.items():
        saved = np.asarray(state[name]) if name in state else None
        if saved is not None and str(saved.dtype) != str(t.dtype):
            from needle import amp

            amp.cast_parameters(model, str(saved.dtype))
            break
    model.load_state_dict({name: np.asarray(v) for name, v in state.items()})
    return model
