"""Huge shapes, strides and offsets never crash needle and never read outside a buffer.

Each property of overflow_worker.py (make, as_strided, broadcast_to, reshape, reductions and
matmul through NDArray; the backends' strided, reduction and matmul entry points called
directly) runs under hypothesis in a child process, one per device: a segfault or an abort
there fails the tests of that device and names the case that caused it, instead of ending the
test run. The cases the issue reported run first, in a child of their own.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from _cuda_emulator import compiler_available
from overflow_worker import PROPERTIES

import needle.backend_ndarray as nd

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "overflow_worker.py")
EXAMPLES = 100
CHILD_TIMEOUT_S = 600  # generous: the child compiles the emulated CUDA kernels first


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _death(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def _last_case(stderr: str) -> str:
    cases = [line for line in stderr.splitlines() if line.startswith("CASE ")]
    return cases[-1] if cases else "(before the first case)"


_REPORTS: dict = {}


def _report(device: str) -> dict:
    """Run every property on ``device`` in one child process (once per test session)."""
    if device not in _REPORTS:
        cmd = [sys.executable, WORKER, "--examples", str(EXAMPLES), device]
        try:
            proc = subprocess.run(cmd, cwd=HERE, env=_env(), capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
            _REPORTS[device] = {"error": f"timed out after {CHILD_TIMEOUT_S} s, last "
                                         f"{_last_case(stderr)}"}
            return _REPORTS[device]
        results = [line[len("RESULT "):] for line in proc.stdout.splitlines()
                   if line.startswith("RESULT ")]
        if proc.returncode != 0 or not results:
            _REPORTS[device] = {"error": f"the child died ({_death(proc.returncode)}) on "
                                         f"{_last_case(proc.stderr)}\n{proc.stderr[-3000:]}"}
        else:
            _REPORTS[device] = json.loads(results[-1])
    return _REPORTS[device]


def _device_param(name: str):
    marks = []
    if name == "cuda_emulated":
        marks = [pytest.mark.slow,
                 pytest.mark.skipif(not compiler_available(), reason="g++ not found")]
    elif name == "cuda":
        marks = [pytest.mark.cuda,
                 pytest.mark.skipif(not nd.cuda().enabled(), reason="cuda() not available")]
    elif name == "cpu" and not nd.cpu().enabled():
        # As in conftest: a missing compiled backend fails unless the run says it builds
        # without one.
        if os.environ.get("NEEDLE_ALLOW_NO_CPU_BACKEND") == "1":
            marks = [pytest.mark.skip(reason="cpu() backend not built")]
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("prop", sorted(PROPERTIES))
@pytest.mark.parametrize("device", [_device_param(n) for n in ("cpu", "cpu_numpy",
                                                                "cuda_emulated", "cuda")])
def test_property_holds_without_crashing(device, prop):
    report = _report(device)
    assert "error" not in report, report.get("error")
    result = report[prop]
    assert result["failure"] is None, result["failure"]
    outcomes = result["outcomes"]
    assert result["examples"] >= EXAMPLES, outcomes
    # Both sides of the limits were exercised: valid requests done and compared with the
    # model, and invalid ones refused.
    refused = sum(n for label, n in outcomes.items() if label != "ok")
    assert outcomes.get("ok", 0) >= 5 and refused >= 5, outcomes


ISSUE_CASES = textwrap.dedent('''
    import json
    import numpy as np
    import needle as ndl
    from needle.backend_ndarray import NDArray, cpu

    def attempt(fn):
        try:
            fn()
        except Exception as exc:
            return [type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc)]
        return ["ok", [], ""]

    live = NDArray(np.arange(4, dtype="float32"), device=cpu())
    a = NDArray(np.arange(12, dtype="float32"), device=cpu())
    b = NDArray(np.ones((2, 3), dtype="float32"), device=cpu())
    out = {
        "zeros": attempt(lambda: ndl.init.zeros(2**31, 2**31)),
        "broadcast_sum": attempt(
            lambda: ndl.broadcast_to(ndl.Tensor([[1.0]]), (2**31, 2**31)).sum()),
        "strided_2_61": attempt(lambda: a.as_strided((9,), (2**61,)).numpy()),
        "strided_2_62": attempt(lambda: a.as_strided((5,), (2**62,)).numpy()),
        "strided_matmul": attempt(lambda: a.as_strided((9, 2), (2**61, 1)) @ b),
    }
    out["live_array_intact"] = live.numpy().tolist()
    print("RESULT " + json.dumps(out))
''')


def test_the_reported_cases_raise_needle_errors_in_a_child():
    """The five crashes of the issue, each must raise a NeedleError naming op, shape, limit."""
    if not nd.cpu().enabled():
        pytest.skip("cpu() backend not built")
    proc = subprocess.run([sys.executable, "-c", ISSUE_CASES], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child {_death(proc.returncode)}\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out.pop("live_array_intact") == [0.0, 1.0, 2.0, 3.0]
    expected = {
        "zeros": ("SizeLimitError", "(2147483648, 2147483648)", "4611686018427387904 bytes"),
        "broadcast_sum": ("SizeLimitError", "(2147483648, 2147483648)",
                          "4611686018427387904 bytes"),
        "strided_2_61": ("IndexOutOfRange", "strides (2305843009213693952,)", "[0, 12)"),
        "strided_2_62": ("IndexOutOfRange", "strides (4611686018427387904,)", "[0, 12)"),
        "strided_matmul": ("IndexOutOfRange", "shape (9, 2)", "[0, 12)"),
    }
    for case, (name, shape, limit) in expected.items():
        got_name, mro, message = out[case]
        assert got_name == name and "NeedleError" in mro, (case, out[case])
        assert shape in message and limit in message, (case, message)
    assert out["zeros"][2].startswith("full: ") and out["broadcast_sum"][2].startswith("sum")
    assert all(out[c][2].startswith("as_strided: ") for c in expected if "strided" in c)
