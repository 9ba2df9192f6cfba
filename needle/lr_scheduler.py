"""Learning-rate schedules over an optimizer's parameter groups (``ndl.optim.lr_scheduler``).

Each scheduler sets ``group["lr"]`` of every group of its optimizer from a closed form of
the epoch counter: ``lr = f(initial_lr, last_epoch)``. Being a pure function of two saved
numbers, a schedule resumes exactly: ``state_dict()`` holds ``last_epoch``, the initial
rates and the schedule's own settings, and ``load_state_dict`` sets the rates again, so a
scheduler can be saved with :class:`~needle.train_state.TrainState` as one of its parts
(``TrainState(model=m, optimizer=opt, scheduler=sched)``).

As in PyTorch, making a scheduler applies epoch 0's rate, ``step()`` moves to the next
epoch (call it after ``optimizer.step()``), and each group remembers the rate it started
from as ``group["initial_lr"]`` so that schedulers built one after another on the same
optimizer (:class:`SequentialLR`) share it.

Example:
    >>> import numpy as np, needle as ndl
    >>> from needle.optim.lr_scheduler import StepLR
    >>> opt = ndl.optim.SGD([ndl.Tensor(np.ones(1))], lr=1.0)
    >>> sched = StepLR(opt, step_size=2, gamma=0.5)
    >>> rates = []
    >>> for _ in range(5):
    ...     rates.append(opt.param_groups[0]["lr"]); opt.step(); sched.step()
    >>> rates
    [1.0, 1.0, 0.5, 0.5, 0.25]
"""
from __future__ import annotations

import bisect
import math

from ._core.errors import OptimizerError, SerializationError

__all__ = ["LRScheduler", "StepLR", "CosineAnnealingLR", "LinearLR", "SequentialLR"]


def _number(owner: str, name: str, value, low: float | None = None, integer: bool = False):
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if not ok or (low is not None and value < low):
        kind = "an int" if integer else "a number"
        bound = "" if low is None else f" >= {low}"
        raise OptimizerError(f"{owner}: {name} must be {kind}{bound}, got {value!r}")
    return value


class LRScheduler:
    """Base class: subclasses give :meth:`_lr`, the rate of one group at an epoch, and list
    their settings in ``_settings`` (saved by :meth:`state_dict`).

    Args:
        optimizer: any needle optimizer (it has ``param_groups``).
    """

    _settings: tuple[str, ...] = ()

    def __init__(self, optimizer):
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or not groups:
            raise OptimizerError(f"{type(self).__name__}: expected an optimizer with "
                                 f"param_groups, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        for group in groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [float(g["initial_lr"]) for g in groups]
        self.last_epoch = 0
        self._apply()

    def _lr(self, base: float, epoch: int) -> float:
        raise NotImplementedError

    def _apply(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = self._lr(base, self.last_epoch)

    def step(self) -> None:
        """Move to the next epoch and set every group's rate."""
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list:
        """The rate of each group as the last :meth:`step` (or the constructor) set it."""
        return [self._lr(base, self.last_epoch) for base in self.base_lrs]

    def state_dict(self) -> dict:
        """``type``, ``last_epoch``, ``base_lrs`` and the schedule's settings (plain values)."""
        return {"type": type(self).__name__, "last_epoch": self.last_epoch,
                "base_lrs": list(self.base_lrs),
                **{name: getattr(self, name) for name in self._settings}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values and set the rates of that epoch again.

        Raises:
            SerializationError: a state of another scheduler type, or for another number
                of parameter groups.
        """
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state, dict) or state.get("type") != type(self).__name__:
            got = state.get("type") if isinstance(state, dict) else type(state).__name__
            raise SerializationError(f"{where}: scheduler type differs, expected "
                                     f"{type(self).__name__!r}, got {got!r}")
        bases = state.get("base_lrs")
        if not isinstance(bases, list) or len(bases) != len(self.base_lrs):
            raise SerializationError(f"{where}: one initial rate per parameter group, "
                                     f"expected {len(self.base_lrs)}, got {bases!r}")
        self.last_epoch = _number(where, "last_epoch", state.get("last_epoch"), 0, True)
        self.base_lrs = [float(b) for b in bases]
        for name in self._settings:
            if name in state:
                setattr(self, name, state[name])
        self._apply()


class StepLR(LRScheduler):
    """``lr = initial_lr · gamma ** (epoch // step_size)``.

    Example:
        >>> import numpy as np, needle as ndl
        >>> opt = ndl.optim.SGD([ndl.Tensor(np.ones(1))], lr=0.1)
        >>> s = ndl.optim.StepLR(opt, step_size=1, gamma=0.5); s.step(); s.get_last_lr()
        [0.05]
    """

    _settings = ("step_size", "gamma")

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1):
        self.step_size = _number("StepLR", "step_size", step_size, 1, True)
        self.gamma = float(_number("StepLR", "gamma", gamma))
        super().__init__(optimizer)

    def _lr(self, base: float, epoch: int) -> float:
        return base * self.gamma ** (epoch // self.step_size)


class CosineAnnealingLR(LRScheduler):
    """``lr = eta_min + (initial_lr − eta_min)·(1 + cos(π·epoch / T_max)) / 2``: from the
    initial rate at epoch 0 down to ``eta_min`` at ``T_max`` (and back up after, as the
    cosine goes on).

    Example:
        >>> import numpy as np, needle as ndl
        >>> opt = ndl.optim.SGD([ndl.Tensor(np.ones(1))], lr=1.0)
        >>> s = ndl.optim.CosineAnnealingLR(opt, T_max=2); s.step(); s.get_last_lr()
        [0.5]
    """

    _settings = ("T_max", "eta_min")

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0):  # noqa: N803 (PyTorch's)
        self.T_max = _number("CosineAnnealingLR", "T_max", T_max, 1, True)
        self.eta_min = float(_number("CosineAnnealingLR", "eta_min", eta_min))
        super().__init__(optimizer)

    def _lr(self, base: float, epoch: int) -> float:
        return self.eta_min + (base - self.eta_min) * (
            1 + math.cos(math.pi * epoch / self.T_max)) / 2


class LinearLR(LRScheduler):
    """Linear warmup (or decay): the rate is ``initial_lr`` times a factor that goes in a
    straight line from ``start_factor`` at epoch 0 to ``end_factor`` at ``total_iters``, and
    stays there.

    Example:
        >>> import numpy as np, needle as ndl
        >>> opt = ndl.optim.SGD([ndl.Tensor(np.ones(1))], lr=1.0)
        >>> s = ndl.optim.LinearLR(opt, start_factor=0.25, total_iters=3)
        >>> [s.get_last_lr()[0]] + [s.step() or s.get_last_lr()[0] for _ in range(4)]
        [0.25, 0.5, 0.75, 1.0, 1.0]
    """

    _settings = ("start_factor", "end_factor", "total_iters")

    def __init__(self, optimizer, start_factor: float = 1 / 3, end_factor: float = 1.0,
                 total_iters: int = 5):
        self.start_factor = float(_number("LinearLR", "start_factor", start_factor, 0))
        self.end_factor = float(_number("LinearLR", "end_factor", end_factor, 0))
        self.total_iters = _number("LinearLR", "total_iters", total_iters, 1, True)
        super().__init__(optimizer)

    def _lr(self, base: float, epoch: int) -> float:
        done = min(epoch, self.total_iters) / self.total_iters
        return base * (self.start_factor + (self.end_factor - self.start_factor) * done)


class SequentialLR(LRScheduler):
    """One schedule after another: ``schedulers[i]`` runs from ``milestones[i-1]`` (its
    epoch counted from there), e.g. a linear warmup then cosine annealing.

    Example:
        >>> import numpy as np, needle as ndl
        >>> from needle.optim import lr_scheduler as sch
        >>> opt = ndl.optim.SGD([ndl.Tensor(np.ones(1))], lr=1.0)
        >>> warm = sch.LinearLR(opt, start_factor=0.5, total_iters=2)
        >>> cos = sch.CosineAnnealingLR(opt, T_max=2)
        >>> s = sch.SequentialLR(opt, [warm, cos], milestones=[2])
        >>> [s.get_last_lr()[0]] + [s.step() or s.get_last_lr()[0] for _ in range(4)]
        [0.5, 0.75, 1.0, 0.5, 0.0]
    """

    def __init__(self, optimizer, schedulers: list, milestones: list):
        if len(schedulers) != len(milestones) + 1 or list(milestones) != sorted(milestones) \
                or any(s.optimizer is not optimizer for s in schedulers):
            raise OptimizerError(
                f"SequentialLR: expected schedulers of this optimizer, one more than the "
                f"ascending milestones, got {len(schedulers)} schedulers and milestones "
                f"{list(milestones)!r}")
        self.schedulers, self.milestones = list(schedulers), list(milestones)
        super().__init__(optimizer)

    def _lr(self, base: float, epoch: int) -> float:
        i = bisect.bisect_right(self.milestones, epoch)
        start = self.milestones[i - 1] if i else 0
        return self.schedulers[i]._lr(base, epoch - start)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "milestones": list(self.milestones),
                "schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("schedulers") if isinstance(state, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.schedulers):
            raise SerializationError(f"SequentialLR.load_state_dict: one state per "
                                     f"scheduler, expected {len(self.schedulers)}, got "
                                     f"{saved!r}"[:200])
        for scheduler, inner in zip(self.schedulers, saved, strict=True):
            scheduler.load_state_dict(inner)
        super().load_state_dict(state)
