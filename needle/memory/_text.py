"""Words and columns for the memory reports' text: what a missing op, line or shape means,
and tables whose columns start at the same offset on every row."""
from __future__ import annotations

from typing import Sequence


def op_label(op: str | None, phase: str | None = None) -> str:
    """The op that allocated a buffer, or what it was instead.

    Example:
        >>> op_label("EWiseAdd"), op_label(None), op_label(None, "before")
        ('EWiseAdd', '(outside any op)', '(before the profile)')
    """
    if op:
        return op
    return "(before the profile)" if phase == "before" else "(outside any op)"


def line_label(line: str | None, phase: str | None = None) -> str:
    """The Python line that allocated a buffer, or why there is none.

    Example:
        >>> line_label("train.py:12"), line_label(None), line_label(None, "before")
        ('train.py:12', '(no Python line)', '(before the profile)')
    """
    if line:
        return line
    return "(before the profile)" if phase == "before" else "(no Python line)"


def shape_label(shape: Sequence[int] | None) -> str:
    """A buffer's array shape as ``8x4`` (``scalar`` for a 0-d array), or ``(no array)`` for a
    buffer no array was made on (a kernel's scratch space).

    Example:
        >>> shape_label([8, 4]), shape_label([]), shape_label(None)
        ('8x4', 'scalar', '(no array)')
    """
    if shape is None:
        return "(no array)"
    return "x".join(str(int(n)) for n in shape) if len(shape) else "scalar"


def columns(rows: Sequence[Sequence[str]], right: Sequence[int] = (),
            indent: str = "") -> list[str]:
    """``rows`` of cells as lines whose columns each start at one offset (two spaces between
    columns); the columns numbered in ``right`` are right-aligned.

    Example:
        >>> columns([["a", "1"], ["bbb", "22"]], right=[1])
        ['a     1', 'bbb  22']
    """
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        out.append(indent + "  ".join(cells).rstrip())
    return out
