"""Shared fixtures: the ``device`` fixture runs a test on every available backend."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import needle.backend_ndarray as nd  # noqa: E402

DEVICE_NAMES = ["cpu_numpy", "cpu", "cuda"]


def _device_param(name):
    dev = nd.device_by_name(name)
    marks = [pytest.mark.cuda] if name == "cuda" else []
    if not dev.enabled():
        reason = f"{name}() backend not available here"
        if name == "cpu":
            # The compiled CPU backend is part of every install: its absence is a failure
            # unless the run says explicitly that it is building without it.
            if os.environ.get("NEEDLE_ALLOW_NO_CPU_BACKEND") != "1":
                return pytest.param(dev, id=name, marks=marks)
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(dev, id=name, marks=marks)


@pytest.fixture(params=[_device_param(n) for n in DEVICE_NAMES])
def device(request):
    """Each backend device: cpu_numpy (reference), cpu (C++), cuda (when present)."""
    return request.param


@pytest.fixture(scope="module")
def emulated_cuda():
    """A ``cuda()`` device whose kernels run on the host through the CUDA emulator.

    The .cu sources are compiled with g++ behind a shim of the CUDA built-ins (see
    ``backend_ndarray/_cuda_emulator.py``), so layers above the backend (autograd, nn,
    distributed strategies) can be tested on cuda() tensors without a GPU. Slow per kernel:
    keep tensors tiny. Skips when g++ is missing.
    """
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "backend_ndarray", "_cuda_emulator.py")
    spec = importlib.util.spec_from_file_location("_needle_cuda_emulator", path)
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    if not emulator.compiler_available():
        pytest.skip("g++ not found: no CUDA emulator")
    from needle.backend_ndarray import ndarray_backend_cuda as backend
    from needle.backend_ndarray._cuda import runtime
    from needle.memory import registry

    # Tests under the emulator install and remove allocators of their own under the name
    # "cuda": on a machine with a GPU the real device's allocator is put back afterwards.
    saved_allocator = registry._ALLOCATORS.get("cuda")
    saved = (runtime._cupy, runtime._reason, runtime._allocator)
    caches = (runtime._modules, runtime._functions, runtime._num_sms)
    saved_caches = [dict(c) for c in caches]
    runtime._cupy, runtime._reason, runtime._allocator = emulator.FakeCupy(num_sms=2), None, None
    for cache in caches:
        cache.clear()
    yield nd.BackendDevice("cuda", backend)
    try:
        backend.check_pending()  # label checks of emulated launches: not the real device's
    finally:
        runtime._cupy, runtime._reason, runtime._allocator = saved
        registry._ALLOCATORS.pop("cuda", None)
        if saved_allocator is not None:
            registry.register_allocator("cuda", saved_allocator)
        for cache, old in zip(caches, saved_caches, strict=True):
            cache.clear()
            cache.update(old)


# Tests under these folders count bytes on deliberately small tensors: let autograd release
# unsaved outputs of every size there (the default skips those under RELEASE_MIN_ELEMENTS to
# keep small models fast; python_tests/autograd/test_release.py checks that threshold itself).
_RELEASE_EVERY_SIZE = {"checkpoint", "memory"}


@pytest.fixture(autouse=True)
def _release_every_size(request, monkeypatch):
    if request.node.path.parent.name in _RELEASE_EVERY_SIZE:
        from needle.autograd import release

        monkeypatch.setattr(release, "RELEASE_MIN_ELEMENTS", 0)


# Every process a test starts (a launcher, mpiexec, Hydra's proxies, the ranks, a helper
# script) inherits this variable; whatever still carries it when the test ends is killed,
# pass or fail. Processes are found through /proc, so one that was reparented after its
# parent died (a launcher killed by a timeout leaves mpiexec to init) is found too.
_PROCESS_TOKEN = "NEEDLE_TEST_PROCESS_TOKEN"


def _processes_carrying(token: bytes) -> list[int]:
    """pids (other than ours) of live, non-zombie processes whose environment holds ``token``."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found  # no procfs (not Linux): nothing to find
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if token not in f.read():
                    continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state != "Z":
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test(monkeypatch):
    import signal
    import uuid

    token = uuid.uuid4().hex
    monkeypatch.setenv(_PROCESS_TOKEN, token)
    yield
    needle = f"{_PROCESS_TOKEN}={token}".encode()
    for _ in range(5):  # a process may fork while the previous round kills
        left = _processes_carrying(needle)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
