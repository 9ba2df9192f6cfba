"""These tests count bytes on deliberately small tensors: let autograd release unsaved outputs
of every size (the default skips those under RELEASE_MIN_ELEMENTS to keep small models fast;
python_tests/autograd/test_release.py checks that threshold itself)."""
from __future__ import annotations

import pytest

from needle.autograd import release


@pytest.fixture(autouse=True)
def _release_every_size(monkeypatch):
    monkeypatch.setattr(release, "RELEASE_MIN_ELEMENTS", 0)
