"""``ParameterServer``: S server ranks own the parameters and their optimizer; W worker ranks
compute gradients on their data, push them and pull fresh weights.

How each mode combines gradients, and what it guarantees, is in docs/parameter_server.md.
"""
from __future__ import annotations

from typing import Any, Callable

from .._errors import CommError
from .._group import resolve
from .layout import ParameterServerConfigError, buffer_groups, plan_shards

MODES = ("sync", "async", "ssp", "backup")


class ParameterServer:
    """Parameter server over the current process group (every rank constructs it, in the same
    order relative to other group creations).

    Args:
        model: a Module (or a list of parameter Tensors), built identically on every rank;
            servers take their shard's initial values from their own copy. A Module's
            buffers (BatchNorm running statistics) go with every push to server 0, whose
            model holds those of the most recent push (in sync mode worker 0's, as DDP
            keeps rank 0's): evaluate and save the model there.
        servers: how many servers (ranks 0..servers-1), or the list of server ranks; the other
            ranks are workers, numbered in rank order.
        mode: "sync", "async", "ssp" or "backup".
        optimizer: ``params -> optimizer`` (any ``needle.optim`` optimizer); called on servers
            only, with the server's shard; its state lives there. Default: SGD, lr 0.01.
        staleness: ssp's bound s (clocks) on how far a worker may run ahead of the slowest.
        wait_for: backup's k: a round proceeds with the first k gradients.
        heartbeat: seconds between a worker's heartbeats (None or 0: off; always off on mpi).
        dead_after: seconds without a message or heartbeat after which a worker is dead.
        rejoin_wait: seconds a server keeps waiting for a dead worker to rejoin (restart)
            once every other worker has finished; 0: do not wait.
        timeout: seconds any single wait may last (default: the group's timeout).
        snapshot_dir, snapshot_every: every K updates each server writes its shard, optimizer
            state and clocks to ``snapshot_dir``; a server restarted by the launcher (tcp,
            ``--restart-workers``) resumes from its snapshot, and workers wait for it to come
            back instead of failing (they continue from the restored clock).

    Example:
        >>> import numpy as np, needle as ndl, needle.distributed as dist
        >>> def job(rank):
        ...     w = ndl.Tensor(np.zeros(2, "float32"), requires_grad=True)
        ...     ps = dist.ParameterServer([w], servers=1, mode="sync",
        ...                               optimizer=lambda p: ndl.optim.SGD(p, lr=1.0))
        ...     if ps.is_server:
        ...         return ps.serve()["updates_applied"]
        ...     ps.pull()
        ...     w.grad = ndl.Tensor(np.full(2, float(rank), "float32"))
        ...     ps.push(examples=1).wait()
        ...     ps.pull()
        ...     ps.finish()
        ...     return w.numpy().tolist()
        >>> dist.spawn_threads(job, 3)
        [1, [-1.5, -1.5], [-1.5, -1.5]]
    """

    def __init__(self, model: Any, servers: int | list[int] = 1, mode: str = "sync",
                 optimizer: Callable[[list[Any]], Any] | None = None, staleness: int = 0,
                 wait_for: int | None = None, heartbeat: float | None = 0.5,
                 dead_after: float = 10.0, rejoin_wait: float = 0.0,
                 timeout: float | None = None, group: Any = None,
                 snapshot_dir: str | None = None, snapshot_every: int = 0):
        import needle.distributed as dist

        world = resolve(group, "ParameterServer")
        self.rank, self.size = world.rank, world.size
        params = list(model.parameters()) if hasattr(model, "parameters") else list(model)
        self.params_all = params
        # buffers (BatchNorm running statistics) travel with every push to server 0, whose
        # model then carries those of the most recent push (ServerRole.install_buffers)
        self.buffers_all = [t for _, t in model.named_buffers()] \
            if hasattr(model, "named_buffers") else []
        self.buffer_groups = buffer_groups([str(t.dtype) for t in self.buffers_all])
        self.shapes = [tuple(p.shape) for p in params]
        dtypes = [str(p.dtype) for p in params]
        self.server_ranks = (list(range(servers)) if isinstance(servers, int)
                             else sorted(int(r) for r in servers))
        self.worker_ranks = [r for r in range(self.size) if r not in self.server_ranks]
        self._validate(mode, staleness, wait_for, dead_after, heartbeat)
        self.mode, self.staleness = mode, int(staleness)
        self.wait_for = len(self.worker_ranks) if wait_for is None else int(wait_for)
        self.shards = plan_shards(self.shapes, dtypes, len(self.server_ranks))
        self.shard_keys = [s.key(self.shapes) for s in self.shards]
        self.transport = world.transport
        mpi = world.backend == "mpi"
        self.heartbeat = 0.0 if mpi or not heartbeat else float(heartbeat)
        self.dead_after, self.rejoin_wait = float(dead_after), float(rejoin_wait)
        if snapshot_every < 0 or (snapshot_every and not snapshot_dir):
            raise ParameterServerConfigError(
                f"ParameterServer: snapshot_every must be >= 0 and needs snapshot_dir, got "
                f"{snapshot_every} and {snapshot_dir!r}")
        self.snapshot_dir, self.snapshot_every = snapshot_dir, int(snapshot_every)
        # servers that snapshot may be restarted: workers then wait for them to come back
        self.server_restarts = bool(snapshot_every) and world.backend == "tcp"
        self.timeout = world.timeout if timeout is None else float(timeout)
        # A private group, apart from every other message of the job: requests, replies and
        # payloads are its point-to-point messages (wire.py), heartbeats pings on its other
        # channel.
        ranks = list(range(self.size))
        self.group = dist.new_group(ranks) if group is None else dist.new_group(
            [world.p2p.global_rank(r) for r in ranks])
        self.hb_chan = self.group.coll
        self.is_server = self.rank in self.server_ranks
        self.server_index = self.server_ranks.index(self.rank) if self.is_server else None
        self.worker_index = None if self.is_server else self.worker_ranks.index(self.rank)
        self._role: Any
        if self.server_index is not None:
            from needle.optim import SGD

            from .server import ServerRole

            mine = [params[i] for i in self.shards[self.server_index].params]
            opt = optimizer(mine) if optimizer is not None else SGD(mine, lr=0.01)
            self.optimizer = opt
            self._role = ServerRole(self, mine, opt)
            if self.server_restarts:
                import os

                from .._run_rank import declare_expendable
                from .._tcp_transport import REJOIN_ENV
                from . import snapshot

                declare_expendable(world.p2p.global_rank(self.rank))
                if os.environ.get(REJOIN_ENV) and snapshot_dir:
                    snapshot.load(self._role, snapshot_dir)
        else:
            from .._run_rank import declare_expendable
            from .worker import WorkerRole

            if world.backend == "tcp":  # the launcher may restart it or go on without it
                declare_expendable(world.p2p.global_rank(self.rank))
            self.optimizer = None
            self._role = WorkerRole(self)

    def _validate(self, mode, staleness, wait_for, dead_after, heartbeat) -> None:
        def bad(what: str) -> ParameterServerConfigError:
            return ParameterServerConfigError(f"ParameterServer: {what}")

        if mode not in MODES:
            raise bad(f"unknown mode, expected one of {MODES}, got {mode!r}")
        if not self.server_ranks or any(not 0 <= r < self.size for r in self.server_ranks):
            raise bad(f"server ranks must be in [0, {self.size}), got {self.server_ranks}")
        if not self.worker_ranks:
            raise bad(f"no workers: {len(self.server_ranks)} servers in a group of "
                      f"{self.size} ranks, expected servers < {self.size}")
        if int(staleness) < 0:
            raise bad(f"staleness must be >= 0, got {staleness}")
        if wait_for is not None and not 1 <= int(wait_for) <= len(self.worker_ranks):
            raise bad(f"wait_for must be in [1, W={len(self.worker_ranks)}], got {wait_for}")
        if dead_after <= 0 or (heartbeat is not None and heartbeat < 0):
            raise bad(f"dead_after must be > 0 and heartbeat >= 0, got {dead_after} and "
                      f"{heartbeat}")

    # ----- worker API -------------------------------------------------------------------------
    def _worker(self, op: str):
        if self.is_server:
            raise CommError(f"ParameterServer.{op}: rank {self.rank} is a server, expected a "
                            f"worker rank (one of {self.worker_ranks})")
        return self._role

    @property
    def clock(self) -> int:
        """Worker: gradients pushed so far (a restarted worker starts at the server's clock)."""
        role = self._worker("clock")
        role.join()
        return role.clock

    def pull(self) -> int:
        """Load the servers' current weights into the model; returns their version. Blocks
        as the mode requires: sync/backup until the round of this worker's last push is
        applied, ssp until the slowest live worker is at most ``staleness`` clocks behind,
        async never."""
        return self._worker("pull").pull()

    def push(self, examples: int = 1, loss_sum: float = 0.0, correct: int = 0):
        """Send the model's gradients (``p.grad``; None counts as zeros), computed on
        ``examples`` examples, to the servers; returns a Work. ``loss_sum`` and ``correct``
        only travel along for reporting."""
        return self._worker("push").push(int(examples), float(loss_sum), int(correct))

    def finish(self, report: dict | None = None) -> None:
        """Tell the servers this worker is done (they stop waiting for it); ``report``: a
        small dict of named integers the servers keep (``serve()``'s ``worker_reports``, by
        worker; ``apps/train.py`` sends the worker's memory row)."""
        self._worker("finish").finish(report)

    @property
    def traffic(self) -> dict:
        """Worker: bytes this worker pushed and pulled (payloads only), and call counts."""
        w = self._worker("traffic")
        return {"bytes_pushed": w.bytes_pushed, "bytes_pulled": w.bytes_pulled,
                "pushes": w.pushes, "pulls": w.pulls}

    # ----- server API -------------------------------------------------------------------------
    def serve(self, on_update: Callable[[int], None] | None = None) -> dict:
        """Server: run until every worker has finished or left; returns this server's
        counters (updates, drops, lost and rejoined workers, staleness histogram, bytes).
        ``on_update(updates)`` runs after every update, once the round is applied and
        counted (evaluation, logging, :meth:`state_dict` for a checkpoint; keep it short: it
        runs on the serving thread)."""
        if not self.is_server:
            raise CommError(f"ParameterServer.serve: rank {self.rank} is a worker, expected a "
                            f"server rank (one of {self.server_ranks})")
        self._role.on_update = on_update
        return self._role.serve()

    def state_dict(self) -> dict:
        """This rank's part of the parameter server's state, for a checkpoint.

        A server: its shard, its optimizer state and its bookkeeping (``snapshot.state``:
        version, updates, every worker's clock, counters, loss log; on server 0 the model's
        buffers and each worker's latest pushed buffers). Take it in ``serve``'s
        ``on_update``, where no round is open. A worker: its clock, the versions it pulled
        and its traffic counters (the model and its buffers are the caller's to save).
        """
        if self.is_server:
            from . import snapshot

            return {"server": snapshot.state(self._role)}
        return {"worker": self._role.state_dict()}

    def load_state_dict(self, state: dict, origin: str = "a checkpoint") -> None:
        """Restore :meth:`state_dict`'s part of this rank (before ``serve`` on a server,
        before the first ``pull`` on a worker); ``origin`` names it in errors.

        Raises:
            ParameterServerConfigError: the part belongs to the other role, or does not fit
                this server's shard, mode or workers.
        """
        role = "server" if self.is_server else "worker"
        if role not in state:
            raise ParameterServerConfigError(
                f"ParameterServer.load_state_dict: rank {self.rank} is a {role}, expected a "
                f"{role}'s state from {origin}, got one with {sorted(state)}")
        if self.is_server:
            from . import snapshot

            snapshot.restore(self._role, state["server"], origin)
        else:
            self._role.load_state_dict(state["worker"])

    @property
    def server(self):
        """Server: the role object (loss log, clocks), for reporting."""
        return self._role if self.is_server else None

    def predicted_bytes_per_step(self) -> dict:
        """Payload bytes one worker step moves: each worker pushes and pulls the whole model
        (M bytes, each server's shard to its server); each server receives W·M/S on average,
        exactly W times its shard."""
        total = sum(s.nbytes for s in self.shards)
        w = len(self.worker_ranks)
        return {"push_per_worker": total, "pull_per_worker": total,
                "server_ingress": [w * s.nbytes for s in self.shards]}

    def close(self) -> None:
        if not self.is_server:
            self._role.stop()
