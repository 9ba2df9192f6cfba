"""``--strategy ps``: a parameter server (``needle.distributed.ParameterServer``).

The job has ``--servers S`` server ranks (0..S-1) and ``--nproc W`` worker ranks (S..S+W-1).
Workers run the usual step loop on their share of each global batch: pull the weights, forward
and backward, push the gradients (with their example count, loss and correct count). Servers
hold the parameters, sharded by bytes, and the optimizer state of their shard, and apply
updates by ``--ps-mode`` (sync, async, ssp with ``--staleness``, backup with ``--wait-for``;
docs/parameter_server.md). Server 0 reports: it collects the other servers' shards and
counters, evaluates the final weights and writes ``summary.json`` with a ``ps`` block.

A worker killed by ``--kill-worker`` is declared dead by the servers and training finishes
without it; with ``--restart-workers N`` the launcher restarts it, and it continues its data
shard from the servers' clock.

Checkpoints (``--ps-mode sync`` only): ``--save-every K`` writes step K's checkpoint when
round K is applied. Each server writes its part from ``serve``'s update hook (its shard,
optimizer state and bookkeeping: ``ParameterServer.state_dict``, the state its snapshots
hold), each worker writes its random streams, cursor, model buffers and clock once it has
pushed step K; the manifest lists every rank's shard. ``--resume D`` restores all of it, so the
continuation is the uninterrupted run's, bit for bit. The other modes apply gradients in the
order they arrive, so they refuse ``--save-every``, ``--resume``, ``--verify-resume`` and
``--die-at-step``.
"""
from __future__ import annotations

import time

import numpy as np

from .base import StepResult, Strategy


class ParameterServerStrategy(Strategy):
    name = "ps"
    mixed_precision_and_accumulation = False

    @staticmethod
    def add_arguments(group) -> None:
        group.add_argument("--servers", type=int, default=1,
                           help="server ranks (the --nproc workers come after them)")
        group.add_argument("--ps-mode", default="sync",
                           help="sync | async | ssp | backup (docs/parameter_server.md)")
        group.add_argument("--staleness", type=int, default=1,
                           help="ssp: how many clocks a worker may run ahead of the slowest")
        group.add_argument("--wait-for", type=int, default=None,
                           help="backup: a round proceeds with the first k gradients "
                                "(default W - 1)")
        group.add_argument("--dead-after", type=float, default=10.0,
                           help="seconds without a heartbeat before a worker is dead")
        group.add_argument("--ps-eval-every", type=int, default=0, metavar="K",
                           help="with one server: evaluate the held-out accuracy every K "
                                "updates (summary ps.accuracy_timeline; 0: off)")
        group.add_argument("--restart-workers", type=int, default=0, metavar="N",
                           help="restart a killed worker up to N times (tcp); it rejoins")

    @classmethod
    def validate(cls, cfg) -> None:
        from needle.distributed.ps import MODES

        from ..config import UsageError

        x = cfg.extra
        if getattr(cfg, "clip_grad", None) is not None:
            raise UsageError("--clip-grad does not apply to --strategy ps, expected no "
                             "--clip-grad: each server updates its own shard when its "
                             "gradients arrive (async, ssp, backup), so no rank holds the "
                             "whole combined gradient to take its norm")
        if x.get("servers", 1) < 1:
            raise UsageError(f"--servers must be >= 1, got {x.get('servers')}")
        if x.get("ps_mode", "sync") not in MODES:
            raise UsageError(f"unknown --ps-mode {x.get('ps_mode')!r}, expected one of "
                             f"{', '.join(MODES)}")
        if x.get("staleness", 1) < 0:
            raise UsageError(f"--staleness must be >= 0, got {x.get('staleness')}")
        k = x.get("wait_for")
        if k is not None and not 1 <= k <= cfg.nproc:
            raise UsageError(f"--wait-for must be in [1, --nproc {cfg.nproc}], got {k}")
        if x.get("dead_after", 10.0) <= 0 or x.get("restart_workers", 0) < 0:
            raise UsageError("--dead-after must be > 0 and --restart-workers >= 0")
        cls._validate_checkpoints(cfg)

    @staticmethod
    def _validate_checkpoints(cfg) -> None:
        """Checkpoints need a synchronous job in which every rank reaches each boundary."""
        from ..config import UsageError

        x = cfg.extra
        mode = x.get("ps_mode", "sync")
        used = [flag for flag, value in (("--save-every", cfg.save_every),
                                         ("--resume", cfg.resume),
                                         ("--verify-resume", cfg.verify_resume),
                                         ("--die-at-step", cfg.die_at_step))
                if value is not None]
        if used and mode != "sync":
            raise UsageError(
                f"{used[0]} applies to --strategy ps with --ps-mode sync only, got --ps-mode "
                f"{mode}: its servers apply gradients in the order they arrive, so no step "
                f"exists at which every rank stands at the same update, and a resumed run "
                f"would not continue the uninterrupted one")
        faults = [(flag, value) for flag, value in (
            ("--kill-worker", cfg.kill_worker),
            ("--freeze-worker", getattr(cfg, "freeze_worker", None)),
            ("--restart-workers", x.get("restart_workers", 0) or None)) if value is not None]
        saving = [flag for flag, value in (("--save-every", cfg.save_every),
                                           ("--verify-resume", cfg.verify_resume))
                  if value is not None]
        if saving and faults:
            raise UsageError(
                f"{saving[0]} with --strategy ps needs every worker at each checkpoint (every "
                f"rank writes its shard, then they meet at a barrier), so it excludes "
                f"--kill-worker, --freeze-worker and --restart-workers, got "
                f"{faults[0][0]} {faults[0][1]}")

    @classmethod
    def ranks(cls, cfg) -> int:
        return cfg.nproc + cfg.extra.get("servers", 1)

    @property
    def distributed(self) -> bool:
        return True

    # ---- roles -----------------------------------------------------------------------------
    @property
    def servers(self) -> int:
        return int(self.cfg.extra.get("servers", 1))

    @property
    def serving(self) -> bool:
        return self.rank < self.servers

    @property
    def is_reporter(self) -> bool:
        return self.rank == 0

    def setup(self, ctx) -> None:
        from needle import nn
        from needle.distributed import ParameterServer

        self.ctx = ctx
        self.model = ctx.new_model()
        self.loss_fn = nn.SoftmaxLoss()
        x = self.cfg.extra
        workers = self.world_size - self.servers
        mode = x.get("ps_mode", "sync")
        wait_for = x.get("wait_for") or max(1, workers - 1)
        self.ps = ParameterServer(
            self.model, servers=self.servers, mode=mode, optimizer=ctx.new_optimizer,
            staleness=x.get("staleness", 1), wait_for=wait_for if mode == "backup" else None,
            dead_after=x.get("dead_after", 10.0),
            rejoin_wait=30.0 if x.get("restart_workers", 0) else 0.0)
        self.optimizer = self.ps.optimizer
        self.started = time.perf_counter()

    def data_shard(self) -> tuple[int, int]:
        return self.world_size - self.servers, max(self.rank - self.servers, 0)

    def start_step(self) -> int:
        """A restarted worker continues its data shard at the servers' clock."""
        return 0 if self.serving else self.ps.clock

    def train_step(self, X: np.ndarray, y: np.ndarray) -> StepResult | None:
        self.ps.pull()
        self.model.train()
        for p in self.model.parameters():
            p.grad = None
        Xb, yb = self._tensors(X, y)
        logits = self.model(Xb)
        loss = self.loss_fn(logits, yb)
        loss.backward()
        n = int(y.shape[0])
        correct = int((logits.numpy().argmax(axis=1) == y.astype(np.int64)).sum())
        self.ps.push(examples=n, loss_sum=float(loss.numpy()) * n, correct=correct).wait()
        return None

    def evaluate(self, X, y):
        return None

    # ---- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's part of a checkpoint. A server: ``ParameterServer.state_dict`` (shard,
        optimizer state, bookkeeping), taken in the serve loop right after the round is
        applied. A worker: its model (the parameters are pulled again, the buffers are its
        own running statistics) and its clock."""
        if self.serving:
            return {"ps": self.ps.state_dict()}
        return {"model": self.model.state_dict(), "ps": self.ps.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s part of this rank (``--resume``, before serving or
        the first pull)."""
        if not self.serving:
            self.model.load_state_dict(state["model"])
        self.ps.load_state_dict(state["ps"], f"--resume {self.cfg.resume}")

    def state_sha256(self) -> str | None:
        """Workers: None (server 0 reports the digest, see :meth:`_servers_digest`)."""
        return None

    def collect_reports(self) -> None:
        """A worker's FINISH carries its memory row (peak included) to the servers: server 0
        writes the summary, and the protocol is the only line between it and the workers."""
        meter = getattr(self, "_memory", None)
        if meter is not None:
            meter.finish()
        self.ps.finish(report=None if meter is None else meter.row)

    # ---- metrics -------------------------------------------------------------------------
    def meters(self) -> list:
        """A worker's memory row and step peak, sent with its FINISH (no collective: the
        servers are not in the loop)."""
        from ..metrics import ModelStateMemory, PeakMemory

        self._memory = ModelStateMemory(self.memory_probe, self.rank, self.world_size,
                                        peak=PeakMemory(self.predict_peak, self.ctx.device),
                                        gather=False)
        return [self._memory]

    def predict_peak(self, X: np.ndarray, y: np.ndarray, first: bool) -> dict:
        from ..peak import predict_ps_worker

        return predict_ps_worker(self, X, y, first)

    def close(self) -> None:
        ps = getattr(self, "ps", None)
        if ps is not None:
            ps.close()

    # ---- servers -----------------------------------------------------------------------------
    def run_server(self, X, Xt, yt, device) -> dict | None:
        """Serve until the workers are done; on server 0, the summary (collective among the
        servers only: server k > 0 sends its shard and counters to server 0)."""
        import needle.distributed as dist

        from ..checkpoints import Cursor, RunCheckpoints
        from ..faults import parse_faults
        from ..loop import History
        from ..summary import build_summary

        timeline: list[list[float]] = []
        eval_every = int(self.cfg.extra.get("ps_eval_every", 0) or 0)
        evaluating = eval_every > 0 and self.servers == 1
        checkpoints = RunCheckpoints(self.cfg, self, self.rank, self.world_size)
        checkpoints.restore()  # before serving: the workers join at the restored clocks
        faults = parse_faults(self.cfg, self.world_size)
        faults.before_round(self.ps.server.updates + 1)

        epochs = None
        if self.rank == 0:  # server 0 hears every worker's loss: it prints the epochs
            epochs = _EpochLines(self.cfg, X.shape[0], self.world_size - self.servers,
                                 self.ps.server.global_clock(),
                                 (lambda: self._local_evaluate(Xt, yt)[1])
                                 if self.servers == 1 else None)

        def on_update(updates: int) -> None:
            # on the serving thread, round `updates` applied and closed: a sync boundary
            if epochs is not None:
                epochs.after(self.ps.server)
            if evaluating and updates % eval_every == 0:
                _, acc = self._local_evaluate(Xt, yt)
                timeline.append([time.perf_counter() - self.started, updates, acc])
            try:
                checkpoints.maybe_save(Cursor(steps=updates))
            except dist.CommError as exc:
                # raised out of the serve loop, a CommError would be blamed on a worker
                raise RuntimeError(f"--strategy ps: server rank {self.rank} could not write "
                                   f"the checkpoint of step {updates}: {exc}") from exc
            faults.before_round(updates + 1)

        stats = self.ps.serve(on_update=on_update)
        if epochs is not None:
            epochs.after(self.ps.server, final=True)
        wall = time.perf_counter() - self.started
        role = self.ps.server
        digest = self._servers_digest()
        if self.rank != 0:
            dist.send_object(stats, 0, tag=71)
            for i in self.ps.shards[self.rank].params:
                dist.send(self.ps.params_all[i], 0, tag=73)
            return None
        every = [stats]
        for k in range(1, self.servers):
            every.append(dist.recv_object(k, tag=71))
            for i in self.ps.shards[k].params:
                dist.recv(self.ps.params_all[i], k, tag=73)
        losses, examples, loss_sum, correct = _losses(role.loss_log)
        test_loss, test_acc = self._local_evaluate(Xt, yt)
        history = History(epoch=[self.cfg.epochs], train_loss=[loss_sum / max(examples, 1)],
                          train_acc=[correct / max(examples, 1)], test_loss=[test_loss],
                          test_acc=[test_acc], examples_per_s=[examples / max(wall, 1e-9)])
        steps = max(stats["worker_clocks"] or [0])
        from ..data import steps_per_epoch
        from ..model_state import named_state, split_state

        # the model server 0 evaluated: every shard, and the buffers of worker
        # stats["buffers_from_worker"] (installed by serve)
        state = named_state(self.model, [p.numpy() for p in self.model.parameters()])
        params, buffers = split_state(self.model, state)
        summary = build_summary(self.cfg, self, device, history, losses, steps, wall, params,
                                X.shape[0], Xt.shape[0],
                                steps_per_epoch(X.shape[0], self.cfg.batch_size), buffers)
        summary["model_state"] = state
        summary["ps"] = self._block(every, steps)
        summary["ps"]["accuracy_timeline"] = timeline + [[wall, stats["updates_applied"],
                                                         test_acc]]
        summary["state_sha256"] = digest
        summary["resume"] = checkpoints.report()
        summary["memory"] = _memory_block(every[0], self.servers)
        return summary

    def _servers_digest(self) -> str | None:
        """The training state's SHA-256 on server 0: every server's shard, optimizer state
        and update count, and server 0's model buffers, each server's ``state_digest``
        hashed in server order (collective among the servers; None on the others)."""
        import hashlib

        import needle.distributed as dist

        from .base import state_digest

        role = self.ps.server
        mine = {"params": [p.numpy() for p in role.params],
                "optimizer": role.optimizer.state_dict(), "updates": role.updates,
                "buffers": [t.numpy() for t in self.ps.buffers_all] if self.rank == 0 else []}
        digest = state_digest(mine)
        if self.rank != 0:
            dist.send_object(digest, 0, tag=74)
            return None
        every = [digest] + [dist.recv_object(k, tag=74) for k in range(1, self.servers)]
        return hashlib.sha256(b"".join(bytes.fromhex(d) for d in every)).hexdigest()

    def _block(self, every: list[dict], steps: int) -> dict:
        first = every[0]
        workers = self.world_size - self.servers
        model_bytes = sum(s.nbytes for s in self.ps.shards)
        return {
            "mode": first["mode"], "servers": self.servers, "workers": workers,
            "updates_applied": first["updates_applied"],
            "gradients_dropped": first["gradients_dropped"],
            "workers_lost": first["workers_lost"], "workers_rejoined": first["workers_rejoined"],
            "staleness_histogram": first["staleness_histogram"],
            "max_staleness": max(s["max_staleness"] for s in every),
            "max_lead": max(s["max_lead"] for s in every),
            "update_delay_histogram": first["update_delay_histogram"],
            "bytes_pushed": sum(s["bytes_pushed"] for s in every),
            "bytes_pulled": sum(s["bytes_pulled"] for s in every),
            "buffer_bytes_pushed": first["buffer_bytes_pushed"],
            "buffers_from_worker": first["buffers_from_worker"],
            "bytes_predicted": {
                "pushed": workers * steps * model_bytes,
                "pulled": workers * steps * model_bytes,
                "per_worker_step": 2 * model_bytes,
                "server_ingress_per_step": [workers * s.nbytes for s in self.ps.shards],
                "formula": "each worker step pulls and pushes the model (M bytes): W x steps x "
                           "M each way; server s receives W x M_s per step (W x M / S when "
                           "balanced)"},
            "shard_bytes": [s.nbytes for s in self.ps.shards],
            "all_active": first["all_active"],
            "worker_clocks": first["worker_clocks"],
            "events": [e for s in every for e in s["events"]],
        }


def _memory_block(stats: dict, servers: int) -> dict:
    """``summary.json``'s ``memory``: each worker's row as its FINISH carried it (server 0's
    counters); a worker that never finished (killed, frozen) has none."""
    rows = []
    for k, report in enumerate(stats.get("worker_reports") or []):
        rows.append(report if report is not None else {
            "rank": servers + k, "peak": None,
            "why": "the worker did not finish (it died or left), so it sent no report"})
    return {"per_rank": rows, "when": "each worker's row, sent with its FINISH request",
            "measured": "requested bytes held per category (needle.memory), on the worker",
            "predicted": "needle.memory.estimate for the worker (no optimizer state: the "
                         "servers hold it)",
            "peak": {"measured": "peak_requested_bytes of the worker's device allocator over "
                                 "its step (peaks reset right before it)",
                     "predicted": "computed before the step (apps/training/peak.py, "
                                  "predict_ps_worker)"},
            "servers": "not in per_rank: a server runs no step"}


class _EpochLines:
    """Server 0's per-epoch lines, as the other strategies print them: loss and accuracy of
    the gradients the workers pushed in the epoch, held-out accuracy of the served model (one
    server holds all of it; with more, the model is whole only at the end), examples/s."""

    def __init__(self, cfg, n_train: int, workers: int, clock: int, evaluate):
        from ..data import global_batches

        self.ends, total = [], 0  # the worker clock at which each epoch ends
        for epoch in range(1, cfg.epochs + 1):
            total += len([b for b in global_batches(n_train, cfg.batch_size, cfg.seed, epoch)
                          if len(b) >= workers])
            self.ends.append(total)
        # a resumed run does not print the epochs its checkpoint had finished
        self.epoch = 1 + sum(end <= clock for end in self.ends)
        self.evaluate, self.since = evaluate, time.perf_counter()

    def after(self, role, final: bool = False) -> None:
        """Print each epoch the workers' clocks have passed (``final``: and the epoch a
        ``--max-steps`` run stopped in)."""
        from ..loop import print_epoch

        clock = role.global_clock()
        while self.epoch <= len(self.ends) and (final or clock >= self.ends[self.epoch - 1]):
            low = self.ends[self.epoch - 2] if self.epoch > 1 else 0
            entries = [e for e in role.loss_log if low < e[1] <= self.ends[self.epoch - 1]]
            examples = sum(e[2] for e in entries)
            if not examples:
                return
            now = time.perf_counter()
            print_epoch(self.epoch, sum(e[3] for e in entries) / examples,
                        sum(e[4] for e in entries) / examples,
                        self.evaluate() if self.evaluate else None,
                        examples / max(now - self.since, 1e-9))
            self.epoch, self.since = self.epoch + 1, now


def _losses(log) -> tuple[list[float], int, float, int]:
    """Per clock t: the example-weighted mean loss of the gradients pushed at clock t."""
    by_clock: dict[int, list[float]] = {}
    examples = correct = 0
    loss_sum = 0.0
    for _, clock, n, ls, c in log:
        entry = by_clock.setdefault(clock, [0.0, 0.0])
        entry[0] += ls
        entry[1] += n
        examples += n
        loss_sum += ls
        correct += c
    losses = [by_clock[t][0] / max(by_clock[t][1], 1) for t in sorted(by_clock)]
    return losses, examples, loss_sum, correct
