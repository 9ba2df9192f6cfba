"""Gradient accumulation into a shared leaf is atomic: concurrent backwards lose nothing.

Each backward adds exactly 1 to every element of the shared leaf's ``.grad``, so the final
gradient counts the contributions. A tiny switch interval makes the interpreter switch
threads often, so that an unguarded read-add-assign of ``.grad`` loses updates on every run.
"""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from needle.autograd import Tensor
from needle.backend_selection import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "nd", reason="nd mode accumulates; np mode assigns")

THREADS = 8
PASSES = 150


def _hammer(leaf, passes, barrier, errors):
    try:
        barrier.wait()
        for _ in range(passes):
            (leaf * 1.0).sum().backward()
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(exc)


def _run(leaf, threads, passes):
    barrier = threading.Barrier(threads)
    errors: list = []
    workers = [threading.Thread(target=_hammer, args=(leaf, passes, barrier, errors))
               for _ in range(threads)]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=300)
    finally:
        sys.setswitchinterval(previous)
    assert not any(w.is_alive() for w in workers), "a backward thread did not finish"
    assert not errors, errors[0]


def test_every_contribution_is_counted(device):
    leaf = Tensor(np.zeros(4, dtype="float32"), device=device)
    _run(leaf, THREADS, PASSES)
    np.testing.assert_array_equal(leaf.grad.numpy(), np.full(4, THREADS * PASSES))


def test_leaves_of_one_graph_accumulate_independently(device):
    a = Tensor(np.zeros(2, dtype="float32"), device=device)
    b = Tensor(np.zeros(3, dtype="float32"), device=device)
    barrier = threading.Barrier(4)
    errors: list = []

    def work():
        try:
            barrier.wait()
            for _ in range(50):
                ((a * 1.0).sum() + (b * 2.0).sum()).backward()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(4)]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=300)
    finally:
        sys.setswitchinterval(previous)
    assert not errors, errors[0]
    np.testing.assert_array_equal(a.grad.numpy(), np.full(2, 200.0))
    np.testing.assert_array_equal(b.grad.numpy(), np.full(3, 400.0))
