"""Where the ranks' output goes: whole lines, each prefixed, never two ranks mixed mid-line;
carriage-return frames (progress bars) redrawn in place on a terminal, and kept only as each
bar's last frame when the output is a file or a pipe.

A *frame* is text ended by a carriage return, or text after one that nothing has ended yet
(a bar's current state). A *line* is text ended by a newline. When a frame is followed by a
newline, that line is the bar's final frame: on a terminal it replaces the drawn frame, in a
file it is the only trace of the bar. A line from another rank while a bar is drawn is
printed above the bar, which is drawn again below it.
"""
from __future__ import annotations

import re
import shutil
import sys
import threading
from typing import TextIO

_TAG = re.compile(r"\[rank \d+\] ")  # the rank's own prefix (mpi: each rank prefixes itself)
_CLEAR = "\x1b[K"  # erase to the end of the line: a shorter frame leaves no tail behind


def split_pieces(text: str) -> tuple[list[tuple[str, str]], str]:
    """Split ``text`` into complete pieces, each ``(body, end)`` with ``end`` "\\n" or "\\r"
    ("\\r\\n" counts as a newline); return them and the unfinished rest.

    Example:
        >>> split_pieces("a\\r\\nb\\rc")
        ([('a', '\\n'), ('b', '\\r')], 'c')
    """
    pieces, start, i = [], 0, 0
    while i < len(text):
        ch = text[i]
        if ch == "\r" and i + 1 == len(text):
            break  # may be the first half of "\r\n": decide when more arrives
        if ch == "\n" or ch == "\r":
            crlf = ch == "\r" and text[i + 1] == "\n"
            pieces.append((text[start:i], "\n" if crlf else ch))
            i += 2 if crlf else 1
            start = i
            continue
        i += 1
    return pieces, text[start:]


class RankOutput:
    """The launcher's stdout, shared by every stream of rank output (one :meth:`stream` each).

    ``tty`` (default: whether ``out`` is a terminal) chooses between redrawing frames in place
    and keeping only each bar's last frame.
    """

    def __init__(self, out: TextIO | None = None, tty: bool | None = None):
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.lock = threading.Lock()
        self.frame: tuple[object, str] | None = None  # (owner key, text) drawn on the terminal
        self.last_frame: dict[object, str] = {}       # file/pipe: each owner's latest frame
        # set once the job is interrupted: mpiexec's own lines (those no rank tagged) are its
        # reaction to the interrupt, noise beside the one line the job answers with
        self.drop_untagged = False

    def stream(self, prefix: str = "") -> "_Stream":
        return _Stream(self, prefix)

    def _width(self) -> int:
        return max(20, shutil.get_terminal_size((100, 24)).columns - 1)

    # ----- under the lock ---------------------------------------------------------------
    def _draw(self, key: object, text: str, blank: bool) -> None:
        if not self.tty:
            if blank:
                self.last_frame.pop(key, None)
            else:
                self.last_frame[key] = text
            return
        if blank:  # a bar cleared before a line is printed (tqdm.write): draw nothing
            if self.frame is not None and self.frame[0] == key:
                self.out.write("\r" + _CLEAR)
                self.frame = None
            return
        # a frame wider than the terminal wraps, and "\r" would then redraw only its tail
        self.out.write("\r" + text[:self._width()] + _CLEAR)
        self.frame = (key, text)

    def _line(self, key: object, text: str, ends_frame: bool) -> None:
        """``ends_frame``: the line's text followed a carriage return, so it is the final
        state of the frame before it (a line that extends the frame's text is, too)."""
        if not self.tty:
            frame = self.last_frame.get(key)
            if frame is not None and (ends_frame or text.startswith(frame)):
                del self.last_frame[key]
            self.out.write(text + "\n")
            return
        if self.frame is None:
            self.out.write(text + "\n")
        elif self.frame[0] == key and (ends_frame or text.startswith(self.frame[1])):
            self.out.write("\r" + text + _CLEAR + "\n")
            self.frame = None
        else:  # another line while the bar is drawn: above the bar, which is drawn again
            self.out.write("\r" + _CLEAR + text + "\n" + "\r" + self.frame[1][:self._width()])

    def _close(self, keys: set) -> None:
        """A stream ended: a bar it left drawn (or, in a file, its last frame) stays."""
        if self.tty:
            if self.frame is not None and self.frame[0] in keys:
                self.out.write("\n")
                self.frame = None
            return
        for key in keys:
            text = self.last_frame.pop(key, None)
            if text is not None and text.strip():
                self.out.write(text + "\n")


class _Stream:
    """One source of output (a rank's pipe, or mpiexec's, where each rank tags its lines)."""

    def __init__(self, output: RankOutput, prefix: str):
        self.output, self.prefix = output, prefix
        self.pending = ""
        self.in_frame = False  # the pending text follows a carriage return: a bar's frame
        self.keys: set = set()

    def _key(self, body: str) -> tuple[tuple, bool]:
        """The frame owner ``body`` belongs to, and whether it is blank but for its tag."""
        tag = _TAG.match(body)
        key = (id(self), tag.group(0) if tag else "")
        self.keys.add(key)
        return key, not body[tag.end() if tag else 0:].strip()

    def _ends_frame(self, key: tuple) -> bool:
        """Whether a line now is the end of the frame before it: its text followed a carriage
        return. Not for tagged pieces (a rank under mpiexec ends each frame itself, and the
        piece after it may be another rank's)."""
        return self.in_frame and not key[1]

    def feed(self, text: str) -> None:
        pieces, self.pending = split_pieces(self.pending + text)
        out = self.output
        with out.lock:
            for body, end in pieces:
                key, blank = self._key(body)
                if out.drop_untagged and not self.prefix and not key[1]:
                    continue
                if end == "\r":
                    if body:
                        out._draw(key, self.prefix + body, blank)
                    self.in_frame = True
                else:
                    out._line(key, self.prefix + body, self._ends_frame(key))
                    self.in_frame = False
            if self.in_frame and self.pending.strip("\r"):
                key, blank = self._key(self.pending)
                out._draw(key, self.prefix + self.pending.rstrip("\r"), blank)
            out.out.flush()

    def close(self) -> None:
        """The source ended: an unfinished line is printed as one, a drawn bar stays."""
        with self.output.lock:
            rest = self.pending.rstrip("\r")
            if rest and not (self.output.drop_untagged and not self.prefix
                             and not _TAG.match(rest)):
                key = self._key(rest)[0]
                self.output._line(key, self.prefix + rest, self._ends_frame(key))
            self.output._close(self.keys)
            self.pending = ""
            self.output.out.flush()
