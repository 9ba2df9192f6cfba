"""Work handles and the communication thread that runs asynchronous collectives."""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from ._errors import CommError


class Work:
    """Handle of an asynchronous operation: ``wait()`` blocks until it is done (re-raising its
    error), ``is_completed()`` polls.

    Example:
        >>> w = Work.completed()
        >>> w.is_completed(), w.wait()
        (True, None)
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None
        self.started_at: float | None = None
        self.finished_at: float | None = None

    @classmethod
    def completed(cls, result: Any = None) -> "Work":
        work = cls()
        work._finish(result, None)
        return work

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self.finished_at = time.perf_counter()
        self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done and return the result; raise the operation's error if it failed.

        ``timeout`` bounds this wait only; the operation itself always has its group's timeout.
        """
        if not self._event.wait(timeout):
            raise CommError(f"Work.wait: not completed within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result


class PolledWork(Work):
    """Work driven by the caller (point-to-point): ``test()`` progresses without blocking and
    returns True once the transfer is done; ``complete()`` blocks until done (or raises at the
    operation's deadline) and returns the result."""

    def __init__(self, test: Callable[[], bool], complete: Callable[[], Any]):
        super().__init__()
        self._test = test
        self._complete = complete
        self.started_at = time.perf_counter()

    def _drive(self, blocking: bool) -> None:
        if self._event.is_set():
            return
        try:
            ready = blocking or self._test()
        except CommError:
            ready = True  # complete() reports the failure with its full context
        if not ready:
            return
        try:
            self._finish(self._complete(), None)
        except BaseException as exc:  # noqa: BLE001 - surfaced again by wait()
            self._finish(None, exc)

    def is_completed(self) -> bool:
        self._drive(blocking=False)
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        self._drive(blocking=True)
        return super().wait(0)


class CommThread:
    """One FIFO worker per process group, so collectives run in the order they were issued on
    every rank, whichever thread issued them."""

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, work = item
            work.started_at = time.perf_counter()
            try:
                result, error = fn(), None
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                result, error = None, exc
            with self._lock:
                self._pending -= 1
            work._finish(result, error)

    def submit(self, fn: Callable[[], Any]) -> Work:
        work = Work()
        with self._lock:
            self._pending += 1
        self._queue.put((fn, work))
        return work

    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)
