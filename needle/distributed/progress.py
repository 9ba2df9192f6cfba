"""Progress output for launched jobs: rank 0 draws a progress bar, the other ranks stay quiet
(or, when ``$NEEDLE_PROGRESS_RANKS`` names them, log plain lines now and then), and summaries
are printed once (by rank 0) with or without bars.

The rank comes from ``RANK`` (set by needle's launcher under every backend), so this works
before and without ``init_process_group``. Under the launcher a bar still redraws in place on
a terminal, prefixed with ``[rank 0]``; when the launcher's output is a file or a pipe, only
each bar's last frame is kept.

Example (in a training script; ``--no-progress`` gives ``enabled=False``):
    >>> bar = progress_bar(total=3, desc="train", enabled=False)
    >>> for step in range(3):
    ...     bar.update(1)
    >>> bar.write("epoch 1: loss 0.25")
    epoch 1: loss 0.25
    >>> bar.close()
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Iterator, TextIO

from .._core.errors import NeedleError
from .._core.job_env import RANK_VARS

__all__ = ["PlainProgress", "ProgressSettingError", "progress_bar", "rank_from_env",
           "shows_progress"]

PROGRESS_RANKS_ENV = "NEEDLE_PROGRESS_RANKS"  # which ranks print progress: "0", "all", "0,1"
COLUMNS_ENV = "NEEDLE_LAUNCH_COLUMNS"  # the width of the launcher's terminal, when it has one


class ProgressSettingError(NeedleError, ValueError):
    """``$NEEDLE_PROGRESS_RANKS`` holds something other than ``all`` or a list of ranks."""


def rank_from_env() -> int:
    """This process's rank as the launcher (or mpiexec) announced it; 0 outside a job."""
    for name in RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class PlainProgress:
    """A progress "bar" for ranks that must not draw one: plain lines, ``lines`` of them over
    the whole run (only when ``enabled``), plus what ``write`` is asked to print.

    It offers what training loops use of tqdm: ``update``, ``set_postfix``, ``write``,
    ``close``, iteration over a wrapped iterable and ``with``.
    """

    def __init__(self, iterable: Iterable | None = None, total: int | None = None,
                 desc: str = "", rank: int = 0, enabled: bool = True, lines: int = 10,
                 file: TextIO | None = None):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.rank, self.enabled = total, desc, rank, enabled
        self.lines, self.file = max(1, lines), file
        self.n = 0
        self.postfix = ""
        self._logged = 0  # how many of the ``lines`` checkpoints were printed

    def _print(self, text: str) -> None:
        print(text, file=self.file or sys.stdout, flush=True)

    def _line(self) -> str:
        done = f"{self.n}/{self.total} ({100 * self.n // self.total}%)" if self.total else \
            f"{self.n}"
        return f"{self.desc}: {done}" + (f" {self.postfix}" if self.postfix else "")

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled or not self.total:
            return
        due = self.n * self.lines // self.total
        if due > self._logged:
            self._logged = due
            self._print(self._line())

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True,
                    **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def write(self, message: str, all_ranks: bool = False) -> None:
        """Print ``message`` on rank 0 (every rank with ``all_ranks``), bars or not."""
        if self.rank == 0 or all_ranks:
            self._print(message)

    def close(self) -> None:
        if self.enabled and self.total is None and self.n:
            self._print(self._line())

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _columns() -> int:
    """The bar's width: the launcher's terminal less the ``[rank k]`` prefix, at most 100."""
    text = os.environ.get(COLUMNS_ENV, "")
    return min(100, max(40, int(text) - 12)) if text.isdigit() else 100


def shows_progress(rank: int) -> bool:
    """Whether ``rank`` prints progress: rank 0 only, unless ``$NEEDLE_PROGRESS_RANKS`` (the
    launcher's ``--progress-ranks``) says ``all`` or lists ranks (``0,1``).

    Example:
        >>> shows_progress(0), shows_progress(1)
        (True, False)
    """
    text = os.environ.get(PROGRESS_RANKS_ENV, "0").strip()
    if text == "all":
        return True
    try:
        return rank in {int(r) for r in text.split(",") if r.strip()}
    except ValueError:
        raise ProgressSettingError(f"progress: bad ${PROGRESS_RANKS_ENV}, expected 'all' or "
                                   f"ranks like '0,1', got {text!r}") from None


class _RankZeroBar:
    """A tqdm bar whose ``write`` takes ``all_ranks`` like PlainProgress and prints above the
    bar; everything else is the tqdm's."""

    def __init__(self, iterable: Iterable | None, total: int | None, desc: str,
                 file: TextIO | None):
        from tqdm import tqdm

        self._tqdm = tqdm
        self._out = file or sys.stdout
        # Under the launcher the bar goes where the script's lines go: mpiexec forwards a
        # rank's stdout and stderr apart, and a bar on stderr could be drawn after the line
        # printed once it closed. disable=False: the output is a pipe, and tqdm would otherwise
        # guess that nobody watches; mininterval keeps the pipe from flooding.
        launched = "NEEDLE_LAUNCH_RANK" in os.environ
        self.bar = tqdm(iterable, total=total, desc=desc,
                        file=file or (sys.stdout if launched else sys.stderr),
                        disable=False, mininterval=0.5, ncols=_columns())

    def write(self, message: str, all_ranks: bool = False) -> None:
        self._tqdm.write(message, file=self._out)

    def __iter__(self) -> Iterator:
        return iter(self.bar)

    def __enter__(self) -> "_RankZeroBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bar, name)


def progress_bar(iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 enabled: bool = True, rank: int | None = None, lines: int = 10,
                 file: TextIO | None = None) -> Any:
    """A tqdm bar on rank 0 when ``enabled``; a :class:`PlainProgress` everywhere else (plain
    lines on other ranks when ``enabled`` and :func:`shows_progress` names them, only
    ``write`` output when not).

    Args:
        iterable, total, desc: as for tqdm.
        enabled: False for ``--no-progress`` (summaries passed to ``write`` still print).
        rank: default :func:`rank_from_env`.
        lines: plain progress lines per run on the other ranks.
        file: where to write (default: lines to stdout; bars to stderr, to stdout under the
            launcher, where the lines go).
    """
    rank = rank_from_env() if rank is None else rank
    enabled = enabled and shows_progress(rank)
    if rank == 0 and enabled:
        return _RankZeroBar(iterable, total, desc, file)
    return PlainProgress(iterable, total, desc, rank, enabled, lines, file)
