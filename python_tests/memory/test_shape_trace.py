"""The shape-only trace predicts activations and kernel scratch; the check fails a wrong one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import needle as ndl
import needle.memory as mem
from apps.mlp_resnet import MLPResNet
from needle import nn, optim
from needle._core.errors import DeviceError, MemoryArgumentError
from needle.memory.caching_allocator import CachingAllocator
from needle.memory.kernel_scratch import CppScratch
from needle.memory.ledger import estimate
from needle.memory.reconcile import reconcile_step
from needle.memory.report import training_step_report
from needle.memory.shape_trace import ShapeArray, predict_step

DEV = ndl.cpu_numpy()
CPU = ndl.cpu()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACED_ROWS = ("gradient", "activation (end of forward)", "activation (peak)", "other")


def builder(model_name, optimizer, device, batch=32):
    def build():
        np.random.seed(0)
        if model_name == "mlp_resnet":
            model = MLPResNet(48, hidden_dim=32, num_blocks=2, num_classes=10, device=device)
        else:
            model = nn.Sequential(nn.Linear(48, 64, device=device), nn.ReLU(),
                                  nn.Linear(64, 10, device=device))
        opt = (optim.Adam(model.parameters()) if optimizer == "adam"
               else optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        x = ndl.Tensor(np.random.rand(batch, 48), device=device, requires_grad=False)
        y = ndl.Tensor(np.random.randint(0, 10, batch), device=device, requires_grad=False)
        return model, nn.SoftmaxLoss(), opt, x, y
    return build


CASES = [("mlp_resnet", "adam", DEV), ("mlp", "sgd_momentum", DEV)]
if CPU.enabled():
    CASES += [("mlp_resnet", "adam", CPU), ("mlp", "sgd_momentum", CPU)]


@pytest.mark.parametrize("model_name,optimizer,device", CASES, ids=str)
def test_predicted_equals_measured_within_rounding(model_name, optimizer, device):
    build = builder(model_name, optimizer, device)
    before = mem.stats(device)["num_allocs"]
    prediction = predict_step(build, device)
    assert mem.stats(device)["num_allocs"] == before  # nothing was allocated on the device
    rec = training_step_report(*build(), optimizer_name=optimizer,
                               prediction=prediction).reconciliation
    for name in TRACED_ROWS:
        row = rec.row(name)  # every block in the small pool: the rounding tolerance is 0
        assert (row.gap, row.tolerance, row.status) == (0, 0, "ok"), str(rec)
    assert rec.row("activation (end of forward)").predicted == prediction.held("activation")
    ws = rec.row("workspace")
    if device == DEV:  # the NumPy backend takes no scratch from needle's allocator
        assert (ws.predicted, ws.measured, ws.status) == (0, 0, "ok")
    elif ws.checked:  # cpu: exact, unless this process's matmuls left packing buffers
        assert ws.gap == 0 and ws.predicted > 0
    else:
        assert "held before the step" in ws.gap_terms[0][0]
    assert rec.ok


@pytest.mark.parametrize("device", [DEV] + ([CPU] if CPU.enabled() else []), ids=str)
def test_the_prediction_leaves_the_real_step_and_the_generators_as_they_were(device):
    build = builder("mlp_resnet", "adam", device)

    def step(predict_first):
        if predict_first:
            predict_step(build, device)
        model, loss_fn, opt, x, y = build()
        loss_fn(model(x), y).backward()
        opt.step()
        return [p.numpy() for p in model.parameters()]

    for alone, after in zip(step(False), step(True), strict=True):
        assert (alone == after).all()  # bit for bit: no kernel of the trace stayed in use
    np.random.seed(1)
    predict_step(build, device)
    drawn = np.random.rand()
    np.random.seed(1)
    assert drawn == np.random.rand()  # the trace's draws did not advance the generator


def test_saved_tensors_have_shapes_producers_and_lifetimes():
    p = predict_step(builder("mlp", "sgd", DEV, batch=8), DEV)
    # what backward reads (all unsaved outputs released in these tests, conftest): the ReLU
    # output, the last product, SoftmaxCrossEntropy's lse and the loss itself
    assert [(s.shape, s.producer, s.block) for s in p.saved] == [
        ((8, 64), "ReLU", 2048), ((8, 10), "FusedLinear", 512),
        ((8,), "SoftmaxCrossEntropy", 512), ((), "SoftmaxCrossEntropy", 512)]
    forward_end = max(s.created for s in p.saved)
    for s in p.saved:  # made in forward, freed by backward
        assert s.freed is not None and s.freed > forward_end
    assert p.held("activation") == sum(s.block for s in p.saved) == 3584
    for t in p.graph.tensors:
        assert t.def_index <= t.last_use
    assert {t.kind for t in p.graph.tensors} >= {"parameter", "intermediate", "output"}


def test_a_planted_missing_saved_tensor_fails_the_check():
    """Drop the largest saved tensor from the trace: the activation rows must fail. The former
    check (prediction = the declared saves, tolerance = the measured bytes held beyond them)
    passed any prediction, this one included."""
    build = builder("mlp_resnet", "adam", DEV)
    planted = predict_step(build, DEV, drop_saved=1)
    dropped = max(s.block for s in planted.saved)
    rec = training_step_report(*build(), optimizer_name="adam",
                               prediction=planted).reconciliation
    held = rec.row("activation (end of forward)")
    assert held.gap == dropped == 32 * 32 * 4 and held.tolerance == 0
    assert held.status == "OUT OF TOLERANCE" and not rec.ok
    # the former row: prediction = the declared saves, tolerance = the measured bytes held
    # beyond them; its gap equalled its tolerance by construction, so it "held" here too
    old_prediction = sum(s.block for s in planted.saved) - dropped
    old_tolerance = held.measured - old_prediction
    assert held.measured - old_prediction == old_tolerance > 0


def _reconcile(prediction, activation_held, activation_peak):
    def cats(current, peak=None):
        rows = {c: {"current": 0, "peak": 0} for c in mem.CATEGORIES}
        rows["activation"] = {"current": current, "peak": current if peak is None else peak}
        return {"by_category": rows}
    return reconcile_step(
        ledger=estimate(num_params=0, optimizer="sgd", margin=0), param_bytes=[],
        optimizer="sgd", first_step=True, weight_decay=False, largest_activation=0,
        seed_bytes=4, start=cats(0), held=cats(activation_held)["by_category"],
        end=cats(0, activation_peak), prediction=prediction)


def test_the_tolerance_does_not_come_from_the_measurement():
    p = predict_step(builder("mlp", "sgd", DEV, batch=8), DEV)
    right = _reconcile(p, p.held(), p.peak("activation"))
    wrong = _reconcile(p, p.held() + 512, p.peak("activation") + 512)
    for name in ("activation (end of forward)", "activation (peak)"):
        assert right.row(name).tolerance == wrong.row(name).tolerance == 0
        assert right.row(name).ok and not wrong.row(name).ok
        assert right.row(name).predicted == wrong.row(name).predicted


SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from python_tests.memory.test_shape_trace import builder
import needle as ndl
from needle.memory.report import training_step_report
from needle.memory.shape_trace import predict_step
build = builder("mlp_resnet", "adam", ndl.cpu(), batch=128)
right = predict_step(build, "cpu")
half = predict_step(build, "cpu", scratch_scale={"matmul_strided": 0.5})
rec = training_step_report(*build(), optimizer_name="adam", prediction=half).reconciliation
ws = rec.row("workspace")
print(json.dumps([right.peak("workspace"), half.peak("workspace"), ws.predicted, ws.measured,
                  ws.status, rec.ok]))
"""


@pytest.mark.skipif(not CPU.enabled(), reason="needs the compiled cpu() backend")
def test_a_planted_half_scratch_fails_the_workspace_check_in_a_fresh_process():
    """A fresh process: no packing buffer exists before the measured step, so the workspace
    row is checked; the trace predicts the matmul's scratch at half its size and must fail."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, ROOT], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    right, half, predicted, measured, status, ok = json.loads(proc.stdout.splitlines()[-1])
    assert predicted == half < right == measured  # the right prediction is the measurement
    assert status == "OUT OF TOLERANCE" and not ok


def test_the_cpu_matmul_scratch_model():
    s = CppScratch("avx512", threads=2, min_flops=2e6)
    assert s.requests("matmul", "float32", 1, 784, 100, (784, 1), (100, 1)) == []  # gemv
    # below the parallel threshold: one thread; B (24 KiB) read in place, A packed
    assert s.requests("matmul", "float32", 32, 48, 128, (48, 1), (128, 1)) == [
        (0, "a", 48 * 36 * 4)]
    # few rows, many columns, B too large to read in place: each thread packs its own
    # columns of B (8 panels of 32) and A whole, K in two blocks of 192
    assert s.requests("matmul", "float32", 100, 320, 10000, (320, 1), (10000, 1)) == [
        (0, "a", 2 * 192 * 108 * 4), (0, "b", 192 * 256 * 4),
        (1, "a", 2 * 192 * 108 * 4), (1, "b", 192 * 256 * 4)]
    alloc = CachingAllocator("scratch test")
    out = ShapeArray(alloc, 4 * 4, "float16", 0)
    s.call("matmul", (out, out, out, 4, 4, 4), alloc)  # float16: one float32 transient
    ws = alloc.stats()["by_category"]["workspace"]
    # K = 4 by one 12-row panel of A, kept; the transient (48 floats) gone after the call
    assert s.log == [("matmul", 0, "a", 4 * 12 * 4)]
    assert (ws["peak"], ws["current"]) == (512 + 512, 512)
    s.call("conv2d_forward", (out,), alloc)
    assert s.unmodelled == {"conv2d_forward"}
    with pytest.raises(MemoryArgumentError, match="kernel scratch: unknown instruction set, "
                                                  "expected one of .*got 'sse9'"):
        CppScratch("sse9", 1, 1e6)


@pytest.mark.skipif(not CPU.enabled(), reason="needs the compiled cpu() backend")
def test_convolution_scratch_is_reported_as_not_predicted():
    def build():
        np.random.seed(0)
        model = nn.Sequential(nn.Conv(3, 4, 3, device=CPU), nn.ReLU(), nn.Flatten(),
                              nn.Linear(4 * 6 * 6, 2, device=CPU))
        x = ndl.Tensor(np.random.rand(2, 3, 6, 6), device=CPU, requires_grad=False)
        y = ndl.Tensor(np.zeros(2), device=CPU, requires_grad=False)
        return model, nn.SoftmaxLoss(), optim.SGD(model.parameters()), x, y

    rec = training_step_report(*build(), optimizer_name="sgd", build=build).reconciliation
    ws = rec.row("workspace")
    assert ws.status == "not predicted" and "conv2d" in ws.gap_terms[0][0]
    assert "not predicted" in ws.line() and rec.unpredicted == ("workspace",)
    for name in TRACED_ROWS:  # the activations of a convolution are still exact
        assert rec.row(name).gap == 0


def test_bad_input_names_the_call():
    with pytest.raises(MemoryArgumentError, match=r"predict_step: expected build\(\) to "
                                                  r"return .*got tuple of 2"):
        predict_step(lambda: (1, 2), DEV)
    with pytest.raises(MemoryArgumentError, match="predict_step: expected build, a callable"):
        predict_step(None, DEV)
    with pytest.raises(DeviceError, match="unknown device"):
        predict_step(builder("mlp", "sgd", DEV), "tpu")
