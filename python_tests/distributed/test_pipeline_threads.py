"""Pipelines on thread ranks: autograd-aware send/recv, every schedule against NumPy, failures,
the B/W split and the measured-vs-predicted report. Real processes: test_pipeline_mp.py."""
from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.distributed as dist
from needle import nn
from needle.autograd import Tensor
from needle.distributed import pipeline

from . import _pipeline_checks as checks

pytestmark = pytest.mark.timeout(240)


# ---- autograd-aware point-to-point ----------------------------------------------------------
def test_send_recv_carry_the_adjoint_back():
    def job(rank):
        if rank == 0:
            x = Tensor(np.array([[1.0, -2.0]], np.float32))
            token = pipeline.send_forward(ndl.ops.exp(x) * 2, dst=1, tag=7)
            token.backward()
            pipeline.wait_sends()
            return x.grad.numpy()
        y = pipeline.recv_forward(src=0, tag=7)
        (y * y).sum().backward()  # d/dy = 2y, then d/dx = 2y * 2 exp(x)
        pipeline.wait_sends()
        return y.numpy()

    grad, y = dist.spawn_threads(job, 2)
    x = np.array([[1.0, -2.0]])
    np.testing.assert_allclose(y, 2 * np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(grad, 2 * (2 * np.exp(x)) * 2 * np.exp(x), rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_every_tensor_dtype_and_shape_arrives(dtype):
    value = (np.arange(24).reshape(2, 3, 4) % 5).astype(dtype)

    def job(rank):
        if rank == 0:
            pipeline.send_forward(Tensor(value, dtype=dtype, requires_grad=False), dst=1)
            pipeline.wait_sends()
            return None
        got = pipeline.recv_forward(src=0)
        return str(got.dtype), got.numpy()

    kind, got = dist.spawn_threads(job, 2)[1]
    assert kind == dtype and got.shape == (2, 3, 4)
    np.testing.assert_array_equal(got, value)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8", "bool", "float16"])
def test_the_wire_carries_any_numpy_dtype(dtype):
    # needle Tensors hold floats (the course coerces ints); the wire itself takes any dtype
    from needle.distributed.pipeline import wire

    value = (np.arange(30).reshape(5, 6) % 3).astype(dtype)

    def job(rank):
        pg = dist.new_group([0, 1])
        if rank == 0:
            wire.send_array(pg, value, 1, tag=4, direction=wire.BACKWARD)
            wire.wait_sends(pg)
            return None
        return wire.recv_array(pg, 0, tag=4, direction=wire.BACKWARD)

    got = dist.spawn_threads(job, 2)[1]
    assert got.dtype == value.dtype
    np.testing.assert_array_equal(got, value)


def test_float64_gradient_through_the_cut():
    def job(rank):
        if rank == 0:
            x = Tensor(np.array([3.0], np.float64), dtype="float64")
            token = pipeline.send_forward(x * x, dst=1)
            token.backward()
            return x.grad.numpy().tolist(), str(x.grad.dtype)
        y = pipeline.recv_forward(src=0)
        (y * 5).sum().backward()
        pipeline.wait_sends()
        return None

    assert dist.spawn_threads(job, 2)[0] == ([30.0], "float64")


def test_devices_on_either_side_of_the_cut():
    """Data goes through host memory: the sender's device and the receiver's may differ
    (cuda() takes the same path: NDArray.numpy() out, array(..., device=) in)."""
    import needle.backend_ndarray as nd

    def job(rank):
        if rank == 0:
            x = Tensor(np.array([1.0, 2.0], np.float32), device=nd.cpu())
            pipeline.send_forward(x * 2, dst=1).backward()
            pipeline.wait_sends()
            return str(x.grad.device), x.grad.numpy().tolist()
        y = pipeline.recv_forward(src=0, device=nd.cpu_numpy())
        (y * y).sum().backward()
        pipeline.wait_sends()
        return str(y.device), y.numpy().tolist()

    (dev0, grad), (dev1, y) = dist.spawn_threads(job, 2)
    assert (dev0, dev1) == (str(ndl.cpu()), str(ndl.cpu_numpy()))
    assert y == [2.0, 4.0] and grad == [8.0, 16.0]


def test_tags_keep_microbatches_apart():
    def job(rank):
        if rank == 0:
            for tag in (1, 2, 3):
                pipeline.send_forward(Tensor(np.full(2, float(tag), np.float32)), 1, tag=tag)
            pipeline.wait_sends()
            return None
        return [pipeline.recv_forward(0, tag=t).numpy()[0] for t in (3, 1, 2)]

    assert dist.spawn_threads(job, 2)[1] == [3.0, 1.0, 2.0]


def test_recv_timeout_names_ranks_and_tag():
    def job(rank):
        if rank == 1:
            with pytest.raises(dist.CommError, match=r"rank 1 receiving the activation of "
                               r"pipeline tag 5 from rank 0.*timed out after 0.5 s"):
                pipeline.recv_forward(0, tag=5, timeout=0.5)
        dist.barrier()  # rank 0 stays in the group until rank 1 gave up
        return rank

    assert dist.spawn_threads(job, 2) == [0, 1]


def test_bad_tag_and_peer_are_refused():
    def job(rank):
        with pytest.raises(dist.CommError, match="tag out of range"):
            pipeline.recv_forward(1 - rank, tag=-1)
        with pytest.raises(dist.CommError, match="peer rank out of range"):
            pipeline.send_forward(Tensor([1.0]), dst=5)
        return rank

    dist.spawn_threads(job, 2)


# ---- every schedule equals the full-batch gradient (NumPy oracle) ----------------------------
SWEEP = [(name, p, m) for name in ("gpipe", "1f1b", "zero-bubble")
         for p, m in ((1, 3), (2, 1), (2, 4), (3, 5), (4, 8))]
SWEEP += [("interleaved", 2, 2), ("interleaved", 2, 4), ("interleaved", 3, 6),
          ("interleaved", 4, 4)]


@pytest.mark.parametrize("name,p,m", SWEEP)
def test_schedule_gradients_equal_numpy(name, p, m):
    v = 2 if name == "interleaved" else 1
    dist.spawn_threads(checks.check_schedule, p, p, name, m, v, timeout=120)


def test_interleaved_with_four_chunks_per_rank():
    dist.spawn_threads(checks.check_schedule, 2, 2, "interleaved", 4, 4, timeout=120)


def test_uneven_microbatches_use_correct_denominators():
    # 13 rows in 5 micro-batches: sizes 3, 3, 3, 2, 2; a plain average of the micro-batch
    # means would weigh the short ones too much
    dist.spawn_threads(checks.check_schedule, 2, 2, "1f1b", 5, 1, 13, timeout=120)


def test_forward_only_matches_the_model():
    X, _ = checks.data(11)

    def job(rank):
        model = checks.build_mlp()
        stages = checks.stages_for(rank, 2, model)
        sched = pipeline.ScheduleGPipe(stages[0], 3, loss_fn=nn.SoftmaxLoss())
        return sched.forward(X if rank == 0 else None)

    out = dist.spawn_threads(job, 2)
    assert out[0] is None
    want = checks.build_mlp()(Tensor(X)).numpy()
    np.testing.assert_allclose(out[1], want, rtol=1e-5, atol=1e-6)


class _IgnoresInput(nn.Module):
    """Output depends on the input's shape only: backward never reaches the received input."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(np.array([[0.5, -0.5, 1.0]], np.float32))

    def forward(self, x):
        return ndl.ops.broadcast_to(self.bias, (x.shape[0], 3))


def test_a_stage_that_ignores_its_input_sends_a_zero_adjoint():
    def job(rank):
        first = checks.build_mlp((6, 4))
        module = first if rank == 0 else _IgnoresInput()
        sched = pipeline.Schedule1F1B(pipeline.PipelineStage(module, rank, 2), 2,
                                      loss_fn=nn.SoftmaxLoss())
        X, y = checks.data(4, widths=(6, 3))
        sched.step(X if rank == 0 else None, y if rank == 1 else None)
        return [p.grad.numpy() for p in module.parameters()]

    grads = dist.spawn_threads(job, 2)
    assert all(np.all(g == 0) for g in grads[0])  # nothing flows back through the cut
    assert np.abs(grads[1][0]).sum() > 0


# ---- failures ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero-bubble"])
def test_a_stage_that_raises_stops_the_pipeline(name):
    def job(rank):
        return checks.check_failing_stage(rank, 3, name)

    results = dist.spawn_threads(job, 3, timeout=90)
    assert results[1] == "raised"
    assert all("stage 1 (rank 1)" in results[r] for r in (0, 2))


def test_missing_targets_stop_the_pipeline():
    assert dist.spawn_threads(checks.check_missing_targets, 2, 2, timeout=90) == \
        ["comm", "shape"]


def test_too_few_rows_for_the_microbatches():
    def job(rank):
        stages = checks.stages_for(rank, 1, checks.build_mlp())
        sched = pipeline.Schedule1F1B(stages[0], 4, loss_fn=nn.SoftmaxLoss())
        X, y = checks.data(3)
        with pytest.raises(ValueError, match="at least one example per micro-batch"):
            sched.step(X, y)

    dist.spawn_threads(job, 1)


def test_stage_on_the_wrong_rank_is_refused():
    def job(rank):
        with pytest.raises(pipeline.ScheduleError, match="stage 0 belongs on rank 0"):
            pipeline.PipelineStage(nn.ReLU(), 0, 2)
        with pytest.raises(pipeline.ScheduleError, match="needs a loss_fn"):
            pipeline.Schedule1F1B(pipeline.PipelineStage(nn.ReLU(), 1, 2), 2)

    dist.spawn_threads(lambda r: job(r) if r == 1 else None, 2)


# ---- the B/W split -------------------------------------------------------------------------
def test_split_backward_equals_one_backward():
    """B then W gives every gradient one backward gives, for LayerNorm, attention, MLPs."""
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
    attn = nn.MultiHeadAttention(8, 2, causal=True)
    x_data = np.random.randn(2, 3, 8).astype(np.float32)

    def run(split: bool):
        for p in model.parameters() + attn.parameters():
            p.grad = None
        x = Tensor(x_data)
        out = (model(attn(x)) ** 2).sum()
        if not split:
            out.backward()
        else:
            s = pipeline.SplitBackward(out, model.parameters() + attn.parameters())
            s.input_grad()
            assert all(p.grad is None for p in model.parameters() + attn.parameters())
            s.weight_grad()
        return x.grad.numpy(), [p.grad.numpy() for p in model.parameters() + attn.parameters()]

    (xa, ga), (xb, gb) = run(False), run(True)
    np.testing.assert_allclose(xb, xa, rtol=1e-5, atol=1e-6)
    for a, b in zip(ga, gb, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_split_backward_sums_a_weight_used_twice():
    W = Tensor(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32))
    x = Tensor(np.array([[1.0, -1.0]], np.float32))
    s = pipeline.SplitBackward(((x @ W) @ W).sum(), [W])
    s.input_grad()
    s.weight_grad()
    # d/dW sum(x W W) = x^T (1 W^T) + (x W)^T 1, by hand: x W = [-2, -2]
    want = np.array([[1.0], [-1.0]]) @ np.array([[3.0, 7.0]]) + np.array([[-2.0], [-2.0]]) @ \
        np.ones((1, 2))
    np.testing.assert_allclose(W.grad.numpy(), want)
    np.testing.assert_allclose(x.grad.numpy(), np.ones((1, 2)) @ (W.numpy() @ W.numpy()).T)


def test_input_grad_skips_the_weight_matmul():
    """B computes dX only: MatMul is asked for one gradient, the weight's comes in W."""
    calls = []
    mm = ndl.ops.MatMul
    original = mm.plain_gradient  # the rule a backward without create_graph runs

    def spy(self, out_grad, node):
        calls.append(tuple(x.requires_grad for x in node.inputs))
        return original(self, out_grad, node)

    mm.plain_gradient = spy
    try:
        W = Tensor(np.ones((2, 2), np.float32))
        x = Tensor(np.ones((1, 2), np.float32))
        s = pipeline.SplitBackward((x @ W).sum(), [W])
        s.input_grad()
        s.weight_grad()
    finally:
        mm.plain_gradient = original
    assert calls == [(True, False), (False, True)]


# ---- measured vs predicted -----------------------------------------------------------------
def test_report_feeds_measured_costs_to_the_simulator(tmp_path):
    def job(rank):
        _, _, sched = checks.run_schedule(rank, 2, "1f1b", 4, steps=3, record=True)
        return sched.report()

    report = dist.spawn_threads(job, 2)[0]
    assert report.steps == 2 and report.schedule == "1f1b"
    again = pipeline.simulate(report.predicted.plan, forward=report.costs["forward"],
                              backward=report.costs["backward"], comm=report.costs["comm"],
                              activation_bytes=report.activation_bytes_per_microbatch,
                              send_time=report.costs["send_time"],
                              overhead=report.costs["overhead"])
    assert report.bubble_predicted == pytest.approx(again.bubble_fraction)
    assert 0.0 <= report.bubble_measured < 1.0 and report.makespan_measured > 0
    assert all(c > 0 for c in report.costs["forward"] + report.costs["backward"])
    assert report.peak_activation_bytes["measured"] is None  # threads share an allocator
    d = report.as_dict()
    for key in ("bubble_predicted", "bubble_measured", "peak_activation_bytes", "costs_s"):
        assert key in d
    assert "bubble" in report.text()
    for which in ("measured", "predicted"):  # both timelines draw like a simulation
        path = getattr(report, which).plot(str(tmp_path / f"{which}.png"))
        assert (tmp_path / f"{which}.png").stat().st_size > 5000, path
