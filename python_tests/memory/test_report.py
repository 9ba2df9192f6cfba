"""The ledger beside a real training step, the CLI, leaks, and the C++ allocator adapter."""
from __future__ import annotations

import math

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from needle import nn, optim
from needle._core.errors import BackendUnavailable
from needle.memory import __main__ as cli
from needle.memory import cpp_adapter
from needle.memory.caching_allocator import CachingAllocator, round_size
from needle.memory.report import saved_activation_bytes, training_step_report

DEV = ndl.cpu_numpy()


def mlp(seed=0, width=32):
    np.random.seed(seed)
    return nn.Sequential(nn.Linear(16, width, device=DEV), nn.ReLU(),
                         nn.Linear(width, 4, device=DEV))


def batch(n=8):
    rng = np.random.default_rng(0)
    x = ndl.Tensor(rng.standard_normal((n, 16)), device=DEV, requires_grad=False)
    y = ndl.Tensor(rng.integers(0, 4, n), device=DEV, requires_grad=False)
    return x, y


def test_saved_activation_bytes_counts_each_buffer_once_and_skips_leaves():
    model = mlp()
    x, _ = batch()
    loss = model(x).sum()
    # relu (8, 32), saved by ReLU and the second matmul; the last +b2 (8, 4), still named
    # by the caller when the sum was recorded; the sum: one float. x@W1, +b1 and r@W2 were
    # released (no op saves them); the broadcast bias views belong to the parameters.
    assert saved_activation_bytes(loss) == 4 * (8 * 32 + 8 * 4 + 1)


def _optimizer(name, params):
    if name == "adam":
        return optim.Adam(params)
    return optim.SGD(params, lr=0.1, momentum=0.9 if name == "sgd_momentum" else 0.0)


DEVICES = [DEV] + ([ndl.cpu()] if ndl.cpu().enabled() else [])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("name", ["adam", "sgd", "sgd_momentum"])
def test_every_row_reconciles_a_real_training_step(name, device, fused, monkeypatch):
    if not fused:  # the update as separate kernels, as on a backend without ewise_program
        from needle.backend_ndarray import ewise_program
        monkeypatch.setattr(ewise_program, "available", lambda arrays: False)

    def build():
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(16, 64, device=device), nn.ReLU(),
                              nn.Linear(64, 64, device=device), nn.ReLU(),
                              nn.Linear(64, 4, device=device))
        rng = np.random.default_rng(0)
        x = ndl.Tensor(rng.standard_normal((32, 16)), device=device, requires_grad=False)
        y = ndl.Tensor(rng.integers(0, 4, 32), device=device, requires_grad=False)
        return model, nn.SoftmaxLoss(), _optimizer(name, model.parameters()), x, y

    model, loss_fn, opt, x, y = build()
    params = model.parameters()
    sizes = [round_size(math.prod(p.shape) * 4) for p in params]
    largest = max(sizes)
    k = {"adam": 2, "sgd": 0, "sgd_momentum": 1}[name]
    for step in (1, 2):  # the first step creates the optimizer state, the second replaces it
        rec = training_step_report(model, loss_fn, opt, x, y, optimizer_name=name,
                                   build=build).reconciliation
        # predictions checked against numbers written here from the shapes and the rules
        # fused updates run in place: no new θ or moment beside the old one
        assert rec.row("weight").predicted == sum(sizes) + (0 if fused else largest)
        state = k * sum(sizes) + (largest if k and step == 2 and not fused else 0)
        assert rec.row("optimizer").predicted == state
        temps = {"adam": 3, "sgd": 1, "sgd_momentum": 1 if step == 1 else 3}[name]
        # fused: one ewise_program per parameter (both devices have it), no temporaries
        assert rec.row("optimizer_temp").predicted == (0 if fused else temps * largest)
        # every block is in the small pool: the shape-only trace's rows are exact too
        for row in ("weight", "optimizer", "optimizer_temp", "gradient",
                    "activation (end of forward)", "activation (peak)", "other"):
            assert rec.row(row).gap == 0 and rec.row(row).tolerance == 0, (step, str(rec))
        # held at the end of forward (every unsaved output released here, conftest): the two
        # ReLU outputs (32, 64), the last layer's (32, 4), the loss's lse and the loss
        assert rec.row("activation (end of forward)").predicted == 2 * 8192 + 3 * 512
        ws = rec.row("workspace")
        if device == DEV:
            assert (ws.predicted, ws.gap, ws.tolerance) == (0, 0, 0)
        else:  # kernel scratch predicted exactly unless packing buffers exist from before
            assert ws.gap == 0 if ws.checked else "held before the step" in ws.gap_terms[0][0]
        assert rec.ok, str(rec)


def test_the_reconciliation_fails_a_planted_lie():
    """A row whose prediction misses a term is reported as out of tolerance."""
    from needle.memory.reconcile import ReconRow

    row = ReconRow("optimizer", "optimizer", "peak", 800, (("moments", 800),), 1024, (), 0)
    assert not row.ok and "OUT OF TOLERANCE" in row.line()


def test_ledger_compare_on_a_real_training_step():
    model = mlp()
    params = model.parameters()
    opt = optim.SGD(params, lr=0.1)
    x, y = batch()
    r = training_step_report(model, nn.SoftmaxLoss(), opt, x, y, optimizer_name="sgd")
    n = sum(math.prod(p.shape) for p in params)
    rounded = sum(round_size(math.prod(p.shape) * 4) for p in params)
    w = r.comparison.row("weight")
    # the fused SGD update rewrites each θ in place: no second copy of the largest one
    assert (w.estimated, w.measured_peak) == (4 * n, rounded)
    for row in r.comparison.rows[:7]:
        assert row.difference == row.rounding + row.residual == row.measured_peak - row.estimated
    assert r.comparison.row("peak (all at once)").measured_peak == r.stats["peak_bytes"]


SCRIPT = """
import sys
import numpy as np
import needle as ndl
from needle import nn
d = ndl.cpu_numpy()
np.random.seed(0)
model = nn.Sequential(nn.Linear(16, 64, device=d), nn.ReLU(), nn.Linear(64, 4, device=d))
loss = model(ndl.Tensor(np.ones((8, 16)), device=d, requires_grad=False)).sum()
loss.backward()
print("args", sys.argv[1:])
sys.exit(int(sys.argv[-1]))
"""


def test_cli_report_runs_a_users_script_and_reports_its_categories(tmp_path, capsys):
    script = tmp_path / "step.py"
    script.write_text(SCRIPT)
    png = tmp_path / "step.png"
    rc = cli.main(["report", "--plot", str(png), str(script), "--flag", "0"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "args ['--flag', '0']" in out  # the script saw its own arguments
    assert "device cpu_numpy" in out
    table = out[out.index("device cpu_numpy"):].split("\ndevice ")[0]
    rows = {line.split()[0]: float(line.split()[1]) for line in table.splitlines()
            if line.strip() and line.split()[0] in mem.CATEGORIES}
    # weights (16*64 + 64 + 64*4 + 4 floats) and their gradients were allocated
    assert rows["weight"] > 0 and rows["gradient"] > 0 and rows["activation"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_report_passes_the_scripts_exit_code_and_points_old_flags_to_apps(tmp_path,
                                                                                capsys):
    script = tmp_path / "step.py"
    script.write_text(SCRIPT)
    assert cli.main(["report", str(script), "3"]) == 3
    assert cli.main(["report", "--model", "mlp"]) == 2
    assert "apps/memory_report.py --model mlp" in capsys.readouterr().err


def test_no_leak_after_1000_steps():  # ~2 s
    model = mlp(width=16)
    params = model.parameters()
    opt = optim.Adam(params, lr=1e-3)
    x, y = batch(4)
    loss_fn = nn.SoftmaxLoss()

    def step():
        opt.reset_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    step()
    first = mem.stats(DEV)
    for _ in range(999):
        step()
    last = mem.stats(DEV)
    assert last["allocated_bytes"] == first["allocated_bytes"]
    for c in mem.CATEGORIES:
        assert last["by_category"][c]["current"] == first["by_category"][c]["current"], c
    assert last["num_segment_allocs"] == first["num_segment_allocs"]  # all reuse, no growth


class FakeCpuModule:
    """The pybind API docs/memory.md asks of ndarray_backend_cpu, in Python."""

    class Array:
        def __init__(self, nbytes):
            self.nbytes = nbytes

    def __init__(self):
        self.inner = CachingAllocator("cpu")
        self.resolver = None
        self.blocks = {}

    def allocator_set_category_resolver(self, fn):
        self.resolver = fn

    def new_array(self, nbytes):
        arr = self.Array(nbytes)
        self.blocks[id(arr)] = self.inner.allocate(nbytes, category=self.resolver(None))
        return arr

    def allocator_stats(self):
        return self.inner.stats()

    def allocator_reset_peak(self):
        self.inner.reset_peak()

    def allocator_empty_cache(self):
        return self.inner.empty_cache()

    def allocator_retag(self, arr, category):
        self.inner.retag(self.blocks[id(arr)], category)


def test_cpp_adapter_over_the_requested_api():
    mod = FakeCpuModule()
    adapter = cpp_adapter.make_adapter(mod)
    with mem.category("optimizer"):
        a = mod.new_array(1000)
    b = mod.new_array(10)
    adapter.retag(b, "weight")
    s = adapter.stats()
    assert s["device"] == "cpu" and s["allocated_bytes"] == 1024 + 512
    assert s["by_category"]["optimizer"]["current"] == 1024
    assert s["by_category"]["weight"]["current"] == 512
    assert mod.resolver is mem.categories.resolve
    del a, b


def test_cpp_adapter_refuses_a_module_without_statistics():
    with pytest.raises(BackendUnavailable, match="allocator_retag"):
        cpp_adapter.make_adapter(type("M", (), {"allocator_stats": 1})())
    with pytest.raises(BackendUnavailable, match="not available"):
        cpp_adapter.make_adapter(None)
