"""``FastRLock`` (needle.memory._trusted_pair), the caching allocator's lock when the C module
is built: threading.RLock's behaviour, with an uncontended acquire that touches no OS lock."""
from __future__ import annotations

import sys
import threading

import pytest

from needle.memory import _trusted_pair  # built by `pip install -e .`: missing fails here

FastRLock = _trusted_pair.FastRLock


def test_the_allocator_takes_it():
    from needle.memory.caching_allocator import CachingAllocator

    assert type(CachingAllocator("x")._lock) is FastRLock


@pytest.fixture
def fast_switching():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the GIL changes hands inside every critical section
    yield
    sys.setswitchinterval(previous)


def test_one_thread_at_a_time_under_contention(fast_switching):
    """Four threads, nested acquires, a read-modify-write spread over several bytecodes:
    no two threads are ever inside at once and no increment is lost."""
    lock = FastRLock()
    state = {"inside": 0, "most": 0, "count": 0}

    def work():
        for _ in range(3000):
            with lock:
                state["inside"] += 1
                state["most"] = max(state["most"], state["inside"])
                with lock:  # re-entrant
                    value = state["count"]
                    for _ in range(3):
                        pass
                    state["count"] = value + 1
                state["inside"] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert state["count"] == 4 * 3000 and state["most"] == 1


def test_it_is_reentrant_and_only_its_owner_releases_it():
    lock = FastRLock()
    assert lock.acquire() and lock.acquire(True) and lock.acquire(blocking=True)
    assert lock._is_owned()
    errors = []

    def foreign_release():
        try:
            lock.release()
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=foreign_release)
    t.start()
    t.join(60)
    assert errors == ["cannot release un-acquired lock"]
    for _ in range(3):
        lock.release()
    assert not lock._is_owned()
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock.release()


def test_a_held_lock_refuses_other_threads_until_released():
    lock = FastRLock()
    lock.acquire()
    seen = []

    def try_it():
        seen.append(lock.acquire(False))
        seen.append(lock.acquire(timeout=0.05))
        seen.append(lock.acquire(True, 60))  # waits for the release below
        lock.release()

    t = threading.Thread(target=try_it)
    t.start()
    while len(seen) < 2:
        t.join(0.01)
    assert seen == [False, False] and t.is_alive()
    lock.release()
    t.join(60)
    assert seen == [False, False, True] and not t.is_alive()
    assert lock.acquire(False)  # free again, and uncontended
    lock.release()


def test_an_exception_inside_with_releases_it():
    lock = FastRLock()
    with pytest.raises(KeyError):
        with lock:
            raise KeyError("x")
    got = []
    t = threading.Thread(target=lambda: got.append(lock.acquire(False)))
    t.start()
    t.join(60)
    assert got == [True]


def test_bad_arguments_are_refused():
    lock = FastRLock()
    with pytest.raises(ValueError, match="non-blocking"):
        lock.acquire(False, 1)
    with pytest.raises(ValueError, match="non-negative"):
        lock.acquire(timeout=-2)
    with pytest.raises(TypeError, match="unexpected or repeated argument"):
        lock.acquire(wait=True)
    with pytest.raises(TypeError, match="unexpected or repeated argument"):
        lock.acquire(True, blocking=True)
    with pytest.raises(TypeError, match="at most 2 arguments"):
        lock.acquire(True, 1, 2)
    with pytest.raises(TypeError, match="takes no arguments"):
        FastRLock(1)
    assert not lock._is_owned()
