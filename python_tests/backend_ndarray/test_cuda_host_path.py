"""The host side of an eager op on cuda(): what needle's Python does per op, counted.

The CUDA backend runs against the emulator's fake CuPy with every kernel a no-op, under
needle's caching allocator (as ``bench/cuda_host_time.py`` does): no g++, no GPU. Counts of
Python frames and bytecodes are deterministic, unlike timings, so they can bound the per-op
cost; the statistics the fast paths keep must stay exact.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle.backend_ndarray import ndarray_backend_cuda as B
from needle.backend_ndarray._cuda import runtime
from needle.backend_ndarray.ewise_codes import BINARY, BINARY_OPS, LOAD, STORE
from needle.memory.cuda_allocator import install_cuda_allocator

NEEDLE_DIR = os.path.dirname(os.path.abspath(ndl.__file__))


def _noop_kernel(grid, block, args) -> None:
    pass


@pytest.fixture
def noop_cuda(monkeypatch):
    """A cuda() device on the fake CuPy with no-op kernels; yields (device, allocator)."""
    path = os.path.join(os.path.dirname(__file__), "_cuda_emulator.py")
    spec = importlib.util.spec_from_file_location("_needle_cuda_emulator_noop", path)
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    monkeypatch.setattr(runtime, "_cupy", emulator.FakeCupy(num_sms=2))
    monkeypatch.setattr(runtime, "_reason", None)
    monkeypatch.setattr(runtime, "_allocator", None)
    monkeypatch.setattr(runtime, "function", lambda source, name: _noop_kernel)
    monkeypatch.setattr(runtime, "_functions", {})
    alloc = install_cuda_allocator(B, runtime._cupy.cuda.alloc)
    yield nd.BackendDevice("cuda", B), alloc


def _count(fn) -> tuple[int, int]:
    """(Python frames, bytecodes) that code of the needle package runs during ``fn()``."""
    counts = [0, 0]

    def ours(code) -> bool:  # needle's files and the launcher's generated converters
        return code.co_filename.startswith(NEEDLE_DIR) or code.co_filename.startswith("<cuda")

    def trace(frame, event, arg):
        if event == "call":
            if not ours(frame.f_code):
                return None
            counts[0] += 1
            frame.f_trace_opcodes = True
        elif event == "opcode":
            counts[1] += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return counts[0], counts[1]


# Python frames of one eager elementwise op on two (4, 4) tensors, its result freed, by layer:
#   autograd: the operator or op function, TensorOp.__call__, make_from_op, the op's compute,
#             the release bookkeeping's track                                          5
#   NDArray:  the operator, _ewise, the shape check, _alloc                             4
#   buffer:   Array() (the C pair hands it a parked block: no frame)                    1
#   launch:   the backend kernel, runtime.launch, prepare, the plan's converter, one
#             ptr() per buffer (3)                                                      7
#   release:  the owner parks its block in C: no frame                                  0
# = 17-18; the bound leaves 4 for a scalar argument's or an op's own extra helper. With the
# pair in Python (owner, trusted allocate, category lookup; __del__, release): 26; before
# the launch plans, the trusted allocation and the written-out cut and coalescing: ~59.
FRAMES_PER_ELEMENTWISE_OP = 22
# Bytecodes: ~20 a frame for call, arguments and return (18 frames: ~360), plus the bodies
# that do work: the autograd node (~120), one launch's checks from its compiled plan (~60),
# Array's own (~60) = ~600. Checking every launch argument one by one in a loop (~30
# bytecodes an argument) costs more than the margin; with the pair in Python ~1,200 (its
# exact statistics ~250 a buffer), before the launch plans ~1,600.
BYTECODES_PER_ELEMENTWISE_OP = 700


@pytest.mark.parametrize("op", ["add", "mul_scalar", "relu"])
def test_an_eager_elementwise_op_stays_within_its_python_budget(noop_cuda, op):
    device, _ = noop_cuda
    x = ndl.Tensor(np.ones((4, 4), dtype=np.float32), device=device, requires_grad=True)
    y = ndl.Tensor(np.ones((4, 4), dtype=np.float32), device=device, requires_grad=True)
    run = {"add": lambda: x + y, "mul_scalar": lambda: x * 2.0,
           "relu": lambda: ndl.ops.relu(x)}[op]

    def once() -> None:
        run()  # the result is dropped here: its buffer goes back inside the count

    once()
    once()  # first launches build their plans: count a warm op
    frames, bytecodes = _count(once)
    assert frames <= FRAMES_PER_ELEMENTWISE_OP, (op, frames)
    assert bytecodes <= BYTECODES_PER_ELEMENTWISE_OP, (op, bytecodes)


def test_the_trusted_allocation_keeps_the_statistics_exact(noop_cuda):
    device, alloc = noop_cuda
    base = alloc.stats()
    a = B.Array(1000)  # 4,000 bytes: a 4,096-byte block of the small pool
    b = B.Array(3, "float64")  # 24 bytes: a 512-byte block
    now = alloc.stats()
    assert now["allocated_bytes"] - base["allocated_bytes"] == 4096 + 512
    assert now["requested_bytes"] - base["requested_bytes"] == 4000 + 24
    assert now["num_allocs"] - base["num_allocs"] == 2
    assert now["by_category"]["other"]["current"] == 4096 + 512
    assert now["by_category"]["other"]["current_requested"] == 4000 + 24
    assert b.ptr() - a.ptr() == 4096  # cut one after the other from the same segment
    del a, b
    after = alloc.stats()
    assert after["allocated_bytes"] == base["allocated_bytes"]
    assert after["requested_bytes"] == base["requested_bytes"]
    assert after["num_frees"] - base["num_frees"] == 2
    assert after["by_category"]["other"]["current"] == 0
    assert after["by_category"]["other"]["peak"] == 4096 + 512
    assert after["by_category"]["other"]["peak_requested"] == 4000 + 24


def test_with_a_category_the_trusted_allocation_follows_it(noop_cuda):
    _, alloc = noop_cuda
    with ndl.memory.category("activation"):
        a = B.Array(256)
    assert alloc.stats()["by_category"]["activation"]["current"] == 1024
    del a
    assert alloc.stats()["by_category"]["activation"]["current"] == 0


def _program(store_reads_input_after: bool) -> list:
    # out0 = in0 - in1; with the flag, out1 = in0 loaded again after out0 was stored
    code = [LOAD, 0, 0, 0, 0, LOAD, 0, 1, 1, 0, BINARY, BINARY_OPS["sub"], 2, 0, 1,
            STORE, 0, 0, 2, 0]
    if store_reads_input_after:
        code += [LOAD, 0, 3, 0, 0, STORE, 0, 1, 3, 0]
    return code


def test_an_in_place_program_is_checked_every_time_its_pair_is_new(noop_cuda):
    theta, grad, other = B.Array(8), B.Array(8), B.Array(8)
    good = _program(False)
    for _ in range(2):  # accepted, and again from the cache
        B.ewise_program([theta, grad], [theta], good, [], 8)
    bad = _program(True)
    for _ in range(2):  # refused both times: a refusal is never cached as an acceptance
        with pytest.raises(ValueError, match="reads that input after storing"):
            B.ewise_program([theta, grad], [theta, other], bad, [], 8)
    # output 0 in the buffer of input 1 is fine (input 1 is only read before the store) ...
    B.ewise_program([theta, grad], [grad, other], bad, [], 8)
    # ... and that accepted pair (1, 0) does not vouch for the pair (0, 0) of the same program
    with pytest.raises(ValueError, match="reads that input after storing"):
        B.ewise_program([theta, grad], [theta, other], bad, [], 8)


def test_an_accepted_sharing_pattern_vouches_for_nothing_else(noop_cuda):
    """The pattern check is cached per program: what it caches must not let through outputs
    that share a buffer, nor an input given twice."""
    theta, grad, other = B.Array(8), B.Array(8), B.Array(8)
    bad = _program(True)
    B.ewise_program([theta, grad], [grad, other], bad, [], 8)  # output 0 over input 1: fine
    B.ewise_program([theta, grad], [other, B.Array(8)], bad, [], 8)  # none shared
    with pytest.raises(ValueError, match="two outputs share a buffer"):
        B.ewise_program([theta, grad], [other, other], bad, [], 8)
    # one buffer as both inputs: output 0 over "input 1" (the pattern accepted above) is over
    # input 0 as well, which the program reads after the store; checked every time
    for _ in range(2):
        with pytest.raises(ValueError, match="reads that input after storing"):
            B.ewise_program([theta, theta], [theta, other], bad, [], 8)


# ---- a whole eager training step, counted -------------------------------------------------
def _resnet9_step(device, batch: int = 8):
    """One eager SGD step of the apps' ResNet9 on ``device`` (a closure, run it repeatedly)."""
    root = os.path.dirname(NEEDLE_DIR)
    sys.path.insert(0, os.path.join(root, "apps"))
    try:
        from models import ResNet9
    finally:
        sys.path.remove(os.path.join(root, "apps"))
    np.random.seed(0)
    model = ResNet9(device=device)
    x = ndl.Tensor(np.random.rand(batch, 3, 32, 32).astype(np.float32), device=device)
    y = ndl.Tensor(np.random.randint(0, 10, batch), device=device)
    loss_fn, opt = ndl.nn.SoftmaxLoss(), ndl.optim.SGD(model.parameters(), lr=0.01)
    model.train()

    def step() -> None:
        loss = loss_fn(model(x), y)
        opt.reset_grad()
        loss.backward()
        opt.step()

    return step


def _step_counts(step, alloc, monkeypatch) -> dict:
    """What one call of ``step`` asks of the device layer: buffers, parked reuses, new
    segments, kernel launches and CuPy arrays made."""
    counts = {"launches": 0, "cupy_arrays": 0}

    def kernel(grid, block, args) -> None:
        counts["launches"] += 1

    real_ndarray = runtime._cupy.ndarray

    def ndarray(*args, **kwargs):
        counts["cupy_arrays"] += 1
        return real_ndarray(*args, **kwargs)

    monkeypatch.setattr(runtime, "function", lambda source, name: kernel)
    monkeypatch.setattr(runtime._cupy, "ndarray", ndarray)
    before, parked = alloc.stats(), alloc._parking.parked_reuses
    step()
    after = alloc.stats()
    counts["buffers"] = after["num_allocs"] - before["num_allocs"]
    counts["freed"] = after["num_frees"] - before["num_frees"]
    counts["parked_reuses"] = alloc._parking.parked_reuses - parked
    counts["new_segments"] = after["num_segment_allocs"] - before["num_segment_allocs"]
    monkeypatch.setattr(runtime._cupy, "ndarray", real_ndarray)
    return counts


# An eager ResNet9 step (batch 8) on the no-op device, once its shapes repeat:
#   buffers: every activation, gradient, workspace and optimizer temporary. A repeated step
#     finds each one parked by the step before under the same rounded size: no search, no
#     cut and no coalescing in the allocator, and no new segment.
#   CuPy arrays: the cuBLAS products and the deferred label checks reuse the views of the
#     steps before (same addresses); a label check's copy is no view (not counted).
# Before parking and the kept views: 0 parked reuses, 92 CuPy arrays.
RESNET9_STEP_CUPY_ARRAYS = 0
# Buffers of one warm eager ResNet9 step (batch 8): activations, gradients, workspaces and
# the batch statistics. BatchNorm's running averages are written in place (two new buffers
# per layer and step before: 180), and each BatchNorm + ReLU pair is one node whose kernels
# apply the ReLU (one buffer each way per pair before: 164).
RESNET9_STEP_BUFFERS = 146
# Kernel launches of that step (BatchNorm + ReLU: one launch each way per pair fewer; 166)
RESNET9_STEP_LAUNCHES = 148
WARM_STEPS = 45


def test_a_repeated_eager_step_reuses_parked_blocks_and_product_views(noop_cuda, monkeypatch):
    device, alloc = noop_cuda
    step = _resnet9_step(device)
    # The first steps take their segments and build the launch plans; the views are kept by
    # address, and the parked blocks of one size change places from step to step until the
    # order settles (within 40 steps here).
    for _ in range(WARM_STEPS):
        step()
    counts = _step_counts(step, alloc, monkeypatch)
    print("eager resnet9 step:", counts)
    assert counts["buffers"] == counts["freed"] > 100, counts
    assert counts["buffers"] <= RESNET9_STEP_BUFFERS, counts
    assert counts["launches"] <= RESNET9_STEP_LAUNCHES, counts
    assert counts["parked_reuses"] == counts["buffers"], counts
    assert counts["new_segments"] == 0, counts
    assert counts["cupy_arrays"] <= RESNET9_STEP_CUPY_ARRAYS, counts


# Python frames and bytecodes of needle's code in one warm eager ResNet9 step (batch 8): the
# sum of the per-op paths above over ~25 forward ops, their backward, SGD and BatchNorm's
# running statistics (~146 buffers, ~148 launches). Before parked blocks, kept product views,
# kept view records, the layout and geometry caches, BatchNorm + ReLU as one node and the
# allocate/release pair in C: 10,449 frames and 330,000 bytecodes (~5,710 and ~209,600 with
# the pair in Python; now ~5,130 and ~176,100; the bounds leave ~3%). Bytecodes are not
# the cost itself: the kept kernel-argument scalars (launch._U64) add ~5,400 dict reads and
# save ~1.4 million instructions of NumPy scalar construction per step.
RESNET9_STEP_FRAMES = 5_300
RESNET9_STEP_BYTECODES = 182_000


def test_an_eager_resnet9_step_stays_within_its_python_budget(noop_cuda):
    device, _ = noop_cuda
    step = _resnet9_step(device)
    for _ in range(WARM_STEPS):
        step()
    frames, bytecodes = _count(step)
    print("eager resnet9 step: frames", frames, "bytecodes", bytecodes)
    assert frames <= RESNET9_STEP_FRAMES, frames
    assert bytecodes <= RESNET9_STEP_BYTECODES, bytecodes


def test_a_strided_copy_of_a_layout_seen_before_packs_no_view(noop_cuda, monkeypatch):
    from needle.backend_ndarray._cuda import launch as L

    packed = []
    real_pack = L.pack_view
    monkeypatch.setattr(L, "pack_view", lambda *a, **k: packed.append(a) or real_pack(*a, **k))
    src, out = B.Array(24), B.Array(24)
    for _ in range(3):
        B.compact(src, out, (4, 6), (1, 4), 0)  # a transpose: one packed view, kept
    assert len(packed) == 1
    small = B.Array(20)  # the same layout over a smaller buffer is checked again, and refused
    with pytest.raises(Exception, match="compact"):
        B.compact(small, out, (4, 6), (1, 4), 0)
    with pytest.raises(Exception, match="compact"):  # a launch size that differs from the view
        B.compact(src, B.Array(12), (4, 6), (1, 4), 0)


def test_a_program_refills_one_record_per_thread_with_each_launchs_buffers(noop_cuda,
                                                                           monkeypatch):
    seen = []  # (record object, its bytes as the launch saw them)

    def kernel(grid, block, args) -> None:
        seen.append((args[0], args[0].tobytes()))

    monkeypatch.setattr(runtime, "function", lambda source, name: kernel)
    code = _program(False)
    pairs = [(B.Array(8), B.Array(8)) for _ in range(3)]
    for theta, grad in pairs:
        B.ewise_program([theta, grad], [theta], code, [0.5], 8)
    assert len({id(record) for record, _ in seen}) == 1  # one record, no copy per launch
    for (theta, grad), (_, raw) in zip(pairs, seen, strict=True):
        words = np.frombuffer(raw, dtype=np.uint64)
        assert words[:2].tolist() == [theta.ptr(), grad.ptr()]
        assert words[16] == theta.ptr()
        assert np.frombuffer(raw, dtype=np.float64)[32] == 0.5


def test_a_batch_of_programs_launches_what_one_call_each_launches(noop_cuda, monkeypatch):
    seen = []  # (kernel name, grid, block, argument bytes) of every launch

    def function(source, name):
        return lambda grid, block, args: seen.append(
            (name, tuple(grid), tuple(block), b"".join(np.asarray(a).tobytes() for a in args)))

    monkeypatch.setattr(runtime, "function", function)
    code = _program(False)
    launches = [([B.Array(n), B.Array(n)], None, n) for n in (8, 5000, 0, 3)]
    launches = [(ins, [ins[0]], n) for ins, _, n in launches]
    for ins, outs, n in launches:
        B.ewise_program(ins, outs, code, [0.25], n)
    one_by_one, seen[:] = list(seen), []
    B.ewise_program_many(launches, code, [0.25])
    assert seen == one_by_one and len(seen) == 3  # n = 0 launches nothing either way
    bad = [launches[0], ([B.Array(4, "float64"), B.Array(4)], [B.Array(4)], 4), launches[1]]
    seen[:] = []
    with pytest.raises(ValueError, match="every input and output must be"):
        B.ewise_program_many(bad, code, [0.25])
    assert len(seen) == 1  # the launch before the refused one ran, none after it


def test_a_kept_strided_view_is_checked_again_for_a_smaller_buffer_at_its_address(noop_cuda):
    """A kept product view is keyed by its buffer's size too: a smaller buffer later at the
    same address (the allocator hands addresses out again) is checked, not read past its end."""
    big, out = B.Array(12), B.Array(4)
    B.matmul_strided(big, big, out, 2, 3, 2, 0, 3, 1, 0, 2, 1)  # 6 elements of each: fits
    small = B.Array(4)
    small._ptr = big._ptr  # the same address, a buffer of 4 elements
    with pytest.raises(IndexError, match="matmul_strided: view reaches outside its buffer"):
        B.matmul_strided(small, small, out, 2, 3, 2, 0, 3, 1, 0, 2, 1)
