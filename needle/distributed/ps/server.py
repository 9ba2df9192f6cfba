"""The server role: receive pushes, apply the mode's update rule, answer pulls, watch workers.

One thread polls every worker's posted receives, so a slow or dead worker never blocks the
others. Definitions used throughout (docs/parameter_server.md gives the formulas):

- a worker's *clock* is the number of its gradients this server has received;
- the *global clock* is the smallest clock of the live, unfinished workers;
- the *version* served to a pull is the number of completed rounds (sync, backup) or the
  global clock (async, ssp); a gradient's *staleness* is the version when it is applied minus
  the version it was computed on.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np

from needle._core.dtypes import numpy_dtype

from .. import p2p, tracing
from .._errors import CommError, rewrap
from . import wire


class WorkerState:
    """What a server knows about one worker."""

    def __init__(self, index: int, rank: int, now: float):
        self.index, self.rank = index, rank
        self.alive, self.finished, self.joined = True, False, False
        self.clock, self.last_version = 0, -1
        self.pull_waiting = False
        self.last_seen = now
        self.dead_at: float | None = None
        self.req: Any = None  # the Work of the posted request receive
        self.hb: Any = None
        self.hb_buf = wire.ping()
        self.report: dict | None = None  # what the worker's FINISH carried

    @property
    def active(self) -> bool:
        return self.alive and not self.finished


class ServerRole:
    """Serve one shard: ``params`` are this server's own parameter Tensors (in shard order)."""

    def __init__(self, ps: Any, params: list[Any], optimizer: Any):
        self.ps, self.params, self.optimizer = ps, params, optimizer
        self.mode = ps.mode
        self.shard = ps.shards[ps.server_index]
        now = time.monotonic()
        self.workers = [WorkerState(i, r, now) for i, r in enumerate(ps.worker_ranks)]
        self.version = 0  # completed rounds (sync, backup)
        self.round: dict[int, tuple[int, list[np.ndarray]]] = {}
        self.updates = 0
        self.dropped = 0
        self.lost = 0
        self.rejoined = 0
        self.staleness: Counter = Counter()
        self.delay: Counter = Counter()  # optimizer steps between a gradient's pull and apply
        self.bytes_in = 0
        self.bytes_out = 0
        self.loss_log: list[tuple[int, int, int, float, int]] = []
        self._sending: list[tuple[Any, WorkerState]] = []  # (Work of a send, its worker)
        self._last_clock = 0
        self.events: list[str] = []
        self.on_update = None  # called with the update count after every update
        self.restored_from: str | None = None
        self.started_at = time.perf_counter()
        self.window: tuple[float, int, int] | None = None
        self.max_lead = 0
        self.snapshots = 0
        # server 0: every worker's latest buffers with the update count they arrived at, and
        # the worker whose buffers the model holds
        self.worker_buffers: dict[int, tuple[int, list[np.ndarray]]] = {}
        self.buffers_from: int | None = None
        self.buffer_bytes_in = 0

    # ----- the loop ---------------------------------------------------------------------------
    def serve(self) -> dict:
        self.started_at = time.perf_counter()
        for w in self.workers:
            self._post(w)
        while not self._done():
            busy = False
            for w in self.workers:
                busy |= self._poll(w)
            self._watch_heartbeats()
            busy |= self._answer_pulls()
            self._reap_sends()
            if not busy:
                time.sleep(5e-4)
        self._flush_sends()
        self.install_buffers()
        return self.stats()

    def _done(self) -> bool:
        now = time.monotonic()
        for w in self.workers:
            if w.active:
                return False
            if (not w.alive and self.ps.rejoin_wait and w.dead_at is not None
                    and now - w.dead_at < self.ps.rejoin_wait):
                return False
        return True

    def _listen(self, w: WorkerState) -> Any:
        """Post the receive of ``w``'s next request (polled, never waited on)."""
        return p2p.irecv_object(w.rank, tag=wire.T_REQUEST, group=self.ps.group,
                                max_bytes=wire.MAX_MESSAGE_BYTES)

    def _post(self, w: WorkerState) -> None:
        w.req = self._listen(w)
        if self.ps.heartbeat:
            w.hb = self.ps.hb_chan.irecv(w.hb_buf, w.rank, wire.T_HEARTBEAT)

    def _poll(self, w: WorkerState) -> bool:
        if w.finished:
            return False
        if not w.alive:
            return self._poll_dead(w)
        try:
            if w.hb is not None and w.hb.test():
                w.last_seen = time.monotonic()
                w.hb = self.ps.hb_chan.irecv(w.hb_buf, w.rank, wire.T_HEARTBEAT)
            if not w.req.is_completed():
                return False
            w.last_seen = time.monotonic()
            fields = wire.parse_request(w.req.wait(), w.rank)
            self._handle(w, fields)
            if w.alive and not w.finished:
                w.req = self._listen(w)
        except CommError as exc:
            self._declare_dead(w, str(exc))
        return True

    def _poll_dead(self, w: WorkerState) -> bool:
        """A dead worker may come back (restarted by the launcher): once the transport no
        longer calls it gone, listen for its JOIN again."""
        if not self.ps.rejoin_wait:
            return False
        gone = getattr(getattr(self.ps.transport, "mailbox", None), "gone", None)
        if gone is not None and gone(w.rank) is not None:
            return False
        try:
            if w.req is None:
                w.req = self._listen(w)
            if not w.req.is_completed():
                return False
            fields = wire.parse_request(w.req.wait(), w.rank)
        except CommError:
            w.req = None
            return False
        w.req = None
        if fields["op"] != wire.JOIN:
            return True  # a leftover of the dead incarnation
        w.alive, w.dead_at = True, None
        self.rejoined += 1
        self.events.append(f"worker rank {w.rank} rejoined")
        if self.ps.heartbeat:
            w.hb = self.ps.hb_chan.irecv(w.hb_buf, w.rank, wire.T_HEARTBEAT)
        self._on_join(w)
        w.req = self._listen(w)
        return True

    def _watch_heartbeats(self) -> None:
        if not self.ps.heartbeat:
            return
        now = time.monotonic()
        for w in self.workers:
            if w.active and now - w.last_seen > self.ps.dead_after:
                self._declare_dead(w, f"no heartbeat for {now - w.last_seen:.1f} s (dead_after "
                                      f"{self.ps.dead_after:g} s)")

    def _declare_dead(self, w: WorkerState, why: str) -> None:
        if not w.alive:
            return
        w.alive, w.dead_at, w.pull_waiting = False, time.monotonic(), False
        if w.req is not None:  # a request a rejoining worker sends must reach a new receive
            w.req.cancel()
        w.req = w.hb = None
        self.lost += 1
        self.events.append(f"worker rank {w.rank} declared dead: {why}")
        if self.mode in ("sync", "backup"):
            self._maybe_complete_round()  # the denominators now count the live workers only

    # ----- requests ---------------------------------------------------------------------------
    def _handle(self, w: WorkerState, fields: dict) -> None:
        op = fields["op"]
        mine = self.ps.shard_keys[self.shard.server]
        if fields["shard_key"] != mine:
            from .layout import ParameterServerConfigError

            raise ParameterServerConfigError(
                f"ParameterServer.serve: worker rank {w.rank} disagrees on server "
                f"{self.shard.server}'s parameters (keys, shapes, dtypes), expected shard key "
                f"{mine:#010x}, got {fields['shard_key']:#010x}: build the same model on "
                "every rank")
        if op == wire.JOIN:
            if w.joined:  # restarted faster than its death was noticed
                self.rejoined += 1
                self.events.append(f"worker rank {w.rank} restarted and rejoined")
            self._on_join(w)
        elif op == wire.PUSH:
            self._on_push(w, fields["version"], fields["examples"], float(fields["loss_sum"]),
                          fields["correct"], fields["updates_seen"])
        elif op == wire.PULL:
            w.pull_waiting = True
        elif op == wire.FINISH:
            if self.window is None:  # the first worker is done: the all-active window closes
                self.window = (time.perf_counter() - self.started_at,
                               sum(entry[2] for entry in self.loss_log), self.updates)
            w.finished = True
            w.report = fields.get("report")
            w.pull_waiting = False
            self._send(w, wire.reply(self.served_version(), w.clock, self.updates), [])
            if self.mode in ("sync", "backup"):
                self._maybe_complete_round()

    def _on_join(self, w: WorkerState) -> None:
        """A worker (first start or restart) starts at the current clock: a restarted one
        continues its data shard from there."""
        if w.joined:
            w.clock = self.global_clock() if self.mode in ("async", "ssp") else self.version
        w.joined = True
        w.last_version = self.served_version() - 1
        w.last_seen = time.monotonic()
        self._send(w, wire.reply(self.served_version(), w.clock, self.updates), [])

    def _receive(self, w: WorkerState, bufs: list[np.ndarray], tag: int, what: str) -> int:
        """Fill ``bufs`` with the arrays of a push that follow its request (on ``tag``; each
        must have its buffer's dtype and size); their bytes. The worker sent them right after
        the request, so a wait can only be on it."""
        works = [p2p.irecv(buf, w.rank, self.ps.group, tag, self.ps.timeout) for buf in bufs]
        for work in works:
            try:
                work.wait()
            except CommError as exc:
                raise rewrap(exc, f"ParameterServer.serve: worker rank {w.rank} sent a push "
                                  f"request but not its {what}: {exc}") from None
        return sum(buf.nbytes for buf in bufs)

    def _receive_payload(self, w: WorkerState) -> list[np.ndarray]:
        sizes = self.shard.sizes(self.ps.shapes)
        bufs = [np.empty(n, dtype) for (dtype, _), n in zip(self.shard.groups, sizes,
                                                              strict=True)]
        self.bytes_in += self._receive(w, bufs, wire.T_PUSH_DATA, "gradient")
        return bufs

    def _receive_buffers(self, w: WorkerState) -> None:
        """Server 0: the model's buffers that follow a push's gradient."""
        bufs = [np.empty(sum(int(np.prod(self.ps.buffers_all[i].shape, dtype=np.int64))
                             for i in members), dtype)
                for dtype, members in self.ps.buffer_groups]
        self.buffer_bytes_in += self._receive(w, bufs, wire.T_BUFFER_DATA, "buffers")
        self.worker_buffers[w.index] = (self.updates, bufs)

    def install_buffers(self) -> int | None:
        """Server 0: load into the model the buffers of the most recent push (the one that
        arrived after the most updates; of a sync round's pushes, the lowest-numbered
        worker's), so the statistics were computed with the newest weights; returns that
        worker's index (None: no buffers yet). In sync mode it is worker 0's, bitwise DDP
        rank 0's on the same data."""
        if not self.worker_buffers:
            return None
        index = max(self.worker_buffers, key=lambda i: (self.worker_buffers[i][0], -i))
        from .._buffers import borrow

        for (_, members), flat in zip(self.ps.buffer_groups, self.worker_buffers[index][1],
                                      strict=True):
            offset = 0
            for i in members:
                target = borrow(self.ps.buffers_all[i], "ParameterServer buffers")
                n = target.arr.size
                target.arr[...] = flat[offset:offset + n].reshape(target.arr.shape)
                target.commit()
                offset += n
        self.buffers_from = index
        return index

    def _on_push(self, w: WorkerState, version: int, examples: int, loss_sum: float,
                 correct: int, updates_seen: int) -> None:
        grads = self._receive_payload(w)
        if self.shard.server == 0 and self.ps.buffer_groups:
            self._receive_buffers(w)
        # the real age of the weights the gradient came from, in optimizer steps; for sync
        # and backup rounds it is counted when the round is applied
        pending_delay = self.updates - updates_seen
        self.loss_log.append((w.index, w.clock + 1, examples, loss_sum, correct))
        clock_before = self.global_clock()
        w.clock += 1
        w.last_version = version
        if self.mode in ("sync", "backup"):
            late = version != self.version or w.index in self.round
            full = self.mode == "backup" and len(self.round) >= self._needed()
            tracing.instant("ps push received", "ps", worker=w.rank, version=version,
                            dropped=bool(late or full))
            if late or full:
                self.dropped += 1
            else:
                self.round[w.index] = (max(examples, 0), grads)
                self.delay[pending_delay] += 1
            self._maybe_complete_round()
            return
        staleness = max(clock_before - version, 0)
        tracing.instant("ps push received", "ps", worker=w.rank, version=version,
                        staleness=staleness)
        self.staleness[staleness] += 1
        self.delay[pending_delay] += 1
        self._apply([(1, grads)])
        self._after_update()

    def _needed(self) -> int:
        live = sum(1 for w in self.workers if w.active)
        if self.mode == "backup":
            return max(1, min(self.ps.wait_for, live))
        return live

    def _maybe_complete_round(self) -> None:
        if not self.round:
            return
        active = [w.index for w in self.workers if w.active]
        if self.mode == "sync":
            ready = all(i in self.round for i in active)
        else:
            ready = len(self.round) >= self._needed() or not active
        if not ready:
            return
        contributions = [self.round[i] for i in sorted(self.round)]
        self.staleness[0] += len(contributions)
        self._apply(contributions)
        self.round = {}
        self.version += 1
        self._after_update()

    def _apply(self, contributions: list[tuple[int, list[np.ndarray]]]) -> None:
        """One optimizer step with sum_w n_w g_w / sum_w n_w over ``contributions`` (worker
        order), in DDP's arithmetic: each gradient times its weight n_w / sum n in its own
        dtype, then summed, so a sync round of two workers is bitwise DDP's step."""
        with tracing.span("ps update", "ps", gradients=len(contributions),
                          update=self.updates + 1):
            self._apply_now(contributions)

    def _apply_now(self, contributions: list[tuple[int, list[np.ndarray]]]) -> None:
        from needle.autograd import Tensor

        total = sum(n for n, _ in contributions)
        weights = [n / total if total else 1.0 / len(contributions) for n, _ in contributions]
        for g, (dtype, members) in enumerate(self.shard.groups):
            kind = numpy_dtype(dtype).type
            flat = np.zeros(contributions[0][1][g].shape, dtype)
            for wt, (_, grads) in zip(weights, contributions, strict=True):
                flat += grads[g] * kind(wt)
            offset = 0
            for i in members:
                p = self.ps.params_all[i]
                n = int(np.prod(p.shape, dtype=np.int64))
                value = flat[offset:offset + n].reshape(p.shape).astype(dtype)
                p.grad = Tensor(value, device=p.device, dtype=dtype, requires_grad=False)
                offset += n
        self.optimizer.step()
        self.optimizer.reset_grad()
        self.install_buffers()  # what an evaluation or snapshot after this update sees
        self.updates += 1

    def _after_update(self) -> None:
        """After every update, with the state consistent (a round applied, counted and
        closed): every ``snapshot_every`` updates write a snapshot, then call ``on_update``,
        which may read or save the whole state (``ParameterServer.state_dict``)."""
        every, folder = self.ps.snapshot_every, self.ps.snapshot_dir
        if folder and every and self.updates % every == 0:
            from . import snapshot

            snapshot.save(self, folder)
            self.snapshots += 1
        if self.on_update is not None:
            self.on_update(self.updates)

    # ----- pulls ------------------------------------------------------------------------------
    def global_clock(self) -> int:
        clocks = [w.clock for w in self.workers if w.active]
        if clocks:
            self._last_clock = min(clocks)
        return self._last_clock

    def served_version(self) -> int:
        return self.version if self.mode in ("sync", "backup") else self.global_clock()

    def _ready(self, w: WorkerState) -> bool:
        if self.mode in ("sync", "backup"):
            return self.version > w.last_version
        if self.mode == "ssp":
            return self.global_clock() >= w.clock - self.ps.staleness
        return True

    def _answer_pulls(self) -> bool:
        answered = False
        for w in self.workers:
            if w.alive and w.pull_waiting and self._ready(w):
                w.pull_waiting = False
                # how far ahead of the slowest live worker a pull let this one run
                self.max_lead = max(self.max_lead, w.clock - self.global_clock())
                self._send(w, wire.reply(self.served_version(), w.clock, self.updates),
                           self.weights())
                answered = True
        return answered

    def weights(self) -> list[np.ndarray]:
        out = []
        for dtype, members in self.shard.groups:
            parts = [self.ps.params_all[i].numpy().astype(dtype, copy=False).reshape(-1)
                     for i in members]
            out.append(np.ascontiguousarray(np.concatenate(parts)))
        return out

    def _send(self, w: WorkerState, head: dict, payload: list[np.ndarray]) -> None:
        group, timeout = self.ps.group, self.ps.timeout
        try:
            self._sending.append((p2p.isend_object(head, w.rank, tag=wire.T_REPLY, group=group,
                                                   timeout=timeout), w))
            for buf in payload:
                self._sending.append((p2p.isend(buf, w.rank, group, wire.T_PULL_DATA, timeout),
                                      w))
                self.bytes_out += buf.nbytes
        except CommError as exc:
            self._declare_dead(w, str(exc))

    def _reap_sends(self) -> None:
        keep = []
        for work, w in self._sending:
            if not work.is_completed():
                keep.append((work, w))
                continue
            try:
                work.wait()
            except CommError as exc:
                self._declare_dead(w, str(exc))
        self._sending = keep

    def _flush_sends(self) -> None:
        deadline = time.monotonic() + min(self.ps.timeout, 10.0)
        while self._sending and time.monotonic() < deadline:
            self._reap_sends()
            time.sleep(1e-3)

    # ----- report -----------------------------------------------------------------------------
    def stats(self) -> dict:
        hist = {int(k): int(v) for k, v in sorted(self.staleness.items())}
        return {"mode": self.mode, "updates_applied": self.updates,
                "gradients_dropped": self.dropped, "workers_lost": self.lost,
                "workers_rejoined": self.rejoined, "staleness_histogram": hist,
                "max_staleness": max(hist) if hist else 0,
                "update_delay_histogram": {int(k): int(v) for k, v in sorted(self.delay.items())},
                "bytes_pushed": self.bytes_in,
                "bytes_pulled": self.bytes_out, "version": self.served_version(),
                "buffer_bytes_pushed": self.buffer_bytes_in,
                "buffers_from_worker": self.buffers_from,
                "worker_clocks": [w.clock for w in self.workers], "events": list(self.events),
                "worker_reports": [w.report for w in self.workers],
                "snapshots_written": self.snapshots, "restored_from": self.restored_from,
                "all_active": self._window(), "max_lead": self.max_lead}

    def _window(self) -> dict:
        """Throughput while every worker was still running (until the first finished)."""
        seconds, examples, updates = self.window or (
            time.perf_counter() - self.started_at,
            sum(entry[2] for entry in self.loss_log), self.updates)
        return {"seconds": seconds, "examples": examples, "updates": updates,
                "examples_per_s": examples / max(seconds, 1e-9),
                "updates_per_s": updates / max(seconds, 1e-9)}
