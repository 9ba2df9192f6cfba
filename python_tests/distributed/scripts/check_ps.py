"""Run by test_ps_mp.py on real processes: ``check_ps.py MODE [PS_MODE]``.

sync_ddp: 1 server + 2 workers; the sync parameter server's weights after 3 steps equal
    DistributedDataParallel's over the two worker ranks (unequal example counts per worker).
kill PS_MODE: 1 server + 3 workers; worker rank 2 SIGKILLs itself at step 3; the others
    finish 6 steps; the server reports its counters.
restart: as kill (sync), launched with --restart-workers 1: rank 2 comes back and rejoins.
dead_server: 2 servers + 2 workers; server rank 1 SIGKILLs itself after 2 updates; every
    worker reports the CommError it got.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import needle as ndl  # noqa: E402
import needle.autograd  # noqa: F401 - before needle.nn: works around a circular import
import needle.distributed as dist  # noqa: E402
from needle import nn  # noqa: E402

STEPS = 6
LR = 0.1


def model():
    ndl.random.seed(7)
    np.random.seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(w: int, step: int):
    rng = np.random.default_rng(100 * w + step)
    n = 4 + 2 * w  # unequal example counts
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)


def grads(net, X, y):
    loss = nn.SoftmaxLoss()(net(ndl.Tensor(X)), ndl.Tensor(y.astype(np.float32)))
    loss.backward()
    return float(loss.numpy()) * len(y)


dist.init_process_group(timeout=60)
rank, world = dist.get_rank(), dist.get_world_size()
mode = sys.argv[1]
ps_mode = sys.argv[2] if len(sys.argv) > 2 else "sync"
sgd = lambda params: ndl.optim.SGD(params, lr=LR)  # noqa: E731
rejoining = bool(os.environ.get("NEEDLE_DIST_REJOIN"))

if mode == "sync_ddp":
    net = model()
    ps = dist.ParameterServer(net, servers=1, mode="sync", optimizer=sgd)
    workers = dist.new_group([1, 2])
    if ps.is_server:
        stats = ps.serve()
        assert stats["updates_applied"] == 3 and stats["gradients_dropped"] == 0, stats
        print(f"PS OK sync_ddp rank {rank} of {world} on {dist.get_backend()}")
    else:
        w = ps.worker_index
        ps.pull()
        for step in range(3):
            X, y = batch(w, step)
            for p in net.parameters():
                p.grad = None
            grads(net, X, y)
            ps.push(examples=len(y)).wait()
            ps.pull()
        ps.finish()
        via_ps = [p.numpy() for p in net.parameters()]
        ref = model()
        ddp = dist.DistributedDataParallel(ref, group=workers)
        opt = ndl.optim.SGD(ref.parameters(), lr=LR)
        for step in range(3):
            X, y = batch(w, step)
            opt.reset_grad()
            ddp.set_num_examples(len(y))
            loss = nn.SoftmaxLoss()(ddp(ndl.Tensor(X)), ndl.Tensor(y.astype(np.float32)))
            loss.backward()
            ddp.finish_gradient_sync()
            opt.step()
        for a, b in zip(via_ps, [p.numpy() for p in ref.parameters()], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        moved = max(float(np.abs(a - b).max()) for a, b in zip(via_ps, [
            p.numpy() for p in model().parameters()], strict=True))
        assert moved > 1e-3, moved  # the weights did change
        print(f"PS OK sync_ddp rank {rank} of {world} on {dist.get_backend()}")

elif mode in ("kill", "restart"):
    net = model()
    ps = dist.ParameterServer(net, servers=1, mode=ps_mode, optimizer=sgd, staleness=1,
                              wait_for=2, heartbeat=0.2, dead_after=20.0,
                              rejoin_wait=60.0 if mode == "restart" else 0.0)
    if ps.is_server:
        print("PS STATS " + json.dumps(ps.serve()))
    else:
        w = ps.worker_index
        if rejoining:
            print(f"REJOINED at clock {ps.clock}", flush=True)
            open(os.environ["CHECK_PS_FLAG"], "w").close()
        ps.pull()
        while ps.clock < STEPS:
            step = ps.clock + 1
            if rank == 2 and step == 3 and not rejoining:
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "restart" and rank != 2 and step == 4:
                # hold the others here until rank 2 is back (a value check, not a timing one)
                while not os.path.exists(os.environ["CHECK_PS_FLAG"]):
                    time.sleep(0.05)
            X, y = batch(w, step)
            for p in net.parameters():
                p.grad = None
            grads(net, X, y)
            ps.push(examples=len(y)).wait()
            ps.pull()
        ps.finish()
        print(f"WORKER DONE rank {rank} clock {ps.clock}")

elif mode == "server_restart":
    # launched with --restart-workers 1: the server snapshots every 2 updates and SIGKILLs
    # itself at update 5; restarted, it resumes from update 4 and the workers redo from there
    net = model()
    ps = dist.ParameterServer(net, servers=1, mode="sync", optimizer=sgd, heartbeat=0.2,
                              snapshot_dir=os.environ["CHECK_PS_DIR"], snapshot_every=2)
    if ps.is_server:
        def die_at_5(updates):  # on the serving thread, right after update 5 is applied
            if updates == 5 and not rejoining:
                os.kill(os.getpid(), signal.SIGKILL)

        stats = ps.serve(on_update=die_at_5)
        print("PS STATS " + json.dumps(stats))
    else:
        w = ps.worker_index
        clocks = []
        ps.pull()
        while ps.clock < 8:
            clocks.append(ps.clock)
            X, y = batch(w, ps.clock + 1)
            for p in net.parameters():
                p.grad = None
            grads(net, X, y)
            ps.push(examples=len(y)).wait()
            ps.pull()
        ps.finish()
        # the reference: 8 plain sync steps on the same batches, in one process
        ref = model()
        for step in range(1, 9):
            total, acc = 0, None
            for v in (0, 1):
                X, y = batch(v, step)
                for p in ref.parameters():
                    p.grad = None
                grads(ref, X, y)
                g = [p.grad.numpy() * len(y) for p in ref.parameters()]
                acc = g if acc is None else [a + b for a, b in zip(acc, g, strict=True)]
                total += len(y)
            for p, g in zip(ref.parameters(), acc, strict=True):
                p.data = ndl.Tensor(p.numpy() - LR * g / total)
        for a, b in zip([p.numpy() for p in net.parameters()], [p.numpy() for p in
                                                                 ref.parameters()], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        print(f"WORKER RESUMED rank {rank} clocks {clocks} restarts "
              f"{ps._role.server_restarts_seen}")

elif mode == "dead_server":
    net = model()
    ps = dist.ParameterServer(net, servers=2, mode="sync", optimizer=sgd, heartbeat=0.2)
    if ps.is_server:
        def die_at_2(updates):
            if updates == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        ps.serve(on_update=die_at_2)
    else:
        try:
            ps.pull()
            for step in range(1000):
                X, y = batch(ps.worker_index, step)
                for p in net.parameters():
                    p.grad = None
                grads(net, X, y)
                ps.push(examples=len(y)).wait()
                ps.pull()
        except dist.CommError as exc:
            print(f"WORKER CAUGHT {type(exc).__name__}: {exc}", flush=True)
            raise
        raise AssertionError("no CommError")
