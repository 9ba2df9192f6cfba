"""The ``nccl`` backend on the CUDA emulator with a fake ``cupy.cuda.nccl`` (_fake_nccl):
which NCCL calls each collective makes, on which stream, with no host staging, and the values
(against a float64 reference within rounding; fake ranks against each other bitwise)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import needle.distributed as dist
from needle import nn
from needle.autograd import Tensor

from . import _fake_nccl, _nccl_checks
from ._zero_checks import _BUILD

pytestmark = pytest.mark.slow


@pytest.fixture
def nccl(emulated_cuda, monkeypatch):
    """(the emulated cuda() device, the fake NCCL); counts host copies in ``fake.to_host``
    and per thread (``_nccl_checks._copies``)."""
    from needle.backend_ndarray import ndarray_backend_cuda as backend
    from needle.backend_ndarray._cuda import runtime

    fake = _fake_nccl.install(runtime._cupy)
    fake.to_host = 0
    real = backend.to_numpy

    per_thread = _nccl_checks.counted(real)

    def counted(*args, **kwargs):
        fake.to_host += 1
        return per_thread(*args, **kwargs)

    monkeypatch.setattr(backend, "to_numpy", counted)
    yield emulated_cuda, fake
    _fake_nccl.uninstall(runtime._cupy, fake)


def _on(dev, values, dtype="float32"):
    return Tensor(np.asarray(values, dtype=dtype), device=dev, requires_grad=False)


def _run(fake, job, world=2):
    """``job(rank)`` on ``world`` thread ranks of an nccl group; returns (results, host copies
    made by the collectives), counting until every rank finished its collectives."""
    copies: list[int] = []
    lock = threading.Lock()

    def main(rank):
        stream = _fake_nccl.FakeStream()
        with stream:
            values = job(rank)
        dist.barrier()
        with lock:
            copies.append(fake.to_host)
        dist.barrier()
        return stream.ptr, [v.numpy() if hasattr(v, "numpy") else v for v in values]

    return dist.spawn_threads(main, world, backend="nccl", timeout=30), max(copies)


def test_collectives_go_from_device_buffers_through_nccl_on_the_current_stream(nccl):
    dev, fake = nccl
    x = [np.array([1.5, -2.0, 3.25, 0.5, 7.0]), np.array([0.25, 4.0, -1.0, 2.5, -3.0])]

    def job(rank):
        s, m, mx = (_on(dev, x[rank]) for _ in range(3))
        dist.all_reduce(s)
        dist.all_reduce(m, op="mean")
        dist.all_reduce(mx, op="max")
        b = _on(dev, x[rank])
        dist.broadcast(b, src=1)
        outs = [_on(dev, np.zeros(5)) for _ in range(2)]
        dist.all_gather(outs, _on(dev, x[rank]))
        rs = _on(dev, np.zeros(2))
        dist.reduce_scatter(rs, [_on(dev, x[rank][:2]), _on(dev, x[rank][2:4])])
        return [s, m, mx, b, *outs, rs]

    (results, copies) = _run(fake, job)
    assert copies == 0  # no cuda() tensor went through host memory
    (s0, r0), (s1, r1) = results
    total = x[0] + x[1]
    want = [total, total / 2, np.maximum(*x), x[1], x[0], x[1]]
    for got0, got1, ref in zip(r0, r1, want, strict=False):
        np.testing.assert_allclose(got0, ref, rtol=1e-6)
        np.testing.assert_array_equal(got0, got1)  # every rank holds the same bits
    np.testing.assert_allclose(r0[-1], total[:2])
    np.testing.assert_allclose(r1[-1], total[2:4])
    kinds = [c["kind"] for c in fake.calls if c["rank"] == 0 and c["kind"] != "destroy"]
    assert kinds == ["allReduce"] * 3 + ["broadcast"] * 3 + ["reduce"] * 2
    for rank, stream in ((0, s0), (1, s1)):  # each on its caller's current stream
        assert {c["stream"] for c in fake.calls if c["rank"] == rank and "stream" in c} == \
            {stream}
    assert all(c["grouped"] for c in fake.calls[-4:] if c["kind"] == "reduce")
    assert [c["count"] for c in fake.of("allReduce", 0)] == [5, 5, 5]


def test_unequal_segments_are_one_rooted_call_per_segment(nccl):
    dev, fake = nccl
    bounds = [0, 1, 5]
    x = [np.arange(5.0) + 1, 10 * np.arange(5.0)]

    def job(rank):
        rs = _on(dev, x[rank])
        dist.reduce_scatter_v(rs, bounds)
        ag = _on(dev, x[rank])
        dist.all_gather_v(ag, bounds)
        return [rs, ag]

    ((_, r0), (_, r1)), copies = _run(fake, job)
    assert copies == 0
    total = x[0] + x[1]
    np.testing.assert_allclose(r0[0][:1], total[:1])
    np.testing.assert_allclose(r1[0][1:], total[1:])
    want = np.concatenate([x[0][:1], x[1][1:]])
    np.testing.assert_array_equal(r0[1], want)
    np.testing.assert_array_equal(r1[1], want)
    calls = [(c["kind"], c["count"], c["root"]) for c in fake.calls if c["rank"] == 0
             and c["kind"] in ("reduce", "broadcast")]
    assert calls == [("reduce", 1, 0), ("reduce", 4, 1), ("broadcast", 1, 0),
                     ("broadcast", 4, 1)]


def test_mean_without_nccl_avg_divides_the_sum_on_the_device(nccl, monkeypatch):
    dev, fake = nccl
    monkeypatch.delattr(_fake_nccl.FakeNccl, "NCCL_AVG")

    def job(rank):
        m = _on(dev, [1.0, 2.0, 4.0])
        dist.all_reduce(m, op="mean")
        return [m]

    ((_, r0), (_, r1)), _ = _run(fake, job)
    assert [c["op"] for c in fake.of("allReduce")] == [_fake_nccl.SUM] * 2
    np.testing.assert_array_equal(r0[0], [1.0, 2.0, 4.0])
    np.testing.assert_array_equal(r1[0], [1.0, 2.0, 4.0])


def test_send_and_recv_of_cuda_tensors(nccl):
    dev, fake = nccl

    def job(rank):
        got = _on(dev, np.zeros(3))
        if rank == 0:
            dist.send(_on(dev, [1.0, 2.0, 3.0]), dst=1, tag=4)
            dist.isend(_on(dev, [5.0, 6.0, 7.0]), dst=1).wait()
        else:
            dist.recv(got, src=0, tag=4)
            second = _on(dev, np.zeros(3))
            dist.irecv(second, src=0).wait()
            return [got, second]
        return []

    ((_, _), (_, r1)), copies = _run(fake, job)
    assert copies == 0
    assert [g.tolist() for g in r1] == [[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]]
    assert [c["peer"] for c in fake.of("send", 0)] == [1, 1]
    assert [c["count"] for c in fake.of("recv", 1)] == [3, 3]


def test_a_receive_of_another_shape_drains_the_payload_and_names_both(nccl):
    dev, fake = nccl

    def job(rank):
        if rank == 0:
            dist.send(_on(dev, [1.0, 2.0, 3.0]), dst=1)
            dist.barrier()
            return []
        with pytest.raises(dist.CommError, match=r"expected float32 \(2,\), got float32 \(3,\)"):
            dist.recv(_on(dev, np.zeros(2)), src=0)
        dist.barrier()
        return []

    _run(fake, job)
    assert [c["count"] for c in fake.of("recv", 1)] == [3]  # drained, the sender is free


def test_cpu_tensors_of_an_nccl_group_keep_the_host_path(nccl):
    dev, fake = nccl

    def job(rank):
        t = Tensor(np.array([1.0, 2.0], np.float32) * (rank + 1), requires_grad=False)
        dist.all_reduce(t)
        return [t]

    ((_, r0), _), _ = _run(fake, job)
    assert r0[0].tolist() == [3.0, 6.0]
    assert not fake.of("allReduce")


def test_a_rank_on_the_host_path_against_nccl_is_a_call_check_error(nccl):
    dev, fake = nccl

    def job(rank):
        t = _on(dev, [1.0]) if rank == 0 else Tensor(np.ones(1, np.float32))
        with pytest.raises(dist.CommError, match="ranks called different collectives"):
            dist.all_reduce(t)
        return []

    _run(fake, job)


def test_a_rank_that_never_issues_its_call_times_out_naming_the_ranks(nccl):
    dev, fake = nccl

    def job(rank):
        dist.get_rank()
        pg = dist.process_group._world("test")
        pg.world.check_signatures = False  # let rank 0 reach NCCL alone
        if rank == 0:
            with pytest.raises(dist.CommError, match=r"timed out after 0.3 s waiting for the "
                               r"NCCL all_reduce of ranks \[0, 1\].*aborted"):
                dist.all_reduce(_on(dev, [1.0]), timeout=0.3)
        return []

    _run(fake, job)
    assert fake.of("abort") and fake.of("abort")[0]["rank"] == 0


def test_nccl_without_a_gpu_is_refused_naming_the_backend_and_the_reason(monkeypatch):
    from needle.backend_ndarray._cuda import runtime

    monkeypatch.setattr(runtime, "_cupy", None)
    monkeypatch.setattr(runtime, "_reason", "cupy is not importable (no module)")
    with pytest.raises(dist.NcclUnavailable, match=r"backend 'nccl' needs CuPy with NCCL and "
                       r"a GPU, got none on any rank \(here: cupy is not importable"):
        dist.spawn_threads(lambda rank: None, 1, backend="nccl", timeout=10)


def _ddp_grads(dev, world, x):
    def job(rank):
        with _BUILD:  # NumPy's global generator is shared by the thread ranks
            np.random.seed(0)
            layer = nn.Sequential(nn.Linear(3, 4, device=dev), nn.ReLU(),
                                  nn.Linear(4, 2, device=dev))
        ddp = dist.DistributedDataParallel(layer, bucket_cap_mb=1e-5)
        part = np.array_split(x, world)[rank]
        ddp(Tensor(part, device=dev, requires_grad=False)).sum().backward()
        ddp.finish_gradient_sync()
        return [p.grad for p in layer.parameters()]
    return job


@pytest.mark.parametrize("world", [1, 2])
def test_ddp_buckets_stay_on_the_device(nccl, world):
    dev, fake = nccl
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    results, copies = _run(fake, _ddp_grads(dev, world, x), world)
    assert copies == 0
    assert len(fake.of("allReduce", 0)) == 4  # one per bucket (one parameter each)
    assert len(fake.of("broadcast", 0)) == 4  # rank 0's parameters at the start
    np.random.seed(0)
    host = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    (host(Tensor(x, requires_grad=False)).sum() / world).backward()
    for _, grads in results:
        for got, want in zip(grads, host.parameters(), strict=True):
            np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(results[0][1][0], results[-1][1][0])


def test_tensor_parallel_mlp_on_the_device(nccl):
    from needle.distributed import tensor_parallel as tp

    dev, fake = nccl

    def job(rank):
        with _BUILD:
            np.random.seed(1)
            fc1, fc2 = nn.Linear(4, 6, device=dev), nn.Linear(6, 4, device=dev)
        mlp = tp.ParallelMLP.from_full(fc1, fc2)
        x = Tensor(np.linspace(-1, 1, 8).reshape(2, 4), device=dev, dtype="float32")
        y = mlp(x)
        y.sum().backward()
        return [y, x.grad]

    ((_, r0), (_, r1)), copies = _run(fake, job)
    assert copies == 0
    np.random.seed(1)
    fc1, fc2 = nn.Linear(4, 6), nn.Linear(6, 4)
    x = Tensor(np.linspace(-1, 1, 8).reshape(2, 4), dtype="float32")
    y = fc2(nn.ReLU()(fc1(x)))
    y.sum().backward()
    for got in (r0, r1):
        np.testing.assert_allclose(got[0], y.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], x.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert fake.of("allReduce")  # the row-parallel sum and the input gradient's


def test_a_subgroup_of_an_nccl_world_gets_its_own_communicator(nccl):
    dev, fake = nccl

    def job(rank):
        sub = dist.new_group([0, 1])
        t = _on(dev, [rank + 1.0])
        dist.all_reduce(t, group=sub)
        return [t, dist.get_backend(sub)]

    ((_, r0), (_, r1)), copies = _run(fake, job)
    assert copies == 0 and r0[1] == r1[1] == "nccl"
    assert r0[0].tolist() == r1[0].tolist() == [3.0]
    assert len(fake.members) == 2  # the world's communicator and the subgroup's


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_keeps_its_buckets_and_shards_on_the_device(nccl, stage):
    """ZeRO on an nccl group: gradient buckets reduce-scattered and weights all-gathered by
    NCCL from device buffers, no host copy in backward and step, and the same parameters as
    the thread backend's run (two ranks: a + b is b + a, so bitwise)."""
    from needle import optim

    dev, fake = nccl
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)

    def job(rank):
        with _BUILD:
            np.random.seed(0)
            model = nn.Sequential(nn.Linear(3, 4, device=dev), nn.ReLU(),
                                  nn.Linear(4, 2, device=dev))
        zero = dist.ZeroDataParallel(model, optimizer=lambda ps: optim.SGD(ps, lr=0.5),
                                     stage=stage)
        part = Tensor(x[rank * 2:(rank + 1) * 2], device=dev, requires_grad=False)
        copies = _nccl_checks._copies()
        zero(part).sum().backward()
        zero.step()
        return _nccl_checks._copies() - copies, zero.full_parameters()

    on_nccl = dist.spawn_threads(job, 2, backend="nccl", timeout=30)
    on_threads = dist.spawn_threads(job, 2, timeout=30)
    assert [copies for copies, _ in on_nccl] == [0, 0]
    assert fake.of("reduce", 0) and fake.of("broadcast", 0)
    for (_, got), (_, want) in zip(on_nccl, on_threads, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("world", [1, 2])
def test_the_device_checks_pass_on_the_emulator(emulated_cuda, monkeypatch, world):
    """The body scripts/check_nccl.py runs on GPUs (every collective in three dtypes,
    send/recv, DDP), here on thread ranks with the fake NCCL."""
    from needle.backend_ndarray import ndarray_backend_cuda as backend
    from needle.backend_ndarray._cuda import runtime

    fake = _fake_nccl.install(runtime._cupy)
    monkeypatch.setattr(backend, "to_numpy", _nccl_checks.counted(backend.to_numpy))
    try:
        dist.spawn_threads(lambda rank: _nccl_checks.run_checks(
            emulated_cuda, rank, world, _BUILD), world, backend="nccl", timeout=60)
    finally:
        _fake_nccl.uninstall(runtime._cupy, fake)
    assert fake.of("allReduce", 0) and fake.of("reduce", 0) and fake.of("broadcast", 0)


def test_pipeline_cut_edges_carry_device_arrays_through_nccl(nccl):
    """send_forward/recv_forward of cuda() tensors: activations and adjoints go device to
    device by NCCL (no host copy until the results are read), and an abort in place of an
    activation still reaches the receiver as PipelineAborted."""
    from needle import ops
    from needle.distributed import pipeline

    dev, fake = nccl

    def job(rank):
        if rank == 0:
            x = Tensor(np.array([[1.0, -2.0]], np.float32), device=dev)
            token = pipeline.send_forward(ops.exp(x) * 2, dst=1, tag=7)
            token.backward()
            pipeline.wait_sends()
            dist.barrier()
            pipeline.wire.send_abort(dist.process_group._world("t").world, "stage 0 failed",
                                     1, 8, pipeline.wire.FORWARD, 0)
            pipeline.wait_sends()
            return [x.grad]
        y = pipeline.recv_forward(src=0, tag=7, device=dev)
        assert y.device == dev
        (y * y).sum().backward()  # d/dy = 2y, then d/dx = 2y * 2 exp(x)
        pipeline.wait_sends()
        dist.barrier()
        with pytest.raises(pipeline.PipelineAborted, match="stage 0 failed"):
            pipeline.recv_forward(src=0, tag=8, device=dev)
        return [y]

    ((_, r0), (_, r1)), copies = _run(fake, job)
    assert copies == 0
    x = np.array([[1.0, -2.0]])
    np.testing.assert_allclose(r1[0], 2 * np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(r0[0], 2 * (2 * np.exp(x)) * 2 * np.exp(x), rtol=1e-5)
    assert [c["count"] for c in fake.of("send", 0)] == [2]  # the activation
    assert [c["count"] for c in fake.of("send", 1)] == [2]  # its adjoint
