"""needle.memory.profile: the report of any script, its timeline, and why-OOM messages."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle import nn, optim
from needle.memory import __main__ as cli
from needle.memory.caching_allocator import round_size

ROOT = Path(__file__).resolve().parents[2]
DEVICES = [ndl.cpu_numpy()] + ([ndl.cpu()] if ndl.cpu().enabled() else [])


def _step_fn(device, width=64):
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(32, width, device=device), nn.ReLU(),
                          nn.Linear(width, 10, device=device))
    opt = optim.Adam(model.parameters())
    x = ndl.Tensor(np.random.randn(16, 32), device=device, requires_grad=False)
    y = ndl.Tensor(np.random.randint(0, 10, 16), device=device, requires_grad=False)

    def step():
        opt.reset_grad()
        nn.SoftmaxLoss()(model(x), y).backward()
        opt.step()

    return model, step


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_report_reproduces_stats_and_the_live_set_sums_to_the_peak(device):
    _, step = _step_fn(device)
    step()  # the optimizer state exists: the second step is the steady one
    with mem.profile(device) as prof:
        step()
        step()
    stats = mem.stats(device)
    rep = prof.report()["devices"][device.name]
    for cat in mem.CATEGORIES:  # replayed from the events, compared with the counters
        assert rep["by_category"][cat]["peak"] == stats["by_category"][cat]["peak"], cat
        assert rep["by_category"][cat]["final"] == stats["by_category"][cat]["current"], cat
    assert rep["peak_bytes"] == stats["peak_bytes"]
    live = rep["peak"]["live"]
    assert sum(e["bytes"] for e in live) == stats["peak_bytes"]
    # every buffer allocated in the block knows its tensor; the op that made activations
    made = [e for e in live if e["allocated_at"] is not None and e["category"] != "workspace"]
    assert made and all(e["shape"] is not None and e["dtype"] == "float32" for e in made)
    acts = [e for e in made if e["category"] == "activation"]
    assert all(e["op"] and e["line"] for e in acts)
    # the steady Adam step updates θ and the moments in place: it allocates nothing, so no
    # optimizer band (the first step's, which makes the moments, is checked below)
    assert set(rep["phases"]) >= {"forward", "backward"} and "optimizer" not in rep["phases"]
    assert max(p["peak_bytes"] for p in rep["phases"].values()) == rep["peak_bytes"]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_a_weight_stays_a_weight_through_the_step_and_temporaries_are_their_own(fused,
                                                                               monkeypatch):
    if not fused:  # Adam's update as separate kernels (a backend without ewise_program)
        from needle.backend_ndarray import ewise_program
        monkeypatch.setattr(ewise_program, "available", lambda arrays: False)
    device = ndl.cpu_numpy()
    model, step = _step_fn(device)
    params = model.parameters()
    weights = sum(round_size(int(np.prod(p.shape)) * 4) for p in params)
    largest = max(round_size(int(np.prod(p.shape)) * 4) for p in params)
    step()
    with mem.profile(device) as prof:
        step()
    series = prof.report()["devices"]["cpu_numpy"]["timeline"]["series"]
    # never below the weights (never "moved" into the optimizer); the fused update rewrites
    # each θ in place, the composed one puts at most one parameter's new array beside its old
    assert min(series["weight"]) == weights
    assert max(series["weight"]) == weights + (0 if fused else largest)
    # Adam's three update temporaries; none when the update is one kernel per parameter
    assert max(series["optimizer_temp"]) == (0 if fused else 3 * largest)
    assert series["optimizer_temp"][-1] == 0


def test_timeline_json_has_labelled_axes_op_names_and_phase_bands(tmp_path):
    device = ndl.cpu_numpy()
    _, step = _step_fn(device)
    with mem.profile(device) as prof:
        step()
    paths = prof.save(tmp_path)
    data = json.loads(Path(paths["json"]).read_text())
    tl = data["devices"]["cpu_numpy"]["timeline"]
    assert tl["x_label"] == "allocator event (op order)" and "bytes" in tl["y_label"]
    assert len(tl["x"]) == len(tl["ops"]) == len(tl["time_s"]) == len(tl["series"]["weight"])
    assert {"FusedLinear", "ReLU", "FusedLinear.gradient", "Adam.step"} <= set(tl["ops"])
    assert [b["phase"] for b in tl["bands"] if b["phase"] != "other"][:3] == [
        "forward", "backward", "optimizer"]
    peak = tl["peak"]
    assert peak["bytes"] == data["devices"]["cpu_numpy"]["peak_bytes"]
    assert peak["top"] and all(t["op"] and t["bytes"] > 0 for t in peak["top"])
    assert Path(paths["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = Path(paths["html"]).read_text()
    assert "data:image/png;base64," in page and "http" not in page.replace(
        "needle memory profile", "")  # self-contained: nothing to fetch


SCRIPT = """
import sys
import numpy as np
import needle as ndl
from needle import nn
d = ndl.device_by_name(sys.argv[1]) if hasattr(ndl, "device_by_name") else ndl.cpu_numpy()
np.random.seed(0)
model = nn.Sequential(nn.Linear(16, 64, device=d), nn.ReLU(), nn.Linear(64, 4, device=d))
loss = model(ndl.Tensor(np.ones((8, 16)), device=d, requires_grad=False)).sum()
loss.backward()
sys.exit(int(sys.argv[-1]))
"""


def test_cli_profile_takes_options_before_the_script(tmp_path, capsys):
    script = tmp_path / "step.py"
    script.write_text(SCRIPT.replace("ndl.device_by_name(sys.argv[1]) if hasattr(ndl, "
                                     "\"device_by_name\") else ", ""))
    out = tmp_path / "prof"
    rc = cli.main(["profile", "--device", "cpu_numpy", "--out", str(out), str(script),
                   "--out", "3"])  # the script's own --out is the script's
    assert rc == 3
    assert {p.name for p in out.iterdir()} == {"memory.json", "memory.png", "memory.html"}
    data = json.loads((out / "memory.json").read_text())
    assert list(data["devices"]) == ["cpu_numpy"]
    assert "peak" in capsys.readouterr().out


@pytest.mark.slow
def test_profiling_apps_train_reproduces_stats_categories(tmp_path):
    """The real main job, profiled from the command line in a fresh process."""
    out = tmp_path / "prof"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "needle.memory", "profile", "--device", "cpu", "--out", str(out),
         str(ROOT / "apps" / "train.py"), "--epochs", "1", "--max-steps", "4", "--device", "cpu",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "memory.json").read_text())
    dev = data["devices"]["cpu"]
    stats = dev["stats_end"]  # ndl.memory.stats(cpu()) when the script ended
    # train.py resets the allocator's peaks before the steps it measures (summary.json's
    # memory.per_rank[r].peak), so the allocator's peaks at the end cover only the last
    # window, while the profile's cover the whole run: at least as high, and what is held
    # at the end is the same
    for cat in mem.CATEGORIES:
        assert dev["by_category"][cat]["peak"] >= stats["by_category"][cat]["peak"], cat
        assert dev["by_category"][cat]["final"] == stats["by_category"][cat]["current"], cat
    assert dev["peak_bytes"] >= stats["peak_bytes"]
    assert sum(e["bytes"] for e in dev["peak"]["live"]) == dev["peak_bytes"]
    assert dev["by_category"]["weight"]["peak"] > 0 and dev["phases"]["optimizer"]["events"]
    assert (tmp_path / "run" / "summary.json").exists()  # the script really ran


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_planted_limit_names_the_culprit_tensor_and_its_op(device):
    np.random.seed(0)
    gc.collect()  # an earlier test's error may still hold its tensors through a traceback
    mem.empty_cache(device)  # no cached block left by earlier tests may serve the request
    a = ndl.Tensor(np.random.randn(1024, 64), device=device)
    w = ndl.Tensor(np.random.randn(64, 2048), device=device)
    culprit = a @ w                   # 8 MiB: the largest tensor alive
    mem.empty_cache(device)
    reserved = mem.stats(device)["reserved_bytes"]
    with mem.oom.limit(reserved, device):  # nothing more may be reserved
        with pytest.raises(ndl.OutOfMemoryError) as info:
            culprit * 2               # another 8 MiB: refused
    err = info.value
    assert isinstance(err, ndl.NeedleError) and isinstance(err, MemoryError)
    text = str(err)
    assert "cannot allocate 8,388,608 bytes" in text
    named = [(t["bytes"], t["op"], tuple(t["shape"])) for t in err.details["largest"]
             if t["shape"] is not None]  # (kernel scratch has no tensor and no shape)
    assert named[0] == (8 * 2**20, "MatMul", (1024, 2048))
    assert "8,388,608 B activation float32 (1024, 2048) made by MatMul" in text
    assert err.details["live_by_category"]["activation"] >= 8 * 2**20
    assert f"expected at most the limit of {reserved:,} B" in text
    del culprit


def test_oom_inside_a_profile_names_the_python_line(tmp_path):
    device = ndl.cpu_numpy()
    gc.collect()  # an earlier test's error may still hold its tensors through a traceback
    mem.empty_cache(device)  # no cached block left by earlier tests may serve the request
    x = ndl.Tensor(np.ones((1024, 64)), device=device)
    with mem.profile(device):
        big = x @ ndl.Tensor(np.ones((64, 1024)), device=device)  # the culprit's line
        mem.empty_cache(device)
        with mem.oom.limit(mem.stats(device)["reserved_bytes"], device):
            with pytest.raises(ndl.OutOfMemoryError) as info:
                big + 1
    top = info.value.details["largest"][0]
    assert top["op"] == "MatMul" and "test_profile.py:" in top["line"]
    assert f"made by MatMul at {top['line']}" in str(info.value)
    del big


def test_set_limit_validates_and_restores():
    with pytest.raises(ndl.NeedleError, match="set_limit: bad limit"):
        mem.set_limit(-1, "cpu_numpy")
    assert mem.set_limit(10 * 2**30, "cpu_numpy") is None
    assert mem.get_limit("cpu_numpy") == 10 * 2**30
    assert mem.set_limit(None, "cpu_numpy") == 10 * 2**30


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_explain_lists_the_lifetimes_overlapping_at_the_peak(device):
    model, step = _step_fn(device)
    step()
    e = mem.explain(step, device=device)
    stats = mem.stats(device)
    assert e.measured_peak_bytes == stats["peak_bytes"]
    # the lifetimes account for every requested byte the allocator counted
    assert e.liveness_bytes == e.measured_requested_bytes == stats["peak_requested_bytes"]
    assert e.planned_bytes >= e.liveness_bytes and e.arena_bytes > 0
    assert sum(r["requested"] for r in e.overlapping) <= e.liveness_bytes
    full = mem.explain(step, device=device, top=10**6)
    assert sum(r["requested"] for r in full.overlapping) == full.liveness_bytes
    made = [r for r in full.overlapping if r["start"] is not None]
    assert made and all(r["start"] <= full.peak_event < r["end"] for r in made)
    assert any(r["op"] == "Adam.step" for r in full.overlapping) or full.peak_phase != \
        "optimizer"
    text = str(e)
    assert "lifetimes overlapping at the peak" in text and "allocator rounding" in text


def test_profile_on_the_emulated_cuda_device(emulated_cuda):
    """cuda() buffers come from needle's caching allocator too: the profile knows them."""
    from needle.memory import registry
    from needle.memory.cuda_allocator import install_cuda_allocator

    backend = emulated_cuda.mod
    alloc = install_cuda_allocator(backend, backend.runtime.cupy_module().cuda.alloc)
    saved = registry._ALLOCATORS.get("cuda")
    registry.register_allocator("cuda", alloc)
    try:
        x = ndl.Tensor(np.ones((4, 8), np.float32), device=emulated_cuda)
        with mem.profile(emulated_cuda) as prof:
            y = (x * 2).sum()
            y.backward()
        rep = prof.report()["devices"]["cuda"]
        stats = mem.stats(emulated_cuda)
        for cat in mem.CATEGORIES:
            assert rep["by_category"][cat]["peak"] == stats["by_category"][cat]["peak"]
        assert sum(e["bytes"] for e in rep["peak"]["live"]) == stats["peak_bytes"]
        # tensors know their shape; the reduction's scratch (a bare backend Array) does not
        tensors = [e for e in rep["peak"]["live"] if e["requested"] == 4 * 8 * 4]
        assert tensors and all(e["shape"] == [4, 8] for e in tensors)
        assert {"MulScalar", "Summation", "MulScalar.gradient"} <= set(rep["timeline"]["ops"])
        del x, y
    finally:
        backend.set_allocator(None)
        if saved is None:
            registry.unregister_allocator("cuda")
        else:
            registry.register_allocator("cuda", saved)
