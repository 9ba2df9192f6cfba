"""The worker role: join, pull weights into the model, push its gradients, finish; a
heartbeat thread tells the servers it is alive while it computes."""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from .. import p2p, tracing
from .._buffers import borrow
from .._errors import CommError, PeerError
from .._transport import poll_until
from .._work import PolledWork, Work
from . import wire


class WorkerRole:
    def __init__(self, ps: Any):
        self.ps = ps
        self.clock = 0
        self.versions = [0] * len(ps.server_ranks)
        self.updates_seen = [0] * len(ps.server_ranks)
        self.bytes_pushed = 0
        self.buffer_bytes_pushed = 0
        self.bytes_pulled = 0
        self.pulls = 0
        self.pushes = 0
        self._inflight: list[tuple[Work, int]] = []  # sends not known complete, per server
        self.server_restarts_seen = 0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if ps.heartbeat:
            self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                          name=f"needle-ps-heartbeat-{ps.rank}")
            self._beat.start()
        self.joined = False
        self._restored_clock: int | None = None

    def join(self) -> None:
        """Introduce this worker to every server (on first use, not in the constructor, so
        that collective calls right after constructing cannot deadlock with it)."""
        if self.joined:
            return
        self.joined = True
        replies = self._request(wire.request(wire.JOIN), with_weights=False, op="join")
        self.clock = min(r["clock"] for r in replies)
        self.versions = [r["version"] for r in replies]
        if self._restored_clock is not None and self._restored_clock != self.clock:
            from .layout import ParameterServerConfigError

            raise ParameterServerConfigError(
                f"ParameterServer: worker rank {self.ps.rank} restored clock "
                f"{self._restored_clock} but the servers hold clocks "
                f"{[r['clock'] for r in replies]} for it: its state and theirs come from "
                f"different checkpoints, expected one checkpoint for every rank")

    def state_dict(self) -> dict:
        """The clock, the versions and update counts last pulled, the traffic counters."""
        return {"clock": self.clock, "versions": list(self.versions),
                "updates_seen": list(self.updates_seen),
                "traffic": [self.bytes_pushed, self.buffer_bytes_pushed, self.bytes_pulled,
                            self.pulls, self.pushes]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` before joining; joining then checks that the servers
        restored the same clock for this worker."""
        self.clock = self._restored_clock = int(state["clock"])
        self.versions = [int(v) for v in state["versions"]]
        self.updates_seen = [int(v) for v in state["updates_seen"]]
        (self.bytes_pushed, self.buffer_bytes_pushed, self.bytes_pulled, self.pulls,
         self.pushes) = (int(v) for v in state["traffic"])

    def _recover(self, exc: PeerError, op: str) -> None:
        """A server died. Without snapshots that is the end (re-raise). With them, wait
        until the launcher's restart of it has rejoined, introduce this worker to it again
        and take the clock its snapshot restored (the caller redoes from there)."""
        ranks = self.ps.server_ranks
        if not (self.ps.server_restarts and exc.peer in ranks and exc.reason == "gone"):
            raise exc
        k = ranks.index(exc.peer)
        gone = self.ps.transport.mailbox.gone
        deadline = time.monotonic() + self.ps.timeout
        while gone(exc.peer) is not None:
            if time.monotonic() > deadline:
                raise PeerError(f"ParameterServer.{op}: worker rank {self.ps.rank}: parameter "
                                f"server {k} (rank {exc.peer}) is gone and did not come back "
                                f"within {self.ps.timeout:g} s: {exc}", exc.peer, "gone")
            time.sleep(0.05)
        self._inflight = [(r, j) for r, j in self._inflight if j != k]
        replies = self._request(wire.request(wire.JOIN), with_weights=False, op="join",
                                only=[k])
        self.clock = replies[0]["clock"]
        self.versions[k] = replies[0]["version"]
        self.server_restarts_seen += 1

    # ----- helpers ----------------------------------------------------------------------------
    def _server_error(self, op: str, k: int, exc: BaseException) -> CommError:
        rank = self.ps.server_ranks[k]
        why = "is gone" if isinstance(exc, PeerError) and exc.reason == "gone" else "failed"
        return PeerError(f"ParameterServer.{op}: worker rank {self.ps.rank}: parameter server "
                         f"{k} (rank {rank}) {why}: {exc}", rank,
                         exc.reason if isinstance(exc, PeerError) else "gone")

    def _wait(self, work: Work, op: str, k: int, deadline: float, what: str) -> Any:
        """Wait for ``work`` (a send or receive with server ``k``) until ``deadline``; its
        result. Failures become the PeerError of that server."""
        if not poll_until(work.is_completed, deadline):
            getattr(work, "cancel", lambda: None)()
            rank = self.ps.server_ranks[k]
            raise PeerError(f"ParameterServer.{op}: worker rank {self.ps.rank} timed out after "
                            f"{self.ps.timeout:g} s waiting for parameter server {k} (rank "
                            f"{rank}) ({what})", rank, "timeout")
        try:
            return work.wait()
        except CommError as exc:
            raise self._server_error(op, k, exc) from None

    def _send(self, k: int, tag: int, op: str, obj: Any = None,
              array: np.ndarray | None = None) -> Work:
        """Start sending ``obj`` (an object message) or ``array`` to server ``k``."""
        rank, group, timeout = self.ps.server_ranks[k], self.ps.group, self.ps.timeout
        try:
            work = p2p.isend(array, rank, group, tag, timeout) if array is not None else \
                p2p.isend_object(obj, rank, tag=tag, group=group, timeout=timeout)
        except CommError as exc:
            raise self._server_error(op, k, exc) from None
        self._inflight.append((work, k))
        return work

    def _reap(self, op: str) -> None:
        keep = []
        for work, k in self._inflight:
            if not work.is_completed():
                keep.append((work, k))
                continue
            try:
                work.wait()
            except CommError as exc:
                raise self._server_error(op, k, exc) from None
        self._inflight = keep

    def _request(self, head: dict, with_weights: bool, op: str,
                 only: list[int] | None = None) -> list[dict]:
        """Send ``head`` to every server (or those in ``only``) and wait for each reply (and
        its weights)."""
        self._reap(op)
        pending = []
        group, timeout = self.ps.group, self.ps.timeout
        for k, rank in enumerate(self.ps.server_ranks):
            if only is not None and k not in only:
                continue
            self._send(k, wire.T_REQUEST, op, obj={**head, "shard_key": self.ps.shard_keys[k]})
            recvs: list[Work] = [p2p.irecv_object(rank, tag=wire.T_REPLY, group=group,
                                                  timeout=timeout,
                                                  max_bytes=wire.MAX_MESSAGE_BYTES)]
            bufs = []
            if with_weights:
                shard = self.ps.shards[k]
                for (dtype, _), n in zip(shard.groups, shard.sizes(self.ps.shapes), strict=True):
                    bufs.append(np.empty(n, dtype))
                    recvs.append(p2p.irecv(bufs[-1], rank, group, wire.T_PULL_DATA, timeout))
            pending.append((k, recvs, bufs))
        deadline = time.monotonic() + self.ps.timeout
        replies = []
        for k, recvs, bufs in pending:
            got = [self._wait(work, op, k, deadline, "reply") for work in recvs]
            replies.append(wire.parse_reply(got[0], self.ps.server_ranks[k]))
            if with_weights:
                self._install(k, bufs)
        return replies

    def _install(self, k: int, bufs: list[np.ndarray]) -> None:
        shard = self.ps.shards[k]
        for (_, members), flat in zip(shard.groups, bufs, strict=True):
            offset = 0
            for i in members:
                p = self.ps.params_all[i]
                n = int(np.prod(p.shape, dtype=np.int64))
                target = borrow(p, "ParameterServer.pull")
                target.arr[...] = flat[offset:offset + n].reshape(target.arr.shape)
                target.commit()
                offset += n
            self.bytes_pulled += flat.nbytes

    # ----- the API ----------------------------------------------------------------------------
    def pull(self) -> int:
        self.join()
        while True:
            try:
                return self._pull()
            except PeerError as exc:
                self._recover(exc, "pull")

    def _pull(self) -> int:
        with tracing.span("ps pull", "ps", clock=self.clock) as args:
            replies = self._request(wire.request(wire.PULL, self.clock), with_weights=True,
                                    op="pull")
            args["versions"] = [r["version"] for r in replies]
        self.versions = [r["version"] for r in replies]
        self.updates_seen = [r["updates"] for r in replies]
        self.pulls += 1
        return min(self.versions)

    def push(self, examples: int, loss_sum: float, correct: int) -> Work:
        self.join()
        try:
            return self._push(examples, loss_sum, correct)
        except PeerError as exc:  # lost with its server; the restored clock says what to redo
            self._recover(exc, "push")
            return Work.completed()

    def _push(self, examples: int, loss_sum: float, correct: int) -> Work:
        with tracing.span("ps push", "ps", clock=self.clock, versions=list(self.versions)):
            return self._push_now(examples, loss_sum, correct)

    def _push_now(self, examples: int, loss_sum: float, correct: int) -> Work:
        self._reap("push")
        reqs = []
        for k, shard in enumerate(self.ps.shards):
            head = wire.request(wire.PUSH, self.clock, self.versions[k], examples, loss_sum,
                                correct, self.updates_seen[k], self.ps.shard_keys[k])
            payload = []
            for dtype, members in shard.groups:
                parts = []
                for i in members:
                    p = self.ps.params_all[i]
                    if p.grad is None:
                        parts.append(np.zeros(int(np.prod(p.shape, dtype=np.int64)), dtype))
                    else:
                        parts.append(p.grad.numpy().astype(dtype, copy=False).reshape(-1))
                payload.append(np.ascontiguousarray(np.concatenate(parts)))
            reqs.append((self._send(k, wire.T_REQUEST, "push", obj=head), k))
            for buf in payload:
                reqs.append((self._send(k, wire.T_PUSH_DATA, "push", array=buf), k))
                self.bytes_pushed += buf.nbytes
            if k == 0:
                for buf in self._buffers():
                    reqs.append((self._send(k, wire.T_BUFFER_DATA, "push", array=buf), k))
                    self.buffer_bytes_pushed += buf.nbytes
        self.clock += 1
        self.pushes += 1
        deadline = time.monotonic() + self.ps.timeout

        def test() -> bool:
            done = True
            for work, k in reqs:
                if not work.is_completed():
                    done = False
                    continue
                try:
                    work.wait()
                except CommError as exc:
                    if self.ps.server_restarts:
                        continue  # complete() recovers
                    raise self._server_error("push", k, exc) from None
            return done

        def complete() -> None:
            for req, k in reqs:
                try:
                    self._wait(req, "push", k, deadline, "sending the gradient")
                except PeerError as exc:
                    self._recover(exc, "push")

        return PolledWork(test, complete)

    def _buffers(self) -> list[np.ndarray]:
        """The model's buffers as they are now, one flat array per dtype group."""
        ps = self.ps
        return [np.ascontiguousarray(np.concatenate(
            [ps.buffers_all[i].numpy().astype(dtype, copy=False).reshape(-1) for i in members]))
            for dtype, members in ps.buffer_groups]

    def finish(self, report: dict | None = None) -> None:
        self.join()
        while True:
            try:
                self._request(wire.request(wire.FINISH, self.clock, report=report),
                              with_weights=False, op="finish")
                break
            except PeerError as exc:
                self._recover(exc, "finish")
        self._reap("finish")
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2.0)

    def _heartbeat(self) -> None:
        beat = wire.ping()
        last: dict[int, Any] = {}
        while not self._stop.wait(self.ps.heartbeat):
            for k, rank in enumerate(self.ps.server_ranks):
                try:
                    if k in last and not last[k].test():
                        continue  # the previous beat is still on its way
                    last[k] = self.ps.hb_chan.isend(beat, rank, wire.T_HEARTBEAT)
                except CommError:
                    last.pop(k, None)  # the main thread reports (or waits out) a dead server
