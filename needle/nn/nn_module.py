"""``Parameter`` and ``Module``: the tree of layers, its parameters, buffers and state.

Parameters are found by walking each module's ``__dict__`` (through modules, dicts, lists
and tuples) in insertion order, as the course does; attribute names are part of the
contract because tests read and overwrite them.

Example:
    >>> import numpy as np
    >>> from needle import nn
    >>> np.random.seed(0); m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    >>> [name for name, _ in m.named_parameters()]
    ['modules.0.weight', 'modules.0.bias', 'modules.1.weight', 'modules.1.bias']
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from .._core.errors import NeedleError, ShapeError
from ..autograd import Tensor
from ..memory import attribute as _attribute

__all__ = ["Parameter", "Module"]


class Parameter(Tensor):
    """A Tensor that a Module owns as a trainable parameter.

    Its buffer counts as ``weight`` memory in :mod:`needle.memory`, also after ``.data`` is
    assigned (optimisers re-attribute the arrays they install themselves).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _attribute(self, "weight")

    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, value):
        Tensor.data.fset(self, value)
        _attribute(self, "weight")


def _walk(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted name, object) for every Tensor and Module reachable from ``value``."""
    if isinstance(value, Tensor):
        yield prefix, value
    elif isinstance(value, Module):
        yield prefix, value
        for key, item in value.__dict__.items():
            yield from _walk(item, f"{prefix}.{key}" if prefix else key)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{prefix}.{i}" if prefix else str(i))


def _unpack_params(value: object) -> list[Tensor]:
    if isinstance(value, Parameter):
        return [value]
    if isinstance(value, Module):
        return value.parameters()
    if isinstance(value, dict):
        return [p for v in value.values() for p in _unpack_params(v)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _unpack_params(v)]
    return []


def _child_modules(value: object) -> list["Module"]:
    if isinstance(value, Module):
        return [value] + value._children()
    if isinstance(value, dict):
        return [m for v in value.values() for m in _child_modules(v)]
    if isinstance(value, (list, tuple)):
        return [m for v in value for m in _child_modules(v)]
    return []


class Module:
    """Base class of every layer: ``__call__`` runs ``forward``.

    ``parameters()`` lists Parameters in attribute order (the order optimisers see);
    ``state_dict()`` also holds buffers (plain Tensor attributes such as BatchNorm's running
    statistics) as NumPy copies keyed by dotted attribute path.
    """

    def __init__(self):
        self.training = True

    def parameters(self) -> list[Tensor]:
        """Every Parameter reachable from this module, in insertion order, once each."""
        seen: set[int] = set()
        out = []
        for p in _unpack_params(self.__dict__):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """``(dotted name, Parameter)`` pairs in the order of :meth:`parameters`."""
        seen: set[int] = set()
        out = []
        for name, obj in _walk(self, ""):
            if isinstance(obj, Parameter) and id(obj) not in seen:
                seen.add(id(obj))
                out.append((name, obj))
        return out

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        """Parameters and buffers (every Tensor attribute), each once, by dotted name."""
        seen: set[int] = set()
        out = []
        for name, obj in _walk(self, ""):
            if isinstance(obj, Tensor) and id(obj) not in seen:
                seen.add(id(obj))
                out.append((name, obj))
        return out

    def named_buffers(self) -> list[tuple[str, Tensor]]:
        """``(dotted name, Tensor)`` of every Tensor attribute that is not a Parameter (such as
        BatchNorm's running statistics), in the order of :meth:`named_tensors`.

        Example:
            >>> from needle import nn
            >>> [name for name, _ in nn.BatchNorm1d(3).named_buffers()]
            ['running_mean', 'running_var']
        """
        return [(name, t) for name, t in self.named_tensors() if not isinstance(t, Parameter)]

    def _children(self) -> list["Module"]:
        """Every sub-module, depth first, in attribute order."""
        return _child_modules(self.__dict__)

    def eval(self) -> "Module":
        self.training = False
        for m in self._children():
            m.training = False
        return self

    def train(self, mode: bool = True) -> "Module":
        self.training = mode
        for m in self._children():
            m.training = mode
        return self

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}.forward is not implemented")

    def state_dict(self) -> dict[str, np.ndarray]:
        """NumPy copies of every parameter and buffer, keyed by dotted attribute path.

        Example:
            >>> import numpy as np
            >>> from needle import nn
            >>> np.random.seed(0); sorted(nn.BatchNorm1d(3).state_dict())
            ['bias', 'running_mean', 'running_var', 'weight']
        """
        return {name: t.numpy() for name, t in self.named_tensors()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy values into the existing tensors (identity kept, so optimisers stay valid).

        Every name, shape and dtype is checked before anything is copied, and every mismatch
        is reported in one error. With ``strict=False`` missing and unexpected names are
        allowed (shape and dtype mismatches never are).

        Raises:
            NeedleError: listing missing and unexpected keys (with ``strict``) and every
                shape or dtype mismatch (a :class:`ShapeError` when only shapes differ).

        Example:
            >>> import numpy as np
            >>> from needle import nn
            >>> np.random.seed(0); a, b = nn.Linear(2, 3), nn.Linear(2, 3)
            >>> b.load_state_dict(a.state_dict())
            >>> bool((a.weight.numpy() == b.weight.numpy()).all())
            True
        """
        tensors = dict(self.named_tensors())
        problems, arrays, shapes_only = [], {}, True
        if strict:
            missing = sorted(set(tensors) - set(state))
            extra = sorted(set(state) - set(tensors))
            if missing:
                problems.append(f"missing keys {missing}")
            if extra:
                problems.append(f"unexpected keys {extra}")
            shapes_only = not problems
        for name, value in state.items():
            if name not in tensors:
                continue
            target = tensors[name]
            array = value.numpy() if isinstance(value, Tensor) else np.asarray(value)
            if tuple(array.shape) != tuple(target.shape):
                problems.append(f"{name!r} shape expected {tuple(target.shape)}, got "
                                f"{tuple(array.shape)}")
            elif str(array.dtype) != str(target.dtype):
                shapes_only = False
                problems.append(f"{name!r} dtype expected {target.dtype}, got {array.dtype}")
            arrays[name] = array
        if problems:
            error = ShapeError if shapes_only else NeedleError
            raise error(f"load_state_dict: {len(problems)} mismatch(es): " + "; ".join(problems))
        for name, array in arrays.items():
            target = tensors[name]
            target.data = Tensor(array, device=target.device, dtype=target.dtype,
                                 requires_grad=False)
