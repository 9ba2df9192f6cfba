"""A disabled device answers attribute probes with AttributeError and still refuses any use.

pytest builds parametrize ids with ``getattr(value, "__name__", None)``: a device that raised
anything else there made a whole test file error at collection on a machine without CuPy.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import needle.backend_ndarray as nd
from needle._core.errors import BackendUnavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def disabled():
    return nd.BackendDevice("cuda", None)  # what cuda() is on a machine without CuPy


def test_attribute_probes_see_absent():
    dev = disabled()
    assert getattr(dev, "__name__", None) is None
    assert not hasattr(dev, "matmul") and not hasattr(dev, "__tile_size__")
    with pytest.raises(AttributeError, match=r"cuda\(\): backend is not available"):
        dev.Array  # noqa: B018 - the look-up is the test
    with pytest.raises(BackendUnavailable, match=r"looking up 'Array'"):
        dev.Array  # noqa: B018
    assert str(dev) == "cuda()" and not dev.enabled()


def test_using_a_disabled_device_still_raises():
    dev = disabled()
    for use in (lambda: nd.array([1.0], device=dev), lambda: dev.empty((2,)),
                lambda: dev.zeros(2), lambda: dev.randn(2), lambda: nd.full((2,), 1.0,
                                                                          device=dev)):
        with pytest.raises(BackendUnavailable, match=r"cuda\(\)"):
            use()


COLLECTED = textwrap.dedent('''
    import pytest
    import needle as ndl
    from needle.backend_ndarray import BackendDevice

    DEVICES = [ndl.cpu(), ndl.cuda(), BackendDevice("cuda", None)]

    @pytest.mark.parametrize("device", DEVICES)
    def test_each_device(device):
        if not device.enabled():
            pytest.skip("device not available")
        assert ndl.Tensor([1.0, 2.0], device=device).numpy().sum() == 3.0
''')


def test_parametrize_over_devices_collects_and_skips(tmp_path):
    """A real pytest run over [cpu(), cuda(), a disabled device]: no collection error."""
    path = tmp_path / "test_devices_generated.py"
    path.write_text(COLLECTED)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "error" not in out.lower(), out
    enabled = sum(d.enabled() for d in (nd.cpu(), nd.cuda()))
    assert f"{enabled} passed" in out and f"{3 - enabled} skipped" in out, out
