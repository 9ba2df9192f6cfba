"""Weights in PyTorch's layout and names, to and from a needle model.

needle keeps the course framework's layouts: ``Linear.weight`` is (in, out) and its bias
(1, out); ``Conv.weight`` is (K, K, Cin, Cout). PyTorch stores (out, in), (out,) and
(Cout, Cin, K, K). :func:`torch_state_dict` gives a needle model's weights as PyTorch would
name and lay them out, and :func:`load_torch_state_dict` loads a PyTorch state dict (for
instance one read from a ``.safetensors`` file) into a needle model of the same structure.

Names: a needle name is PyTorch's once the ``modules.`` segments that needle's
``Sequential`` adds are dropped (needle ``modules.0.weight`` is PyTorch ``0.weight``); other
attribute names must match as they are. Tensors of other modules are copied unchanged.
PyTorch's ``num_batches_tracked`` counters (BatchNorm) have no needle counterpart and are
skipped.

Example:
    >>> import numpy as np
    >>> from needle import nn
    >>> np.random.seed(0); model = nn.Sequential(nn.Linear(3, 2))
    >>> {k: v.shape for k, v in nn.torch_state_dict(model).items()}
    {'0.weight': (2, 3), '0.bias': (2,)}
"""
from __future__ import annotations

import numpy as np

from .._core.errors import ShapeError
from .nn_basic import Linear
from .nn_conv import Conv
from .nn_module import Module

__all__ = ["torch_state_dict", "load_torch_state_dict"]

_SKIPPED = ("num_batches_tracked",)


def _torch_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != "modules")


def _owner(model: Module, name: str):
    """The object holding the tensor called ``name`` (a dotted path of attributes and
    list/dict entries)."""
    obj = model
    for part in name.split(".")[:-1]:
        obj = obj[int(part)] if isinstance(obj, (list, tuple)) else \
            obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def _to_torch(owner, attr: str, array: np.ndarray) -> np.ndarray:
    if isinstance(owner, Linear):
        return array.T if attr == "weight" else array.reshape(-1)
    if isinstance(owner, Conv) and attr == "weight":
        return array.transpose(3, 2, 0, 1)
    return array


def _from_torch(owner, attr: str, array: np.ndarray, shape: tuple) -> np.ndarray:
    if isinstance(owner, Linear) and attr == "weight" and array.ndim == 2:
        array = array.T
    elif isinstance(owner, Conv) and attr == "weight" and array.ndim == 4:
        array = array.transpose(2, 3, 1, 0)
    elif isinstance(owner, Linear) and attr == "bias" and array.size == int(np.prod(shape)):
        array = array.reshape(shape)  # PyTorch's (out,) for needle's (1, out)
    return np.ascontiguousarray(array)


def torch_state_dict(model: Module) -> dict:
    """``model``'s parameters and buffers as NumPy arrays, by PyTorch's names, in PyTorch's
    layouts (Linear and Conv weights transposed, Linear biases flat)."""
    return {_torch_name(name): np.ascontiguousarray(_to_torch(_owner(model, name),
                                                              name.rsplit(".", 1)[-1], array))
            for name, array in model.state_dict().items()}


def load_torch_state_dict(model: Module, state: dict, strict: bool = True) -> None:
    """Load a PyTorch-named, PyTorch-laid-out state dict (NumPy arrays, Tensors or
    ``torch.Tensor``s) into ``model`` through ``model.load_state_dict``.

    Raises:
        ShapeError: with ``strict``, names on one side only (each listed); shapes or dtypes
            that differ after the layout change (from ``Module.load_state_dict``).

    Example:
        >>> import numpy as np
        >>> from needle import nn
        >>> np.random.seed(0); a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        >>> nn.load_torch_state_dict(b, nn.torch_state_dict(a))
        >>> bool((a.weight.numpy() == b.weight.numpy()).all())
        True
    """
    ours = dict(model.named_tensors())
    by_torch = {_torch_name(name): name for name in ours}
    given = {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] not in _SKIPPED}
    unknown, missing = sorted(set(given) - set(by_torch)), sorted(set(by_torch) - set(given))
    if strict and (unknown or missing):
        raise ShapeError(f"load_torch_state_dict: names differ, expected {sorted(by_torch)}, "
                         f"got {unknown} unknown and {missing} missing")
    converted = {}
    for key, value in given.items():
        if key not in by_torch:
            continue
        name = by_torch[key]
        array = np.asarray(value.detach().numpy() if hasattr(value, "detach") else value)
        converted[name] = _from_torch(_owner(model, name), name.rsplit(".", 1)[-1], array,
                                      tuple(ours[name].shape))
    model.load_state_dict(converted, strict=strict)
