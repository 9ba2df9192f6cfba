"""Optimisers: SGD with momentum, Adam, global gradient-norm clipping.

Updates run on the parameters' raw arrays (never on the graph, never on ``p.grad`` in place)
and keep each parameter's dtype: the scalars involved are Python floats, which NumPy and
NDArray treat as weak.

Mixed precision. For a ``float16`` parameter the optimizer keeps a ``float32`` *master* copy
(made at its first step, measured as ``master`` memory): the update runs on the master in
float32 (gradient cast up, moments in float32) and the parameter receives the master rounded
to float16. The master is rebuilt from the parameter only when the parameter's data was
replaced by someone else (``p.data = ...``, ``Module.load_state_dict``); code that moves a
parameter to other storage holding the same values says so with :meth:`Optimizer.rebind`.
While ``grad_scale`` is set (``amp.GradScaler.step`` sets it), gradients are divided by it
as they are read, in the update's precision, so scaled float16 gradients are unscaled in
float32 without ever being rewritten.

Fused updates. Where the backend has ``ewise_program`` (``cpu()``, ``cpu_numpy()``) and the
arrays are compact float32/float64, each parameter's update is one pass over memory (Adam:
two) that writes only θ and the moments: no temporaries, and bitwise the values of the
composed arithmetic, which runs everywhere else (float16 arrays, masters, scaled gradients)
and inside a compiled step (whose compiler fuses the recorded kernels itself). Without
masters or a gradient scale the fused update runs in place, as PyTorch's optimizers do: θ
and the moments are rewritten in their own buffers (a write every alias of the buffer sees,
and which a graph that saved θ refuses afterwards), Adam's in one pass too, and the updates
of all parameters go to the backend together (``ewise_program.Batch``: one call on
``cpu()``); the other paths install new arrays.

Memory (needle.memory categories): a step's temporaries are ``optimizer_temp``, moments
``optimizer``, new weights ``weight`` from their allocation. At most this many arrays of one
parameter's size are temporaries at once (the ledger's prediction, checked by its tests):
none for a fused update; composed, SGD 1, SGD with momentum 3 (1 on the first step), Adam 3,
one more with weight decay.

Example:
    >>> import numpy as np
    >>> import needle as ndl
    >>> from needle import nn, optim
    >>> p = nn.Parameter(ndl.Tensor(np.array([1.0, 2.0], dtype="float32")))
    >>> (p * p).sum().backward()
    >>> optim.SGD([p], lr=0.5).step(); p.numpy().tolist()
    [0.0, 0.0]
"""
from __future__ import annotations

import functools
import math
import sys

import numpy as np

from . import lr_scheduler
from ._core.errors import OptimizerError, SerializationError, ShapeError
from ._core.versions import BUFFER_LOGS
from ._core.versions import note_write as _note_write
from .autograd import Tensor
from .autograd.grad_mode import compiling, replayed
from .autograd.tensor import replace_data
from .autograd.versions import note_replaced
from .backend_ndarray import NDArray
from .backend_ndarray import ewise_program as _program
from .lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR, StepLR
from .memory import attribute as _attribute
from .memory import framework_category as _framework_category
from .memory.observers import phase as _phase

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm", "lr_scheduler", "StepLR",
           "CosineAnnealingLR", "LinearLR", "SequentialLR"]

# PyTorch's spelling, ``from needle.optim.lr_scheduler import StepLR``, although this module
# is not a package: the import system finds a submodule in sys.modules first.
sys.modules[__name__ + ".lr_scheduler"] = lr_scheduler


def _array(t: Tensor):
    return t.realize_cached_data()


def _grad(p: Tensor, theta, grad_scale):
    # Updates run in the dtype of theta (the parameter's, or its float32 master's): a gradient
    # of another dtype is cast first, then unscaled there.
    g = p.grad.realize_cached_data()
    g = g if g.dtype == theta.dtype else g.astype(theta.dtype)
    return g if grad_scale is None else g * (1.0 / float(grad_scale))


def _is_half(array) -> bool:  # float16 or bfloat16: updated through a float32 master
    return str(array.dtype) in ("float16", "bfloat16")


def _state(array):
    """Optimizer state (a moment): its bytes move from ``optimizer_temp`` to ``optimizer``."""
    _attribute(array, "optimizer")
    return array


def _to_numpy(array) -> np.ndarray:
    return array.numpy() if hasattr(array, "numpy") else np.array(array)


def _from_numpy(value, like: Tensor):
    # state of a float16 parameter (moments, momentum) lives in float32, beside its master
    dtype = "float32" if _is_half(like) else like.dtype
    return Tensor(np.asarray(value), device=like.device, dtype=dtype,
                  requires_grad=False).realize_cached_data()


def _attributed_step(step):
    """Wrap a ``step`` for needle.memory: the step is the ``optimizer`` phase of a timeline;
    what it allocates is ``optimizer_temp`` memory (the update's temporaries) unless it says
    otherwise (new weights are ``weight``, moments ``optimizer``: see ``Optimizer._assign``
    and ``_state``);
    any array installed as a parameter is ``weight`` afterwards (subclasses that assign
    ``p.data`` themselves)."""
    if getattr(step, "_memory_attributed", False):
        return step

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        # arrays _install made are weight memory from their allocation: no retag needed
        fresh = self._fresh = set()
        try:
            with _phase("optimizer", type(self).__name__ + ".step"), \
                    _framework_category("optimizer_temp"):
                out = step(self, *args, **kwargs)
        finally:
            self._fresh = None
        for p in self.params:
            if id(p.cached_data) not in fresh:
                _attribute(p, "weight")
        return out

    wrapper._memory_attributed = True
    return wrapper


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.number))


def _betas(owner: str, beta1, beta2, betas) -> tuple:
    """``(β1, β2)`` from ``beta1``/``beta2`` or PyTorch's ``betas`` pair (not both)."""
    if betas is None:
        return beta1, beta2
    if (beta1, beta2) != (0.9, 0.999):
        raise OptimizerError(f"{owner}: betas given twice, expected betas= or beta1=/beta2=, "
                          f"got betas={betas!r} and beta1={beta1!r}, beta2={beta2!r}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise OptimizerError(f"{owner}: betas must be a pair, expected (beta1, beta2), "
                          f"got {betas!r}")
    return betas[0], betas[1]


def _group_hyper(name: str) -> property:
    """``opt.<name>``: the first parameter group's value; setting it sets every group's."""
    def get(self):
        return self.param_groups[0][name]

    def put(self, value):
        for group in self.param_groups:
            group[name] = value
    return property(get, put, doc=f"``{name}`` of the parameter groups (see param_groups)")


def _param_groups(owner: str, params, defaults: dict, hyper: tuple) -> list:
    """PyTorch-style groups from ``params`` (Tensors, or dicts with ``"params"``): each a
    dict holding its ``"params"`` list and every hyper-parameter, the group's own over
    ``defaults``; ``betas`` in a group is split into ``beta1``/``beta2``."""
    params = list(params)
    if not params or not all(isinstance(g, dict) for g in params):
        if any(isinstance(g, dict) for g in params):
            raise OptimizerError(f"{owner}: params mixes tensors and parameter groups, expected "
                              f"all tensors or all dicts, got {[type(g).__name__ for g in params]}")
        params = [{"params": params}]
    groups, seen = [], set()
    for given in params:
        if "params" not in given:
            raise OptimizerError(f"{owner}: a parameter group has no 'params', expected a dict "
                              f"with 'params', got keys {sorted(given)}")
        group = {**defaults, **given}
        group["params"] = list(given["params"])
        if "betas" in given:
            group["beta1"], group["beta2"] = _betas(owner, 0.9, 0.999, group.pop("betas"))
        for name in hyper:
            if not _is_number(group.get(name)):
                raise OptimizerError(f"{owner}: hyper-parameter {name!r} of group {len(groups)} "
                                  f"is not a number, expected int or float, got "
                                  f"{group.get(name)!r}")
            group[name] = float(group[name])
        if seen & {id(p) for p in group["params"]}:
            raise OptimizerError(f"{owner}: a parameter is in two groups, expected each in one, "
                              f"got a repeat in group {len(groups)}")
        seen |= {id(p) for p in group["params"]}
        groups.append(group)
    return groups


class Optimizer:
    """Base class: holds ``params``; ``step()`` updates them, ``reset_grad()`` clears grads.

    Per-parameter state lives in dicts keyed by parameter (identity); ``state_dict()``
    returns it as NumPy arrays keyed by parameter position, plus the hyper-parameters.
    Every subclass's ``step`` is wrapped for memory attribution (see :func:`_attributed_step`).

    ``amp.GradScaler`` uses four members: ``params``, ``step()``, :meth:`grads_finite` and
    :meth:`set_grad_scale`. An object handed to a GradScaler in an optimizer's place (a
    wrapper that synchronises or shards gradients) provides all four: ``grads_finite`` for the
    gradients its ``step`` will use, after its own synchronisation and with the same answer
    on every rank; ``set_grad_scale`` reaching the optimizer that reads the gradients.
    """

    _slots: tuple[str, ...] = ()
    _hyper: tuple[str, ...] = ()
    # Divide gradients by this while stepping (set by amp.GradScaler.step), or None.
    grad_scale: float | None = None
    # ids of the arrays _install gave parameters during the current step (else None)
    _fresh: set | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            cls.step = _attributed_step(cls.__dict__["step"])
        for name in cls._hyper:
            if not isinstance(getattr(cls, name, None), property):
                setattr(cls, name, _group_hyper(name))

    def __init__(self, params, defaults: dict | None = None):
        """``params``: Tensors, or dicts each holding ``"params"`` and hyper-parameters of
        its own (PyTorch's parameter groups); ``defaults``: the hyper-parameters of every
        group that does not set them."""
        self.param_groups = _param_groups(type(self).__name__, params, defaults or {},
                                          self._hyper)
        # One group: the group's list is ``params`` itself, so code that appends to
        # ``opt.params`` (as the course's did) still reaches the step.
        groups = self.param_groups
        self.params = groups[0]["params"] if len(groups) == 1 else \
            [p for g in groups for p in g["params"]]
        self._plans: dict = {}  # group index -> its last plain step's launches (_PlainPlan)
        for name in self._slots:
            setattr(self, name, {})
        self.master: dict = {}  # float16 parameter -> its float32 master array
        self._installed: dict = {}  # float16 parameter -> the array this optimizer gave it
        self._fresh = None

    # ----- the arrays an update reads and writes ---------------------------------------------
    def _theta(self, p: Tensor):
        """The array the update runs on: the parameter's, or its float32 master."""
        data = _array(p)
        if not _is_half(data):
            return data
        master = self.master.get(p)
        if master is None or self._installed.get(p) is not data:
            master = data.astype("float32")  # first step, or the data was replaced
            _attribute(master, "master")
            self.master[p] = master
            self._installed[p] = data
        return master

    def _grads(self, params=None):
        """(parameter, θ, grad) for every parameter (of ``params``, default all) that has a
        gradient; θ is the parameter's array or its float32 master, the gradient is cast to
        θ's dtype and unscaled (``grad_scale``)."""
        scale = self.grad_scale
        for p in self.params if params is None else params:
            if p.grad is None:
                continue
            theta = self._theta(p)
            yield p, theta, _grad(p, theta, scale)

    @staticmethod
    def _decayed(theta, g, wd: float):
        """``grad + wd·θ`` (the gradient itself without weight decay)."""
        return g + theta * wd if wd else g

    def _theta_category(self, p: Tensor) -> str:
        return "master" if p in self.master else "weight"

    def _new_theta(self, p: Tensor, theta, plain: bool = False):
        """The array an update program writes ``p``'s new θ to: an empty one, ``master`` or
        ``weight`` memory from its allocation; with ``plain``, θ itself (updated in place,
        see :meth:`_plain_fused_steps`)."""
        if plain:
            return theta
        with _framework_category(self._theta_category(p)):
            return _program.empty_like(theta)

    def _new_state(self, like, old=None, plain: bool = False):
        """The array an update program writes a new moment to: an empty one, ``optimizer``
        memory from its allocation; with ``plain``, the ``old`` moment where there is one
        (updated in place)."""
        if plain and old is not None:
            return old
        with _framework_category("optimizer"):
            return _program.empty_like(like)

    def _assign(self, p: Tensor, theta, delta) -> None:
        """Install ``θ − delta`` (see :meth:`_install`), computed as ``master`` or ``weight``
        memory from its allocation, so a memory timeline never shows weights turning into
        optimizer memory."""
        with _framework_category(self._theta_category(p)):
            new = theta - delta
        self._install(p, new)

    def _install(self, p: Tensor, new) -> None:
        """Make ``new`` the parameter's θ: its master (and the master's float16 rounding
        into ``p``), or ``p``'s data."""
        if p in self.master:
            self.master[p] = new
            with _framework_category("weight"):
                p.cached_data = new.astype(p.cached_data.dtype)
            self._installed[p] = p.cached_data
            note_replaced(p)
        else:
            replace_data(p, new)
        if self._fresh is not None:
            self._fresh.add(id(p.cached_data))

    # ----- the fused updates' fast path ---------------------------------------------------
    # A small model's step updates dozens of parameters, and the general path (_grads,
    # _theta, _grad, a category scope per new θ, _install's checks) costs ~5 us of Python
    # per parameter. Most steps need none of it: no float16 masters, no gradient scale.
    # _plain_fused_steps runs the _fused_step programs in place, as PyTorch's optimizers do:
    # θ and the moments are written into their own buffers (the programs read every element
    # before they store it), so a step allocates nothing after the first and its peak holds
    # no second copy of the weights. The runs are collected in an ewise_program.Batch and go
    # to the backend together, in parameter order (one C++ call on cpu(), as PyTorch's
    # foreach updates): SGD on MLPResNet 175 us per step with new buffers, ~100 in place with
    # one call per parameter, ~60 batched. The write bumps the buffer's version, so a graph
    # that saved θ refuses to backpropagate through it afterwards, as after a replacement.
    # A parameter it cannot take goes to the general path, which installs new buffers.
    def _fused_step(self, p: Tensor, theta, g, scalars: list, batch=None) -> bool:
        """``p``'s update as an elementwise program (subclasses), or False: not fused.
        ``batch``: an ``ewise_program.Batch`` to queue the update in, in place (see
        :meth:`_plain_fused_steps`); else it runs now and installs new arrays."""
        return False

    def _plain_fused_steps(self, scalars: list, params: list, group: int = 0) -> list:
        """:meth:`_fused_step` in place, batched, for every parameter of ``params`` (the
        ``group``-th parameter group) with a gradient when the fast path applies (not
        compiling, no gradient scale, no float16 masters); returns the parameters left for
        the general path (all of them when it does not apply)."""
        if compiling() or self.grad_scale is not None or self.master:
            return params
        plan = self._plans.get(group)
        if plan is not None and plan.run(self, scalars, params):
            return []
        self._plans.pop(group, None)
        rest: list = []
        done: list = []
        batch = _program.Batch(scalars, record=True)
        for p in params:
            grad = p.grad
            if grad is None:
                continue
            if self._fused_step(p, p.realize_cached_data(), grad.realize_cached_data(),
                                scalars, batch):
                done.append(p)
            else:
                rest.append(p)  # mixed dtypes, views, a backend without the kernel
        batch.run()
        if not rest:
            self._plans[group] = _PlainPlan.of(self, scalars, batch.added, params)
        _noted_in_place(done, self._fresh)
        return rest

    def _plain_key(self, scalars: list) -> tuple:
        """What of ``scalars`` decides which program an update runs (subclasses)."""
        return ()

    def _plain_states(self, p: Tensor, scalars: list) -> tuple:
        """``(slot, array)`` of each moment ``p``'s update reads, in the program's input
        order after θ and the gradient (subclasses)."""
        return ()

    def rebind(self, p: Tensor, data) -> None:
        """Point parameter ``p`` at ``data``, an array holding the same values as its current
        data (another buffer, a view): its master copy stays valid.

        Example:
            >>> import numpy as np, needle as ndl
            >>> from needle import optim
            >>> p = ndl.Tensor(np.ones(2, "float16")); opt = optim.SGD([p], lr=1.0)
            >>> p.grad = ndl.Tensor(np.ones(2, "float16")); opt.step()
            >>> opt.rebind(p, p.realize_cached_data().compact()); p.numpy().tolist()
            [0.0, 0.0]
        """
        p.cached_data = data
        if p in self.master:
            self._installed[p] = data

    def step(self) -> None:
        raise NotImplementedError

    def reset_grad(self) -> None:
        for p in self.params:
            p.grad = None

    zero_grad = reset_grad

    def grads_finite(self) -> bool:
        """Whether every gradient the next :meth:`step` reads is finite (no Inf, no NaN);
        parameters without a gradient do not count. ``amp.GradScaler`` asks before a step
        and skips the step when the answer is False.

        Each gradient is checked as stored, in its own dtype and before any unscaling (a
        float16 gradient that overflowed holds an Inf), whichever way the update then runs:
        fused or composed, on the parameter or on its float32 master.

        Example:
            >>> import numpy as np, needle as ndl
            >>> from needle import optim
            >>> p, q = ndl.Tensor(np.ones(2)), ndl.Tensor(np.ones(2))
            >>> opt = optim.SGD([p, q], lr=0.1); opt.grads_finite()  # no gradient yet
            True
            >>> p.grad = ndl.Tensor(np.array([1.0, np.nan])); opt.grads_finite()
            False
        """
        for p in self.params:
            grad = p.grad
            if grad is not None and not np.isfinite(grad.numpy()).all():
                return False
        return True

    def set_grad_scale(self, scale: float | None) -> None:
        """Divide each gradient by ``scale`` as the following steps read it, in the update's
        precision (float32 for float16 parameters); None: read gradients as they are.
        ``amp.GradScaler.step`` sets its scale for the length of ``step()``.

        Example:
            >>> import numpy as np, needle as ndl
            >>> from needle import optim
            >>> p = ndl.Tensor(np.ones(2)); opt = optim.SGD([p], lr=1.0)
            >>> p.grad = ndl.Tensor(np.full(2, 8.0)); opt.set_grad_scale(8.0)
            >>> opt.step(); opt.set_grad_scale(None); p.numpy().tolist()
            [0.0, 0.0]
        """
        self.grad_scale = None if scale is None else float(scale)

    def clip_grad_norm(self, max_norm=0.25) -> float:
        """Scale all gradients together so that their global L2 norm is at most ``max_norm``."""
        return clip_grad_norm(self.params, max_norm)

    def state_dict(self) -> dict:
        """Hyper-parameters and per-parameter state (NumPy copies) by parameter index; float16
        parameters' float32 master copies under ``state["master"]``."""
        index = {id(p): i for i, p in enumerate(self.params)}
        state = {name: {index[id(p)]: _to_numpy(v) for p, v in getattr(self, name).items()
                        if id(p) in index} for name in (*self._slots, "master")}
        out = {"type": type(self).__name__, "hyper": {h: getattr(self, h) for h in self._hyper},
               "state": state, "extra": self._extra_state()}
        if len(self.param_groups) > 1:  # one group's hyper-parameters are "hyper" itself
            out["groups"] = [{h: g[h] for h in self._hyper} for g in self.param_groups]
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` gave (same parameter list, same order). Everything
        is checked against this optimizer's own parameters before anything changes.

        Raises:
            SerializationError: for a state of another optimiser type, hyper-parameters other
                than this optimizer's, a slot missing (Adam's ``m``...), a parameter index
                out of range, or slots that cover different parameters.
            ShapeError: for a state array whose shape differs from its parameter's.
        """
        _check_optimizer_state(self, state)
        for name, value in state["hyper"].items():
            setattr(self, name, value)
        for group, saved in zip(self.param_groups, state.get("groups", ()), strict=False):
            group.update(saved)
        for name in self._slots:
            setattr(self, name, {self.params[int(i)]: _from_numpy(v, self.params[int(i)])
                                 for i, v in state["state"][name].items()})
        self._load_master(state["state"].get("master", {}))
        self._load_extra_state(state.get("extra", {}))

    def _load_master(self, saved: dict) -> None:
        self.master, self._installed = {}, {}
        for i, value in saved.items():
            p = self.params[int(i)]
            master = Tensor(np.asarray(value, dtype=np.float32), device=p.device,
                            dtype="float32", requires_grad=False).realize_cached_data()
            _attribute(master, "master")
            self.master[p] = master
            self._installed[p] = _array(p)

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        pass


def _check_optimizer_state(opt: Optimizer, state) -> None:
    """Refuse a state that does not fit ``opt``: its type, its hyper-parameters (a key such
    as ``params`` would replace the parameter list), every slot present, indices of
    ``opt.params``, the same parameters in every slot, shapes of the parameters."""
    where = f"{type(opt).__name__}.load_state_dict"

    def fail(what: str, expected, got) -> SerializationError:
        return SerializationError(f"{where}: {what}, expected {expected}, got {got}")

    if not isinstance(state, dict) or state.get("type") != type(opt).__name__:
        got = state.get("type") if isinstance(state, dict) else type(state).__name__
        raise fail("optimiser type differs", type(opt).__name__, repr(got))
    hyper, slots = state.get("hyper"), state.get("state")
    if not isinstance(hyper, dict) or sorted(hyper) != sorted(opt._hyper):
        raise fail("hyper-parameters differ", sorted(opt._hyper),
                   sorted(hyper) if isinstance(hyper, dict) else hyper)
    for name, value in hyper.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise fail(f"hyper-parameter {name!r} is not a number", "int or float", repr(value))
    names = (*opt._slots, "master")
    if not isinstance(slots, dict) or not set(opt._slots) <= set(slots) <= set(names):
        raise fail("per-parameter state slots differ", list(names),
                   sorted(slots) if isinstance(slots, dict) else slots)
    covered = {}
    for name in slots:
        if not isinstance(slots[name], dict):
            raise fail(f"slot {name!r} is not a dict", "{index: array}", slots[name])
        for i, value in slots[name].items():
            if not (type(i) is int or (isinstance(i, str) and i.isdecimal())) or not (
                    0 <= int(i) < len(opt.params)):
                raise fail(f"slot {name!r} holds parameter index {i!r}",
                           f"indices 0..{len(opt.params) - 1}", repr(i))
            shape = tuple(opt.params[int(i)].shape)
            if tuple(np.shape(value)) != shape:
                raise ShapeError(f"{where}: state {name!r} of parameter {i} has the wrong "
                                 f"shape, expected {shape}, got {tuple(np.shape(value))}")
        covered[name] = sorted(int(i) for i in slots[name])
    if len({tuple(covered[name]) for name in opt._slots}) > 1:
        raise fail("slots cover different parameters", "the same in every slot",
                   {name: covered[name] for name in opt._slots})
    groups = state.get("groups", [hyper] * len(opt.param_groups))
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups) or not all(
            isinstance(g, dict) and sorted(g) == sorted(opt._hyper) and all(
                _is_number(v) for v in g.values()) for g in groups):
        raise fail("parameter groups differ", f"{len(opt.param_groups)} groups of "
                   f"{sorted(opt._hyper)}", repr(groups)[:200])




def _noted_in_place(params, fresh) -> None:
    """Record the in-place update of each of ``params``: a write into its buffer (seen by
    every alias of it) and a replacement (its data version counts steps)."""
    logs = BUFFER_LOGS
    for p in params:
        data = p.cached_data
        log = logs.get(id(data._handle))  # note_write's common case inlined (every step)
        if log is not None:
            log.record()
        else:
            _note_write(data._handle)
        note_replaced(p)
        if fresh is not None:
            fresh.add(id(data))


class _PlainPlan:
    """The launches of the last plain step, per parameter, to run again while everything
    they were built from still holds (~1.5 us of Python per parameter less than rebuilding
    them: SGD on MLPResNet ~80 -> ~60 us per step).

    It holds when, for every parameter in order: it has a gradient exactly when it had one,
    its data is the same array, its moments are the same arrays in the optimizer's slots, the
    scalars pick the same program, and the gradient is a compact array of θ's shape, dtype
    and device. Anything else rebuilds the step through :meth:`Optimizer._fused_step`. Only
    a step whose every update ran in place becomes a plan (not a first step that made its
    moments, nor one that left parameters to the general path).
    """

    __slots__ = ("key", "entries", "program", "mod")

    @classmethod
    def of(cls, opt, scalars, added, params):
        """The plan of the step that just ran ``added`` (the Batch's record: one
        ``(program, ins, outs)`` per parameter of ``params`` with a gradient, in order), or
        None."""
        entries = []
        launched = iter(added)
        programs, devices = set(), set()
        for p in params:
            if p.grad is None:
                entries.append((p, None))
                continue
            program, ins, outs = next(launched)
            theta, states = ins[0], opt._plain_states(p, scalars)
            if theta is not p.cached_data or len(states) != len(ins) - 2 \
                    or any(a is not b for (_, a), b in zip(states, ins[2:], strict=True)) \
                    or not all(o is theta or any(o is x for x in ins[2:]) for o in outs):
                return None  # e.g. a first step, which made its moments
            programs.add(program)
            devices.add(theta._device)
            entries.append((p, theta, tuple(name for name, _ in states), ins[2:],
                            theta._device, theta._shape, theta._handle.dtype,
                            (theta._handle,), tuple(a._handle for a in ins[2:]),
                            tuple(o._handle for o in outs), math.prod(theta._shape)))
        if len(programs) != 1 or len(devices) != 1:
            return None
        plan = cls()
        plan.key, plan.entries = opt._plain_key(scalars), entries
        plan.program, plan.mod = programs.pop(), devices.pop().mod
        return plan

    def run(self, opt, scalars, params) -> bool:
        """Run the step of ``params`` from the plan; False (nothing run) when it no longer
        holds."""
        if len(params) != len(self.entries) or opt._plain_key(scalars) != self.key:
            return False
        launches = []
        done = []
        for p, entry in zip(params, self.entries, strict=True):
            grad = p.grad
            if entry[0] is not p or (grad is None) != (entry[1] is None):
                return False
            if grad is None:
                continue
            _, theta, names, states, device, shape, dtype, head, tail, outs, n = entry
            g = grad.cached_data
            if (p.cached_data is not theta or type(g) is not NDArray or g._device is not device
                    or g._shape != shape or g._handle.dtype != dtype
                    or not (g._compact or g.is_compact())):
                return False
            for name, state in zip(names, states, strict=True):
                if getattr(opt, name).get(p) is not state:
                    return False
            launches.append((head + (g._handle,) + tail, outs, n))
            done.append(p)
        _program.run_launches(self.mod, launches, self.program.code, scalars)
        _noted_in_place(done, opt._fresh)
        return True


class SGD(Optimizer):
    """SGD with momentum (an exponential average) and L2 weight decay.

    ``g = grad + wd·θ``; ``u ← momentum·u + (1 − momentum)·g`` (u starts at 0);
    ``θ ← θ − lr·u``. Without momentum ``u = g``.
    """

    _slots = ("u",)
    _hyper = ("lr", "momentum", "weight_decay")

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    def step(self) -> None:
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group)

    def _step_group(self, index: int, group: dict) -> None:
        lr, mom, wd = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
        scalars = [lr, wd, mom, 1 - mom]
        rest = self._plain_fused_steps(scalars, group["params"], index)
        for p, theta, g in self._grads(rest):
            if self._fused_step(p, theta, g, scalars):
                continue
            u = self.u.get(p) if mom else None
            g = self._decayed(theta, g, wd)
            if mom:
                u = g * (1 - mom) if u is None else u * mom + g * (1 - mom)
                self.u[p] = _state(u)
            else:
                u = g
            self._assign(p, theta, u * lr)

    def _plain_key(self, scalars: list) -> tuple:
        return bool(scalars[2]), bool(scalars[1])  # momentum, weight decay

    def _plain_states(self, p: Tensor, scalars: list) -> tuple:
        return (("u", self.u.get(p)),) if scalars[2] else ()

    def _fused_step(self, p: Tensor, theta, g, scalars: list, batch=None) -> bool:
        """The update of ``p`` as one pass over memory with no temporaries, bitwise the
        composed one, where the arrays allow (else False). A compiled step takes the
        composed path: the compiler fuses it itself. ``batch``: see
        :meth:`Optimizer._fused_step`."""
        mom = scalars[2]
        u = self.u.get(p) if mom else None
        arrays = (theta, g) if u is None else (theta, g, u)
        plain = batch is not None  # (_plain_fused_steps checked compiling() once)
        if (not plain and compiling()) or not _program.available(arrays):
            return False
        outs = [self._new_state(theta, u, plain)] if mom else []
        outs.append(self._new_theta(p, theta, plain))
        program = _sgd_program(bool(mom), u is not None, bool(scalars[1]))
        if mom:
            self.u[p] = outs[0]
        if plain:
            batch.add(program, arrays, outs)
            return True
        _program.run(program, arrays, scalars, outs)
        self._install(p, outs[-1])
        return True


# ----- update programs (needle.backend_ndarray.ewise_program): built once per shape of rule ---
# Each is the composed update's kernels in the same order, so the fused result is bitwise
# the composed one. Inputs: θ (register 0), the gradient (1), then the moments.
@functools.lru_cache(maxsize=None)
def _sgd_program(momentum: bool, has_u: bool, decay: bool) -> _program.Program:
    """Scalars ``[lr, wd, momentum, 1 - momentum]``; outputs ``[u] + [θ − lr·u]``."""
    prog = _program.Program(3 if has_u else 2)
    g = _decayed_reg(prog, decay, 1)
    if momentum:
        u = prog.scalar("mul", g, 3)
        if has_u:
            um = prog.scalar("mul", 2, 2)
            u, old = prog.binary("add", um, u), u
            prog.free(um, old)
        prog.store(u)
        g = u
    prog.store(prog.binary("sub", 0, prog.scalar("mul", g, 0)))
    return prog


def _decayed_reg(prog, decay: bool, wd_index: int) -> int:
    """The register of ``g + θ·wd`` (``g`` itself without decay)."""
    if not decay:
        return 1
    decay_term = prog.scalar("mul", 0, wd_index)
    g = prog.binary("add", 1, decay_term)
    prog.free(decay_term)
    return g


# Adam's scalars: [wd, β1, 1 − β1, β2, 1 − β2, c1, lr, c2, eps]
@functools.lru_cache(maxsize=None)
def _adam_m_program(first: bool, decay: bool) -> _program.Program:
    """Inputs ``θ, g (, m)``; output the new m."""
    prog = _program.Program(2 if first else 3)
    g = _decayed_reg(prog, decay, 0)
    gm = prog.scalar("mul", g, 2)
    prog.store(gm if first else prog.binary("add", prog.scalar("mul", 2, 1), gm))
    return prog


@functools.lru_cache(maxsize=None)
def _adam_v_theta_program(first: bool, decay: bool, decoupled: bool = False) -> _program.Program:
    """Inputs ``θ, g, m (the new one) (, v)``; outputs the new v and the new θ."""
    prog = _program.Program(3 if first else 4)
    g = _decayed_reg(prog, decay, 0)
    gg = prog.binary("mul", g, g)
    gv = prog.scalar("mul", gg, 4)
    prog.free(gg, *((g,) if decay else ()))
    v = gv
    if not first:
        vb = prog.scalar("mul", 3, 3)
        v = prog.binary("add", vb, gv)
        prog.free(vb, gv)
    prog.store(v)
    _store_adam_theta(prog, 2, v, decoupled=decoupled)
    return prog


def _store_adam_theta(prog, m: int, v: int, *dead: int, decoupled: bool = False) -> None:
    """Store ``θ − (m / c1 · lr) / ((v / c2) ** 0.5 + eps)`` (θ in register 0) from the new
    moments in registers ``m`` and ``v``; ``dead``: more registers free once m is read.
    ``decoupled`` (AdamW): θ is first scaled by scalar 9, ``1 − lr·wd``."""
    m_c1 = prog.scalar("div", m, 5)
    step = prog.scalar("mul", m_c1, 6)  # m / c1 · lr
    v_c2 = prog.scalar("div", v, 7)
    prog.free(*dead, m_c1, v)
    root = prog.unary("sqrt", v_c2)  # (v / c2) ** 0.5, which NDArray computes as sqrt
    denom = prog.scalar("add", root, 8)
    prog.free(v_c2, root)
    ratio = prog.binary("div", step, denom)
    prog.free(step, denom)
    theta = prog.scalar("mul", 0, 9) if decoupled else 0
    prog.store(prog.binary("sub", theta, ratio))


@functools.lru_cache(maxsize=None)
def _adam_program(first: bool, decay: bool, decoupled: bool = False) -> _program.Program:
    """The in-place update (Adam's fast path) in one pass, the arithmetic of
    :func:`_adam_m_program` then :func:`_adam_v_theta_program`: inputs ``θ, g (, m, v)``;
    outputs the new m, the new v and the new θ (each may be its input's buffer: every read of
    an input comes before its store)."""
    prog = _program.Program(2 if first else 4)
    g = _decayed_reg(prog, decay, 0)
    m = prog.scalar("mul", g, 2)
    if not first:
        mb = prog.scalar("mul", 2, 1)
        m, gm = prog.binary("add", mb, m), m
        prog.free(mb, gm)
    prog.store(m)
    gg = prog.binary("mul", g, g)
    v = prog.scalar("mul", gg, 4)
    prog.free(gg, *((g,) if decay else ()))
    if not first:
        vb = prog.scalar("mul", 3, 3)
        v, gv = prog.binary("add", vb, v), v
        prog.free(vb, gv)
    prog.store(v)
    _store_adam_theta(prog, m, v, m, decoupled=decoupled)
    return prog


class Adam(Optimizer):
    """Adam with bias correction and L2 weight decay (added to the gradient).

    ``m ← β1·m + (1−β1)·g``; ``v ← β2·v + (1−β2)·g²``; ``θ ← θ − lr·m̂/(√v̂ + eps)`` with
    ``m̂ = m/(1−β1^t)``, ``v̂ = v/(1−β2^t)``; ``t`` counts ``step()`` calls. ``betas=(β1, β2)``
    is PyTorch's spelling of ``beta1``, ``beta2`` (give one or the other).

    Example:
        >>> import numpy as np, needle as ndl
        >>> p = ndl.Tensor(np.ones(2, "float32")); p.grad = ndl.Tensor(np.ones(2, "float32"))
        >>> opt = ndl.optim.Adam([p], lr=0.1, betas=(0.8, 0.99)); opt.step()
        >>> opt.beta1, opt.beta2, [round(x, 4) for x in p.numpy().tolist()]
        (0.8, 0.99, [0.9, 0.9])
    """

    _slots = ("m", "v")
    _hyper = ("lr", "beta1", "beta2", "eps", "weight_decay")
    _decoupled = False  # AdamW: weight decay shrinks θ instead of joining the gradient

    def __init__(self, params, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 *, betas=None):
        beta1, beta2 = _betas(type(self).__name__, beta1, beta2, betas)
        super().__init__(params, {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
                                  "weight_decay": weight_decay})
        self.t = 0

    def step(self) -> None:
        # the counter and its bias corrections through replayed(): a compiled step replaying
        # as a kernel program advances them too, instead of reusing the traced step's numbers
        corrections = replayed(self._advance, self)
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group, *corrections[2 * index:2 * index + 2])

    def _scalars(self, group: dict, c1: float, c2: float) -> list:
        """``[wd, β1, 1 − β1, β2, 1 − β2, c1, lr, c2, eps]`` (the programs' registers);
        decoupled decay: wd 0 and ``1 − lr·wd`` appended (θ's factor)."""
        b1, b2, wd = float(group["beta1"]), float(group["beta2"]), float(group["weight_decay"])
        lr, eps = float(group["lr"]), float(group["eps"])
        scalars = [0.0 if self._decoupled else wd, b1, 1 - b1, b2, 1 - b2, c1, lr, c2, eps]
        return scalars + [1 - lr * wd] if self._decoupled and wd else scalars

    def _step_group(self, index: int, group: dict, c1: float, c2: float) -> None:
        scalars = self._scalars(group, c1, c2)
        wd, lr, eps = scalars[0], scalars[6], scalars[8]
        keep = scalars[9] if len(scalars) > 9 else None
        b1, b2 = scalars[1], scalars[3]
        rest = self._plain_fused_steps(scalars, group["params"], index)
        for p, theta, g in self._grads(rest):
            if self._fused_step(p, theta, g, scalars):
                continue
            # Each moment is stored as soon as it is made, so the old one is freed before the
            # next is computed.
            m, v = self.m.get(p), self.v.get(p)
            # the update is one expression, so its temporaries die with it
            g = self._decayed(theta, g, wd)
            m = g * (1 - b1) if m is None else m * b1 + g * (1 - b1)
            self.m[p] = _state(m)
            v = (g * g) * (1 - b2) if v is None else v * b2 + (g * g) * (1 - b2)
            self.v[p] = _state(v)
            self._assign(p, theta if keep is None else theta * keep,
                         (m / c1 * lr) / ((v / c2) ** 0.5 + eps))

    def _plain_key(self, scalars: list) -> tuple:
        return bool(scalars[0]), len(scalars) > 9  # weight decay: coupled, decoupled

    def _plain_states(self, p: Tensor, scalars: list) -> tuple:
        return ("m", self.m.get(p)), ("v", self.v.get(p))

    def _fused_step(self, p: Tensor, theta, g, scalars: list, batch=None) -> bool:
        """The update of ``p`` as two passes over memory with no temporaries (the new m,
        then the new v and θ from it), bitwise the composed one, where the arrays allow
        (else False); in place (``batch``, see :meth:`Optimizer._fused_step`) one pass
        writing m, v and θ. A compiled step takes the composed path: the compiler fuses
        it."""
        m, v = self.m.get(p), self.v.get(p)
        first = m is None
        plain = batch is not None  # (_plain_fused_steps checked compiling() once)
        if (v is None) != first or (not plain and compiling()) \
                or not _program.available((theta, g) if first else (theta, g, m, v)):
            return False
        decay, decoupled = bool(scalars[0]), len(scalars) > 9
        if plain:
            outs = [self._new_state(theta, m, True), self._new_state(theta, v, True), theta]
            batch.add(_adam_program(first, decay, decoupled),
                      (theta, g) if first else (theta, g, m, v), outs)
            self.m[p], self.v[p] = outs[0], outs[1]
            return True
        new_m = self._new_state(theta)
        _program.run(_adam_m_program(first, decay), (theta, g) if first else (theta, g, m),
                     scalars, [new_m])
        self.m[p] = m = new_m  # the old m is freed before the new v is made
        outs = [self._new_state(theta), self._new_theta(p, theta)]
        _program.run(_adam_v_theta_program(first, decay, decoupled),
                     (theta, g, m) if first else (theta, g, m, v), scalars, outs)
        self.v[p] = outs[0]
        v = None
        self._install(p, outs[1])
        return True

    def _advance(self) -> tuple:
        """One more step: ``t += 1``, and the bias corrections ``(1 − β1^t, 1 − β2^t)`` of
        each parameter group in turn (one flat tuple)."""
        self.t += 1
        return tuple(1 - float(g[beta]) ** self.t for g in self.param_groups
                     for beta in ("beta1", "beta2"))

    def _extra_state(self) -> dict:
        return {"t": self.t}

    def _load_extra_state(self, extra: dict) -> None:
        self.t = int(extra.get("t", 0))


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): each step first shrinks θ by
    ``1 − lr·wd``, then takes Adam's step with the gradient alone,
    ``θ ← θ·(1 − lr·wd) − lr·m̂/(√v̂ + eps)``. Defaults are PyTorch's (``lr=1e-3``,
    ``weight_decay=1e-2``); ``betas`` or ``beta1``/``beta2`` as for :class:`Adam`.

    Example:
        >>> import numpy as np, needle as ndl
        >>> p = ndl.Tensor(np.ones(2, "float32")); p.grad = ndl.Tensor(np.zeros(2, "float32"))
        >>> ndl.optim.AdamW([p], lr=0.1, weight_decay=0.5).step(); p.numpy().tolist()
        [0.949999988079071, 0.949999988079071]
    """

    _decoupled = True

    def __init__(self, params, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                 *, betas=None):
        super().__init__(params, lr, beta1, beta2, eps, weight_decay, betas=betas)


def clip_grad_norm(params, max_norm=0.25, *, reduce=None, counted=None) -> float:
    """Scale every gradient by ``max_norm / (norm + 1e-6)`` when their global L2 norm exceeds
    ``max_norm``; gradients are replaced, not modified in place. Returns the norm before
    clipping.

    The squares are summed in float64, parameter by parameter in ``params`` order. When the
    gradients of one model are spread over several processes, two hooks make ``norm`` the
    whole model's (``needle.distributed.clip_grad_norm`` provides both):

    Args:
        reduce: ``reduce(local) -> total``: this rank's float64 sum of squares summed over
            the ranks that hold the rest of the model; it must return the same float on
            every rank so every rank scales by the same factor. None: this process holds
            the whole model.
        counted: ``counted(p) -> bool``: whether this rank counts ``p``'s squares (a
            gradient replicated on several ranks is counted by one of them); every
            parameter is still scaled. None: all are counted.

    Example:
        >>> import numpy as np
        >>> import needle as ndl
        >>> from needle import optim
        >>> p = ndl.Tensor(np.ones(4, dtype="float32")); (p * 3.0).sum().backward()
        >>> round(optim.clip_grad_norm([p], 1.0), 3), round(float(np.abs(p.grad.numpy()).sum()), 3)
        (6.0, 2.0)
    """
    grads = [p for p in params if p.grad is not None]
    total = 0.0
    for p in grads:
        if counted is not None and not counted(p):
            continue
        g = _to_numpy(_array(p.grad)).astype(np.float64)
        total += float((g * g).sum())
    if reduce is not None:
        total = float(reduce(total))
    norm = math.sqrt(total)
    if norm > max_norm:
        scale = float(max_norm) / (norm + 1e-6)
        with _framework_category("gradient"):  # the scaled copies are the new .grad buffers
            for p in grads:
                p.grad = Tensor.make_const(_array(p.grad) * scale)
    return norm
