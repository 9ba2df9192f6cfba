"""Parameter server semantics on the thread backend: each mode replayed on a deterministic
schedule against a pure-Python reference of its documented update rule (quadratic losses,
so every gradient is a known function of the weights it was computed on), plus sharding and
configuration errors. Real processes, faults and the DDP equivalence: test_ps_mp.py."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import needle as ndl
import needle.distributed as dist
from needle.distributed.ps import ParameterServerConfigError, plan_shards

LR = 0.5
TARGETS = {0: np.array([1.0, -2.0, 3.0]), 1: np.array([-4.0, 0.5, 2.0]),
           2: np.array([2.0, 2.0, -1.0])}
THETA0 = np.array([0.25, 0.5, -0.75])


# --------------------------------------------------------------------------------------------
# the reference: the update rules of docs/parameter_server.md, written independently


class Reference:
    """Replays server-side events in order. ``pull(w)`` hands worker w the weights, the
    version (rounds, or the smallest live clock) and the update count; ``push(w, n)`` is
    worker w's gradient of 0.5·|θ − a_w|² at the weights of its last pull, on n examples."""

    def __init__(self, mode: str, workers: int, wait_for: int | None = None):
        self.mode, self.k = mode, wait_for or workers
        self.theta = THETA0.copy()
        self.updates = self.rounds = 0
        self.clock = [0] * workers
        self.seen = {}
        self.round = {}
        self.staleness, self.delay = {}, {}
        self.dropped = 0
        self.finished = set()

    def _count(self, table, key):
        table[key] = table.get(key, 0) + 1

    def version(self):
        if self.mode in ("sync", "backup"):
            return self.rounds
        live = [c for w, c in enumerate(self.clock) if w not in self.finished]
        return min(live) if live else max(self.clock)

    def pull(self, w):
        self.seen[w] = (self.theta.copy(), self.version(), self.updates)
        return self.seen[w]

    def push(self, w, n=1):
        theta, version, updates = self.seen[w]
        g = theta - TARGETS[w]
        clock_before = self.version()
        self.clock[w] += 1
        if self.mode in ("async", "ssp"):
            self._count(self.staleness, clock_before - version)
            self._count(self.delay, self.updates - updates)
            self.theta = self.theta - LR * g
            self.updates += 1
            return
        if version != self.rounds or len(self.round) >= self.k:
            self.dropped += 1
            return
        self._count(self.delay, self.updates - updates)
        self.round[w] = (n, g)
        if len(self.round) == self.k:
            total = sum(m for m, _ in self.round.values())
            self.theta = self.theta - LR * sum(m * gg for m, gg in self.round.values()) / total
            self.staleness[0] = self.staleness.get(0, 0) + len(self.round)
            self.round, self.updates, self.rounds = {}, self.updates + 1, self.rounds + 1

    def finish(self, w):
        self.finished.add(w)


# --------------------------------------------------------------------------------------------
# the real thing on threads: rank 0 serves, ranks 1.. are workers 0..


def _param():
    return ndl.Tensor(THETA0.astype(np.float64), dtype="float64", requires_grad=True)


class Worker:
    def __init__(self, ps, w, param):
        self.ps, self.w, self.param = ps, w, param
        self.theta = None

    def pull(self):
        version = self.ps.pull()
        self.theta = self.param.numpy().astype(np.float64)
        return self.theta.copy(), version

    def push(self, n=1):
        g = self.theta - TARGETS[self.w]
        self.param.grad = ndl.Tensor(g, dtype="float64")
        self.ps.push(examples=n).wait()


def _wait_until(cond, what):
    deadline = time.monotonic() + 30
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(1e-3)


def _run(mode, workers, script, **kw):
    """rank 0 serves; worker w runs ``script(w, Worker, shared)``; returns (stats, results)."""
    shared = {"events": {k: threading.Event() for k in ("a", "b", "c", "d")}}

    def job(rank):
        p = _param()
        ps = dist.ParameterServer([p], servers=1, mode=mode,
                                  optimizer=lambda ps_: ndl.optim.SGD(ps_, lr=LR), **kw)
        if ps.is_server:
            shared["server"] = ps.server
            return ps.serve()
        out = script(rank - 1, Worker(ps, rank - 1, p), shared)
        ps.finish()
        return out

    results = dist.spawn_threads(job, workers + 1, timeout=60)
    return results[0], results[1:]


def _updates(shared, n):
    _wait_until(lambda: "server" in shared and shared["server"].updates >= n, f"{n} updates")


def test_async_replay_matches_reference():
    ev = None

    def script(w, me, shared):
        nonlocal ev
        ev = shared["events"]
        seen = [me.pull()]
        if w == 0:
            ev["d"].wait(30)  # worker 1 holds θ0
            for _ in range(2):
                me.push()
                seen.append(me.pull())
            ev["a"].set()
            ev["b"].wait(30)
            seen.append(me.pull())
            me.push()
            seen.append(me.pull())
            ev["c"].set()
        else:  # worker 1 is two steps late: its gradient comes from θ0
            ev["d"].set()
            ev["a"].wait(30)
            me.push()
            seen.append(me.pull())
            ev["b"].set()
            ev["c"].wait(30)  # finish only after worker 0's last pull (it counts as live)
        return seen

    stats, (s0, s1) = _run("async", 2, script)
    ref = Reference("async", 2)
    r0 = [ref.pull(0)]
    r1 = [ref.pull(1)]
    for _ in range(2):
        ref.push(0)
        r0.append(ref.pull(0))
    ref.push(1)
    r1.append(ref.pull(1))
    r0.append(ref.pull(0))
    ref.push(0)
    r0.append(ref.pull(0))
    for got, want in ((s0, r0), (s1, r1)):
        assert len(got) == len(want)
        for (theta, version), (rtheta, rversion, _) in zip(got, want, strict=True):
            np.testing.assert_allclose(theta, rtheta, rtol=1e-12)
            assert version == rversion
    assert stats["updates_applied"] == ref.updates == 4
    assert stats["staleness_histogram"] == ref.staleness
    assert stats["update_delay_histogram"] == ref.delay == {0: 3, 2: 1}


def test_ssp_blocks_fast_worker_and_bounds_staleness():
    def script(w, me, shared):
        ev = shared["events"]
        seen = [me.pull()]
        if w == 0:
            ev["c"].wait(30)                # worker 1 holds θ0
            me.push()
            seen.append(me.pull())          # clock 1: 1 - s = 0 <= slowest (0): answered
            me.push()
            ev["a"].set()
            seen.append(me.pull())          # clock 2: needs the slowest at 1: blocks
            ev["b"].wait(30)
            me.push()
            seen.append(me.pull())
            ev["d"].set()
        else:
            ev["c"].set()
            ev["a"].wait(30)
            _updates(shared, 2)             # worker 0's two gradients are in
            _wait_until(lambda: shared["server"].workers[0].pull_waiting, "the blocked pull")
            me.push()
            seen.append(me.pull())
            me.push()
            _updates(shared, 4)
            ev["b"].set()
            ev["d"].wait(30)                # finish after worker 0's last pull
        return seen

    stats, (s0, s1) = _run("ssp", 2, script, staleness=1)
    ref = Reference("ssp", 2)
    r0, r1 = [ref.pull(0)], [ref.pull(1)]
    ref.push(0)
    r0.append(ref.pull(0))
    ref.push(0)
    ref.push(1)                  # worker 0's pull at clock 2 is answered only after this
    r0.append(ref.pull(0))
    r1.append(ref.pull(1))
    ref.push(1)
    ref.push(0)
    r0.append(ref.pull(0))
    for got, want in ((s0, r0), (s1, r1)):
        for (theta, version), (rtheta, rversion, _) in zip(got, want, strict=True):
            np.testing.assert_allclose(theta, rtheta, rtol=1e-12)
            assert version == rversion
    # the blocked pull came back at version 1, with worker 1's gradient in it
    assert s0[2][1] == 1
    assert stats["max_staleness"] == 1 <= 1
    assert stats["max_lead"] == 1  # worker 0's pulls were answered one clock ahead, never two
    assert stats["staleness_histogram"] == ref.staleness == {0: 4, 1: 1}
    assert stats["update_delay_histogram"] == ref.delay == {0: 3, 1: 1, 2: 1}


def test_sync_weights_by_examples():
    def script(w, me, shared):
        seen = [me.pull()]
        for _ in range(2):
            me.push(n=1 if w == 0 else 3)
            seen.append(me.pull())
        return seen

    stats, results = _run("sync", 2, script)
    ref = Reference("sync", 2)
    want = [[ref.pull(0)], [ref.pull(1)]]
    for _ in range(2):
        ref.push(0, 1)
        ref.push(1, 3)
        want[0].append(ref.pull(0))
        want[1].append(ref.pull(1))
    for got, exp in zip(results, want, strict=True):
        for (theta, version), (rtheta, rversion, _) in zip(got, exp, strict=True):
            np.testing.assert_allclose(theta, rtheta, rtol=1e-12)
            assert version == rversion
    assert stats["updates_applied"] == 2 and stats["gradients_dropped"] == 0
    assert stats["staleness_histogram"] == {0: 4}


def test_backup_proceeds_without_the_slowest():
    def script(w, me, shared):
        seen = [me.pull()]
        if w < 2:
            shared["events"]["c"].wait(30)  # worker 2 has its round-0 weights
            me.push()
            seen.append(me.pull())          # answered with 2 of 3 gradients
            shared["events"]["a"].set()
        else:
            shared["events"]["c"].set()
            shared["events"]["a"].wait(30)
            _updates(shared, 1)
            me.push()                       # computed on version 0, round 0 is over: dropped
            seen.append(me.pull())
        return seen

    stats, results = _run("backup", 3, script, wait_for=2)
    ref = Reference("backup", 3, wait_for=2)
    want = [[ref.pull(w)] for w in range(3)]
    ref.push(0)
    ref.push(1)
    want[0].append(ref.pull(0))
    want[1].append(ref.pull(1))
    ref.push(2)
    want[2].append(ref.pull(2))
    for got, exp in zip(results, want, strict=True):
        for (theta, version), (rtheta, rversion, _) in zip(got, exp, strict=True):
            np.testing.assert_allclose(theta, rtheta, rtol=1e-12)
            assert version == rversion
    assert stats["updates_applied"] == 1
    assert stats["gradients_dropped"] == ref.dropped == 1


# --------------------------------------------------------------------------------------------
# shards, dtypes, configuration


def test_shards_balance_bytes_and_group_dtypes():
    shapes = [(10, 10), (10,), (3, 3), (50,), (7,)]
    dtypes = ["float32", "float32", "float64", "float32", "float64"]
    plan = plan_shards(shapes, dtypes, 2)
    assert sorted(i for s in plan for i in s.params) == list(range(5))
    sizes = [s.nbytes for s in plan]
    assert sum(sizes) == 400 + 40 + 72 + 200 + 56
    assert sizes == [400, 368]  # unequal: the largest parameter alone on server 0
    assert plan[1].groups == [("float32", [1, 3]), ("float64", [2, 4])]


def test_two_servers_several_dtypes_sync():
    """Two servers with unequal shards, float32 and float64 parameters: the sync update
    equals the example-weighted mean gradient step on every parameter."""
    rng = np.random.default_rng(0)
    init = [rng.standard_normal((4, 3)).astype(np.float32),
            rng.standard_normal(5).astype(np.float64), rng.standard_normal(2).astype(np.float32)]
    grads = {w: [rng.standard_normal(a.shape).astype(a.dtype) for a in init] for w in (0, 1, 2)}
    counts = {0: 2, 1: 5, 2: 1}

    def job(rank):
        params = [ndl.Tensor(a, dtype=str(a.dtype), requires_grad=True) for a in init]
        ps = dist.ParameterServer(params, servers=2, mode="sync",
                                  optimizer=lambda p: ndl.optim.SGD(p, lr=0.1))
        if ps.is_server:
            return ps.serve()
        w = rank - 2
        ps.pull()
        for p, g in zip(params, grads[w], strict=True):
            p.grad = ndl.Tensor(g, dtype=str(g.dtype))
        ps.push(examples=counts[w]).wait()
        ps.pull()
        ps.finish()
        return [p.numpy() for p in params]

    results = dist.spawn_threads(job, 5, timeout=60)
    total = sum(counts.values())
    for i, a in enumerate(init):
        mean = sum(counts[w] * grads[w][i].astype(np.float64) for w in counts) / total
        want = a - 0.1 * mean
        for got in results[2:]:
            assert got[i].dtype == a.dtype
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)
    assert results[0]["bytes_pushed"] + results[1]["bytes_pushed"] == 3 * (48 + 40 + 8)


@pytest.mark.parametrize("kw, needle", [
    (dict(servers=3), "more servers than parameters"),
    (dict(staleness=-1, mode="ssp"), "staleness must be >= 0"),
    (dict(wait_for=3, mode="backup"), "wait_for must be in [1, W=2]"),
    (dict(mode="eventual"), "unknown mode"),
])
def test_bad_configuration_is_a_clear_error(kw, needle):
    def job(rank):
        params = [ndl.Tensor(np.zeros(2, np.float32), requires_grad=True),
                  ndl.Tensor(np.zeros(3, np.float32), requires_grad=True)]
        with pytest.raises(ParameterServerConfigError, match=needle.replace("[", r"\[")):
            dist.ParameterServer(params, **kw)
        return True

    assert dist.spawn_threads(job, 3 if "servers" not in kw else 4, timeout=30)


def test_no_workers_is_a_clear_error():
    def job(rank):
        with pytest.raises(ParameterServerConfigError, match="no workers"):
            dist.ParameterServer([ndl.Tensor(np.zeros(2, np.float32))] * 3, servers=2)
        return True

    assert dist.spawn_threads(job, 2, timeout=30)


def test_silent_worker_is_declared_dead_by_heartbeat_timeout():
    """Worker 1 stops its heartbeats and goes quiet (a hung process the transport cannot see):
    after dead_after it is declared dead, sync rounds go on with worker 0 alone."""
    done = threading.Event()

    def job(rank):
        p = _param()
        ps = dist.ParameterServer([p], servers=1, mode="sync", heartbeat=0.05, dead_after=0.5,
                                  optimizer=lambda ps_: ndl.optim.SGD(ps_, lr=LR))
        if ps.is_server:
            stats = ps.serve()
            done.set()
            return stats
        me = Worker(ps, rank - 1, p)
        if rank == 2:
            me.pull()
            ps.close()              # no more heartbeats, no more requests
            done.wait(30)
            return None
        me.pull()
        for _ in range(3):
            me.push()
            me.pull()
        ps.finish()
        return me.theta

    stats, theta, _ = dist.spawn_threads(job, 3, timeout=60)
    assert stats["workers_lost"] == 1 and stats["updates_applied"] == 3
    assert "no heartbeat" in stats["events"][0] and "rank 2" in stats["events"][0]
    ref = THETA0.copy()
    for _ in range(3):  # worker 0 alone: denominators count the live workers only
        ref = ref - LR * (ref - TARGETS[0])
    np.testing.assert_allclose(theta, ref, rtol=1e-12)


def test_worker_with_another_layout_is_refused_by_the_server():
    def job(rank):
        shape = (3,) if rank != 2 else (4,)  # rank 2 built a different model
        p = ndl.Tensor(np.zeros(shape, np.float32), requires_grad=True)
        ps = dist.ParameterServer([p], servers=1, mode="async", heartbeat=None, timeout=20)
        if ps.is_server:
            with pytest.raises(ParameterServerConfigError, match="worker rank 2 disagrees"):
                ps.serve()
            return "refused"
        try:
            ps.pull()
            ps.finish()
        except dist.CommError as exc:
            return str(exc)
        return "ok"

    results = dist.spawn_threads(job, 3, timeout=60)
    assert results[0] == "refused"
    assert "parameter server 0 (rank 0)" in results[2]


# --------------------------------------------------------------------------------------------
# buffers: the server's model is the model the workers trained


def _bn_worker_step(ps, model, rank: int, step: int) -> None:
    """Pull, one backward on this worker's own data (so its running statistics differ from
    the other workers'), push."""
    ps.pull()
    model.train()
    x = np.random.RandomState(10 * rank + step).randn(5, 3).astype("float32") + rank
    for p in model.parameters():
        p.grad = None
    model(ndl.Tensor(x)).sum().backward()
    ps.push(examples=5).wait()


def _bn_job(mode: str, steps: int):
    first_done = threading.Event()

    def job(rank):
        from needle import nn

        np.random.seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        ps = dist.ParameterServer(model, servers=1, mode=mode, heartbeat=0,
                                  optimizer=lambda p: ndl.optim.SGD(p, lr=0.1))
        if ps.is_server:
            stats = ps.serve()
            return "server", stats, model.state_dict()
        if mode == "async" and rank == 2:  # async: worker 1 pushes last, after worker 0
            first_done.wait(60)
        for step in range(steps):
            _bn_worker_step(ps, model, rank, step)
        if rank == 1:
            ps.pull()  # its last push is applied before worker 1 starts
            first_done.set()
        ps.finish()
        return "worker", ps.traffic, model.state_dict()

    return job


@pytest.mark.parametrize("mode, newest", [("sync", 0), ("async", 1)])
def test_server_model_holds_the_newest_pushed_buffers(mode, newest):
    """Sync: a round's pushes tie, worker 0's win (DDP rank 0's); async: the last push's."""
    server, *workers = dist.spawn_threads(_bn_job(mode, 3), 3)
    _, stats, served = server
    assert stats["buffers_from_worker"] == newest
    for name in ("modules.1.running_mean", "modules.1.running_var"):
        assert not np.array_equal(workers[0][2][name], workers[1][2][name])
        np.testing.assert_array_equal(served[name], workers[newest][2][name])
    # 8 float32 buffer values with each of the 3 pushes, counted apart from the gradients
    assert stats["buffer_bytes_pushed"] == 2 * 3 * 8 * 4
    assert workers[0][1]["bytes_pushed"] == 3 * sum(
        v.nbytes for k, v in workers[0][2].items() if "running" not in k)


# --------------------------------------------------------------------------------------------
# checkpoints: state_dict at a sync boundary, load_state_dict, and the run goes on exactly


def _resumable_job(total: int, folder, save_at: int | None = None, resume: bool = False):
    """Sync, BatchNorm model, Adam on the server (its moments matter): every rank writes its
    ``state_dict`` at update ``save_at`` (servers in ``on_update``, workers after that push)
    to ``folder``; with ``resume`` every rank first loads it and the workers go on from the
    servers' restored clock."""

    def job(rank):
        from needle import nn

        np.random.seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        ps = dist.ParameterServer(model, servers=1, mode="sync", heartbeat=0,
                                  optimizer=lambda p: ndl.optim.Adam(p, lr=0.1))
        path = str(folder / f"rank{rank}.ndl")
        if resume:
            saved = ndl.load(path)
            if not ps.is_server:
                model.load_state_dict(saved["model"])
            ps.load_state_dict(saved["ps"], path)
        if ps.is_server:
            def on_update(updates):
                if updates == save_at:
                    ndl.save({"ps": ps.state_dict()}, path)

            return ps.serve(on_update=on_update), model.state_dict()
        for step in range(ps.clock, total):
            _bn_worker_step(ps, model, rank, step)
            if step + 1 == save_at:
                ndl.save({"model": model.state_dict(), "ps": ps.state_dict()}, path)
        ps.finish()
        return None

    return job


def test_sync_state_dict_resumes_exactly(tmp_path):
    (straight_stats, straight), *_ = dist.spawn_threads(_resumable_job(5, tmp_path), 3)
    dist.spawn_threads(_resumable_job(2, tmp_path, save_at=2), 3)
    (stats, resumed), *_ = dist.spawn_threads(_resumable_job(5, tmp_path, resume=True), 3)
    for name, value in straight.items():  # parameters, Adam's effect and BatchNorm buffers
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
    for key in ("updates_applied", "worker_clocks", "bytes_pushed", "bytes_pulled",
                "buffer_bytes_pushed", "buffers_from_worker", "staleness_histogram"):
        assert stats[key] == straight_stats[key], key
    assert stats["restored_from"] == str(tmp_path / "rank0.ndl")


def test_load_state_dict_of_the_other_role_is_refused(tmp_path):
    def job(rank):
        w = ndl.Tensor(np.zeros(2, "float32"), requires_grad=True)
        ps = dist.ParameterServer([w], servers=1, mode="sync", heartbeat=0)
        try:
            ps.load_state_dict({"worker": {}} if ps.is_server else {"server": {}}, "ckpt")
        except ParameterServerConfigError as exc:
            return str(exc)
        return "loaded"

    results = dist.spawn_threads(job, 2, timeout=60)
    assert "rank 0 is a server, expected a server's state from ckpt" in results[0]
    assert "rank 1 is a worker, expected a worker's state" in results[1]
