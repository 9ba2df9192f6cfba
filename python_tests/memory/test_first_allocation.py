"""Categories and events are exact from the first allocation, whatever the call order.

Each case runs in a fresh interpreter: the bug was in what happens before anything has asked
needle.memory about the ``cpu()`` device, which an earlier test in this process would hide.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

try:
    from needle.backend_ndarray import ndarray_backend_cpu  # noqa: F401
except ImportError:  # pragma: no cover - depends on the build
    pytest.skip("compiled module ndarray_backend_cpu is missing", allow_module_level=True)


def _fresh(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


LINEAR_THEN_STATS = """
import json
import needle as ndl
from needle import nn
layer = nn.Linear(1024, 1024, device=ndl.cpu())   # 4 MiB weight + 4 KiB bias
s = ndl.memory.stats(ndl.cpu())["by_category"]
print(json.dumps({c: r["current"] for c, r in s.items()}))
"""


@pytest.mark.parametrize("device", ["cpu", "cpu_numpy"])
def test_weights_made_before_any_stats_call_are_weights(device):
    got = _fresh(LINEAR_THEN_STATS.replace("ndl.cpu()", f"ndl.{device}()"))
    # 1024*1024*4 bytes is a whole number of 512 B blocks; the 4096 B bias too
    assert got["weight"] == 1024 * 1024 * 4 + 1024 * 4
    assert got["other"] == 0


RECORD_FIRST = """
import json
import needle as ndl
from needle import nn
with ndl.memory.record() as events:
    layer = nn.Linear(64, 64, device=ndl.cpu())
live = {}
for e in events:
    if e.kind == "alloc":
        live[e.block] = e.category
    elif e.kind == "free":
        live.pop(e.block)
    else:
        live[e.block] = e.category
print(json.dumps({"n": len(events), "cpu": all(e.device == "cpu" for e in events),
                  "live": sorted(live.values()),
                  "stats": ndl.memory.stats(ndl.cpu())["by_category"]["weight"]["current"]}))
"""


def test_record_opened_before_anything_touched_cpu_sees_its_events():
    got = _fresh(RECORD_FIRST)
    assert got["n"] > 0 and got["cpu"]
    # what the events leave alive is exactly the two parameters, as weights
    assert got["live"] == ["weight", "weight"]
    assert got["stats"] == 64 * 64 * 4 + 512  # the bias (256 B) takes one 512 B block
